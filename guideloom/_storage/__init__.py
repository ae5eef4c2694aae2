"""Storage backends behind two small async interfaces (see :mod:`guideloom._storage.base`)."""

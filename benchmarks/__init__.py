"""guideloom's benchmarks: scripts that print figures (never timed unit tests)."""

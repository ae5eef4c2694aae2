"""Writing datasets: the writers, where they write (sinks), datasets in parts and Ray's datasink."""

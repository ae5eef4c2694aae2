"""Local caches of object-store datasets: the whole copy and the bounded chunk cache."""

"""Object-store datasets: the store client, range planning and fetching, retries and in-flight limits."""

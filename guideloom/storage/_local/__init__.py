"""Local datasets: a written folder read through memory maps or preadv, each block checked at first touch."""

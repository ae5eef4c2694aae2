"""The runtime: the ways of running an epoch (inline, thread workers, process workers, event
loops) behind one runner protocol."""

"""The pure core: plan, keyed permutation, orders, batch schedule and checkpoint arithmetic.

No I/O, no threads, no torch: every decision about which observation a rank sees at a step is
made here, and tested directly."""

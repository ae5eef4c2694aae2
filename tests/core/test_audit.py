"""The audit's arithmetic: a run's count and digest in closed form equal the sums over its
positions, and the digest tells multisets of positions apart."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from guideloom._core.audit import MODULUS, audit_base, range_digest, run_summary


def brute(run: list[int], n: int, x: int) -> tuple[int, int]:
    base, batches, b, w, rank = run
    positions = [
        p
        for j in range(batches)
        for p in range(base + j * b * w + rank * b, base + j * b * w + rank * b + b)
        if p < n
    ]
    return len(positions), sum(pow(x, p, MODULUS) for p in positions) % MODULUS


@settings(max_examples=300, deadline=None)
@given(
    base=st.integers(0, 200),
    batches=st.integers(0, 30),
    b=st.integers(1, 7),
    w=st.integers(1, 5),
    rank=st.integers(0, 4),
    n=st.integers(0, 600),
    epoch=st.integers(0, 3),
)
def test_a_runs_closed_form_is_the_sum_over_its_positions(
    base: int, batches: int, b: int, w: int, rank: int, n: int, epoch: int
) -> None:
    rank %= w
    x = audit_base(epoch)
    inverse = pow(x - 1, MODULUS - 2, MODULUS)
    run = [base, batches, b, w, rank]
    assert run_summary(run, n, x, inverse) == brute(run, n, x)


def test_a_repeated_or_skipped_block_changes_the_digest() -> None:
    x = audit_base(0)
    inverse = pow(x - 1, MODULUS - 2, MODULUS)
    whole = range_digest(x, inverse, 0, 100)
    assert (range_digest(x, inverse, 0, 50) + range_digest(x, inverse, 50, 100)) % MODULUS == whole
    skipped = (range_digest(x, inverse, 0, 40) + range_digest(x, inverse, 50, 100)) % MODULUS
    repeated = (whole + range_digest(x, inverse, 40, 50)) % MODULUS
    shifted = (range_digest(x, inverse, 0, 40) + range_digest(x, inverse, 50, 110)) % MODULUS
    assert len({whole, skipped, repeated, shifted}) == 4

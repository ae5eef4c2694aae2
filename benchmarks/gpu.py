"""The device-transfer stage on a CUDA GPU: bandwidth, overlap with compute, and correctness.

Over a uint16 stream in local files (``--mib`` MiB, written to a temporary folder), batches of
``--batch`` x ``--seq`` tokens widened to int64 (2 MiB by default):

- **bandwidth**: host-to-device GB/s of a plain ``torch`` copy of one batch's bytes, pinned and
  pageable, measured here and now (the card's limit), then the GB/s of batches the loader
  delivers on ``device="cuda"`` (``pin_memory`` on and off, no workers, thread and process
  workers), against the pinned copy, and the same loader on the CPU (no copy at all);
- **overlap**: the loader's copies alone, matrix products on another CUDA stream alone (as many
  as take about as long), and both at once: the share of the shorter that ran hidden under the
  longer (100%: the copies cost nothing beside the compute);
- **correctness**: with ``pin_memory=True`` (copies ``non_blocking``) while matrix products run
  on another stream, every batch equals the CPU loader's batch, for each kind of worker.

Without CUDA it says so and exits 0: nothing here can run, and nothing in CI needs a GPU.

    python -m benchmarks gpu              # ~1 minute on a GPU machine
    python -m benchmarks gpu --quick      # fewer batches
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import summary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import guideloom as gl  # noqa: E402

MiB = 2**20
#: The loader configurations measured: (label, keyword arguments).
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("num_workers=0", {}),
    ("num_workers=2 thread", {"num_workers": 2, "prefetch": 4}),
    ("num_workers=2 process", {"num_workers": 2, "parallel_method": "process", "prefetch": 4}),
]


def collate(samples: Sequence[np.ndarray]) -> torch.Tensor:
    """The rows as one int64 tensor (module level: process workers unpickle it by name)."""
    return torch.from_numpy(np.asarray(samples).astype(np.int64))


def no_cuda_message() -> str | None:
    """Why this benchmark cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        return (
            f"python -m benchmarks gpu needs a CUDA GPU: torch {torch.__version__} ({build}) sees "
            "none here; nothing was measured"
        )
    return None


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes, the GPU's queue drained before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def plain_copy_gbs(nbytes: int, reps: int) -> tuple[float, float]:
    """GB/s of a host-to-device copy of ``nbytes``: from pinned memory (``non_blocking``, the
    card's limit) and from pageable memory; the best of three runs of ``reps`` copies each."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def copies(src: torch.Tensor, non_blocking: bool) -> Callable[[], None]:
        def run() -> None:
            for _ in range(reps):
                dev.copy_(src, non_blocking=non_blocking)

        return run

    out = []
    for src, nb in ((pinned, True), (pageable, False)):
        copies(src, nb)()  # warm-up
        best = min(_timed(copies(src, nb)) for _ in range(3))
        out.append(reps * nbytes / best / 1e9)
    return out[0], out[1]


def make_loader(path: Path, device: torch.device, pin: bool, args: argparse.Namespace, **kw: Any) -> Any:
    return gl.StatefulDataLoader.from_storage(
        gl.open_stream(path), collate, sequence_length=args.seq, local_batch_size=args.batch,
        shuffle=True, shuffle_seed=0, device=device, pin_memory=pin, **kw,
    )  # fmt: skip


def endless(loader: Any) -> Iterator[Any]:
    """The loader's batches epoch after epoch (closing this closes the epoch's iterator)."""
    while True:
        yield from loader


def loader_gbs(path: Path, device: torch.device, pin: bool, args: argparse.Namespace, **kw: Any) -> float:
    """GB/s of batches the loader delivers to ``device`` over ``args.batches`` batches, after a
    warm-up (workers started, first windows read), the GPU's queue drained at both ends."""
    loader = make_loader(path, device, pin, args, **kw)
    with loader:
        it = endless(loader)
        for _ in range(args.warmup):
            next(it)
        nbytes = 0

        def take() -> None:
            nonlocal nbytes
            for _ in range(args.batches):
                batch = next(it)
                nbytes += batch.numel() * batch.element_size()

        seconds = _timed(take)
        it.close()
    return nbytes / seconds / 1e9


def overlap(path: Path, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """The loader's copies (``pin_memory=True``, thread workers) alone, matrix products on another
    stream alone, and both at once: seconds of each, and the share of the shorter hidden."""
    stream = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    out = torch.empty_like(a)

    def matmuls(k: int) -> None:
        with torch.cuda.stream(stream):
            for _ in range(k):
                torch.mm(a, a, out=out)

    loader = make_loader(path, torch.device("cuda"), True, args, num_workers=2, prefetch=4)
    with loader:
        it = endless(loader)
        for _ in range(args.warmup):
            next(it)

        def copies() -> None:
            for _ in range(args.batches):
                next(it)

        matmuls(2)  # warm-up (cuBLAS handles, clocks)
        per_mm = _timed(lambda: matmuls(10)) / 10
        t_copy = statistics.median(_timed(copies) for _ in range(3))
        k = max(1, round(t_copy / per_mm))
        t_mm = _timed(lambda: matmuls(k))

        def both() -> None:
            matmuls(k)  # queued on the other stream: returns at once
            copies()

        t_both = _timed(both)
        it.close()
    hidden = (t_copy + t_mm - t_both) / min(t_copy, t_mm)
    return t_copy, t_mm, t_both, max(0.0, min(1.0, hidden))


def check_under_compute(path: Path, args: argparse.Namespace, **kw: Any) -> str | None:
    """Every batch of a ``pin_memory=True`` CUDA loader, taken while matrix products run on
    another stream, equals the CPU loader's batch; a description of the first that does not."""
    with make_loader(path, torch.device("cpu"), False, args, **kw) as cpu_loader:
        it = endless(cpu_loader)
        expected = [next(it) for _ in range(args.check_batches)]
        it.close()
    stream = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    out = torch.empty_like(a)
    got = []
    with make_loader(path, torch.device("cuda"), True, args, **kw) as loader:
        it = endless(loader)
        for _ in range(args.check_batches):
            with torch.cuda.stream(stream):  # keeps the other stream busy meanwhile
                for _ in range(4):
                    torch.mm(a, a, out=out)
            got.append(next(it))  # kept on the device: its memory is not reused before the check
        it.close()
    torch.cuda.synchronize()
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if g.device.type != "cuda":
            return f"batch {i} is on {g.device}, not cuda"
        if not torch.equal(g.cpu(), e):
            return f"batch {i} differs from the CPU loader's ({int((g.cpu() != e).sum())} values)"
    return None


def write_stream(folder: Path, mib: int) -> Path:
    rng = np.random.default_rng(0)
    tokens = mib * MiB // 2
    chunk = 8 * MiB
    gl.write_stream(
        folder,
        (rng.integers(0, 50_000, min(chunk, tokens - s), dtype=np.uint16) for s in range(0, tokens, chunk)),
        dtype=np.uint16,
    )
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=summary(__doc__))
    ap.add_argument("--batch", type=int, default=64, help="samples per batch (default 64)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sample (default 4096)")
    ap.add_argument("--batches", type=int, default=200, help="timed batches per figure (default 200)")
    ap.add_argument("--mib", type=int, default=256, help="size of the stream in MiB (default 256)")
    ap.add_argument("--quick", action="store_true", help="50 batches per figure, a 64 MiB stream")
    args = ap.parse_args(argv)
    message = no_cuda_message()
    if message is not None:
        print(message)
        return
    if args.quick:
        args.batches, args.mib = 50, 64
    args.warmup = 20
    args.check_batches = min(args.batches, 100)
    batch_bytes = args.batch * args.seq * 8
    props = torch.cuda.get_device_properties(0)
    print(
        f"{props.name} (cuda:0), torch {torch.__version__}, CUDA {torch.version.cuda}; batches of "
        f"{args.batch} x {args.seq} int64 ({batch_bytes / MiB:.1f} MiB), {args.batches} timed per figure"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = write_stream(Path(tmp) / "stream", args.mib)
        pinned, pageable = plain_copy_gbs(batch_bytes, args.batches)
        print(f"plain torch copy of a batch's bytes: pinned {pinned:.1f} GB/s, pageable {pageable:.1f} GB/s")
        header = f"{'pin_memory':>10s} {'GB/s':>8s} {'x pinned copy':>14s} {'on cpu GB/s':>12s}"
        print(f"\n{'loader':26s} {header}")
        for label, kw in CONFIGS:
            on_cpu = loader_gbs(path, torch.device("cpu"), False, args, **kw)
            for pin in (True, False):
                rate = loader_gbs(path, torch.device("cuda"), pin, args, **kw)
                print(f"{label:26s} {pin!s:>10s} {rate:8.2f} {rate / pinned:14.2f} {on_cpu:12.2f}")
        t_copy, t_mm, t_both, hidden = overlap(path, args)
        print(
            f"\noverlap, thread workers, pin_memory=True: copies alone {t_copy * 1e3:.0f} ms, matrix "
            f"products on another stream alone {t_mm * 1e3:.0f} ms, both {t_both * 1e3:.0f} ms: "
            f"{hidden:.0%} of the shorter hidden"
        )
        failures = []
        for label, kw in CONFIGS:
            problem = check_under_compute(path, args, **kw)
            verdict = problem or "every batch equal to the CPU loader's"
            print(f"correctness under compute, {label}, pin_memory=True: {verdict}")
            if problem:
                failures.append(f"{label}: {problem}")
    if failures:
        raise SystemExit("batches on the GPU differ from the CPU loader's: " + "; ".join(failures))


if __name__ == "__main__":
    main()

"""The fault and bad-input trial as a group: each category's cases, run again, with a verdict.

    python -m benchmarks faults                  # every category (a few minutes)
    python -m benchmarks faults --only close     # the categories whose name contains a word
    python -m benchmarks faults --trials 2000 --seed 1   # the corruption fuzzer instead

With any of the corruption fuzzer's options (``--trials``, ``--seed``, ``--trial``, ``--jobs``,
``--timeout``, ``--json``, ``--list``, ``--no-s3``, ``--no-http``) the command runs that fuzzer
(``benchmarks/corruption.py``: datasets, caches and parts damaged in every storage mode, every
delivered batch checked against the pristine data), and ``--only`` selects its combinations.

Each category is a set of the test suite's cases (real servers on 127.0.0.1, real worker
processes), run in a pytest process of its own: replaced objects on every object-store server
and cache mode, short answers and a panicking client, ``StopIteration`` from ``collate_fn``,
truncated or foreign compressed input, checkpoints far past the end or nested without end, a
``collate_fn`` that never returns at close, process workers over S3 (requests and figures),
what crosses a process boundary, writer casts, and CLI usage errors. Prints each category's
passed and failed cases and seconds; the exit status is 0 only when none failed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import summary

ROOT = Path(__file__).resolve().parent.parent

CATEGORIES: dict[str, list[str]] = {
    "replaced objects": ["tests/storage/remote/test_integrity.py"],
    "short answers and panics": ["tests/storage/remote/test_short_answers.py"],
    "collate StopIteration": [
        "tests/loader/test_failures.py::test_collate_stop_iteration_is_an_error_not_the_end_of_the_epoch",
        "tests/loader/test_failures.py::test_collate_stop_async_iteration_is_an_error_under_async_for",
    ],
    "truncated compressed input": [
        "tests/cli/test_errors.py::test_truncated_zstd_input_is_a_data_error",
        "tests/cli/test_errors.py::test_input_that_is_not_zstd_is_a_data_error",
    ],
    "far offsets": [
        "tests/core/test_checkpoint.py::test_an_offset_past_a_final_padded_batch_is_refused",
        "tests/core/test_checkpoint.py::test_every_offset_a_run_can_save_is_accepted",
        "tests/core/test_checkpoint.py::test_an_offset_too_long_to_print_is_refused",
        "tests/loader/test_checkpoint.py::test_the_furthest_padded_offset_resumes_and_one_beyond_it_is_refused",
    ],
    "nested checkpoint values": [
        "tests/core/test_checkpoint.py::test_a_deeply_nested_value_is_refused_by_name",
        "tests/core/test_checkpoint.py::test_a_huge_value_is_cut_short_in_the_message",
        "tests/loader/test_checkpoint.py::test_load_state_dict_refuses_a_deeply_nested_seed_by_name",
    ],
    "close with a hung collate": ["tests/loader/test_close.py"],
    "process workers over S3": ["tests/storage/remote/test_processes_remote.py"],
    "what crosses a process boundary": ["tests/runtime/test_process_fidelity.py"],
    "writer casts": [
        "tests/storage/test_local.py::test_floats_beyond_their_exact_integers_are_refused_for_integer_dtypes",
        "tests/storage/test_local.py::test_every_value_must_survive_the_cast",
    ],
    "CLI usage errors": [
        "tests/cli/test_commands.py::test_inspect_counts_are_checked_by_the_parser",
        "tests/cli/test_errors.py::test_empty_output_is_a_usage_error",
    ],
}


def _run(cases: list[str]) -> tuple[int, int, float]:
    """Passed and failed cases and seconds of one pytest run."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *cases],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - t0
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", last))
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", last))
    if out.returncode not in (0, 1) and not failed:
        failed = 1  # pytest itself failed (a usage or collection error)
        print(out.stdout[-2000:], out.stderr[-2000:], sep="\n", file=sys.stderr)
    return passed, failed, seconds


FUZZER_OPTIONS = (
    "--trials",
    "--seed",
    "--trial",
    "--jobs",
    "--timeout",
    "--json",
    "--list",
    "--no-s3",
    "--no-http",
)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a.split("=")[0] in FUZZER_OPTIONS for a in argv):
        from benchmarks.corruption import main as fuzz

        fuzz(argv)
        return
    ap = argparse.ArgumentParser(prog="python -m benchmarks faults", description=summary(__doc__))
    ap.add_argument("--only", default="", help="run the categories whose name contains this word")
    args = ap.parse_args(argv)
    chosen = {k: v for k, v in CATEGORIES.items() if args.only.lower() in k.lower()}
    print(f"{'category':<34}{'passed':>8}{'failed':>8}{'seconds':>9}")
    total_failed = 0
    for name, cases in chosen.items():
        passed, failed, seconds = _run(cases)
        total_failed += failed
        print(f"{name:<34}{passed:>8}{failed:>8}{seconds:>9.1f}", flush=True)
    print("every case held" if total_failed == 0 else f"{total_failed} case(s) failed")
    raise SystemExit(1 if total_failed else 0)


if __name__ == "__main__":
    main()

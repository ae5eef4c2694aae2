"""The test support's zygote (``tests/support/zygote.py``, not guideloom's worker zygote): a
forked child runs its program as ``python`` would, in its own environment, folder and log, and its
exit status comes back as :class:`subprocess.Popen` gives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.ranks import run_ranks
from tests.support.zygote import Zygote

PROGRAM = """
import os, sys, threading, time, warnings
print("argv", sys.argv[1:], "cwd", os.getcwd(), "rank", os.environ.get("RANK"), "path0", sys.path[0])
print("main", __name__, "json" in sys.modules, flush=True)
what = sys.argv[1]
if what == "warn":
    warnings.warn("a warning")
if what == "raise":
    raise ValueError("the program failed")
if what == "sleep":
    time.sleep(60)
if what == "thread":  # a non-daemon thread is joined before the interpreter ends
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
sys.exit(3 if what == "exit" else 0)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "prog" / "program.py"
    path.parent.mkdir()
    path.write_text(PROGRAM)
    return path


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def test_a_child_runs_its_script_as_python_would_and_its_status_comes_back(
    script: Path, tmp_path: Path
) -> None:
    with Zygote(tmp_path / "zygote.log", ["json"], cwd=ROOT, env=_env()) as zygote:
        logs = {w: tmp_path / f"{w}.log" for w in ("ok", "exit", "raise", "thread")}
        children = {
            w: zygote.start([str(script), w], log, env=dict(_env(), RANK="1"), cwd=tmp_path)
            for w, log in logs.items()
        }
        codes = {w: c.wait(timeout=30) for w, c in children.items()}
    assert codes == {"ok": 0, "exit": 3, "raise": 1, "thread": 0}
    out = logs["ok"].read_text()
    assert f"argv ['ok'] cwd {tmp_path} rank 1 path0 {script.parent}" in out
    assert "main __main__ True" in out  # the zygote's imports are there
    assert "ValueError: the program failed" in logs["raise"].read_text()
    assert "thread done" in logs["thread"].read_text()


def test_a_killed_child_reads_minus_nine_and_closing_the_zygote_ends_the_others(
    script: Path, tmp_path: Path
) -> None:
    zygote = Zygote(tmp_path / "zygote.log", [], cwd=ROOT, env=_env())
    try:
        one = zygote.start([str(script), "sleep"], tmp_path / "one.log")
        other = zygote.start([str(script), "sleep"], tmp_path / "other.log")
        assert one.poll() is None
        one.kill()
        assert one.wait(timeout=30) == -signal.SIGKILL
        one.kill()  # once ended, a kill does nothing
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=0.1)
    finally:
        zygote.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(other.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"child {other.pid} outlived its zygote")


def test_a_child_runs_a_module_with_the_zygotes_interpreter_options(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "prog.py").write_text(PROGRAM)
    env = dict(_env(), PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    with Zygote(tmp_path / "zygote.log", ["pkg"], cwd=ROOT, env=env, python=["-W", "error"]) as zygote:
        warned = zygote.start(["warn"], tmp_path / "warn.log", module="pkg.prog")
        ok = zygote.start(["ok"], tmp_path / "ok.log", module="pkg.prog")
        assert (warned.wait(timeout=30), ok.wait(timeout=30)) == (1, 0)
    assert "UserWarning: a warning" in (tmp_path / "warn.log").read_text()  # -W error holds
    assert "argv ['ok']" in (tmp_path / "ok.log").read_text()
    assert "main __main__" in (tmp_path / "ok.log").read_text()


def test_ranks_output_begins_with_what_the_imports_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_ranks`` forks its ranks from a zygote: a warning the program's imports gave there is
    in each rank's output, as it was when each rank imported them itself."""
    (tmp_path / "noisy.py").write_text("import warnings\nwarnings.warn('imported noisily')\n")
    (tmp_path / "prog.py").write_text(
        "import os\nimport sys\nimport noisy\nprint('rank', os.environ['RANK'])\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(tmp_path)]))
    outputs = run_ranks(2, [sys.executable, str(tmp_path / "prog.py")], cwd=tmp_path)
    assert all("UserWarning: imported noisily" in out for out in outputs), outputs
    assert [out.splitlines()[-1] for out in outputs] == ["rank 0", "rank 1"]
    (tmp_path / "prog.py").write_text("import sys\nimport os\nsys.exit(int(os.environ['RANK']) * 4)\n")
    with pytest.raises(AssertionError, match="rank 1 of 2 failed \\(4\\)"):
        run_ranks(2, [sys.executable, "-W", "error", str(tmp_path / "prog.py")], cwd=tmp_path)


def test_a_child_runs_code_as_python_c_would(tmp_path: Path) -> None:
    code = PROGRAM + "\n"  # the same program, given as code
    bare_code = "import sys\nprint(sys.argv, '__file__' in dir(), repr(sys.stdin.read()))"  # stdin: empty
    with Zygote(tmp_path / "zygote.log", ["json"], cwd=ROOT, env=_env(), python=["-W", "error"]) as zygote:
        ok = zygote.start(["ok"], tmp_path / "ok.log", code=code, cwd=tmp_path)
        exits = zygote.start(["exit"], tmp_path / "exit.log", code=code)
        warned = zygote.start(["warn"], tmp_path / "warn.log", code=code)
        bare = zygote.start([], tmp_path / "bare.log", code=bare_code)
        codes = [c.wait(timeout=30) for c in (ok, exits, warned, bare)]
    fresh = subprocess.run(
        [sys.executable, "-c", bare_code],
        check=True,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert codes == [0, 3, 1, 0]
    assert f"argv ['ok'] cwd {tmp_path} rank None path0 \n" in (tmp_path / "ok.log").read_text()
    assert "main __main__ True" in (tmp_path / "ok.log").read_text()
    assert "UserWarning: a warning" in (tmp_path / "warn.log").read_text()  # -W error holds
    assert (tmp_path / "bare.log").read_text() == fresh.stdout == "['-c'] False ''\n"

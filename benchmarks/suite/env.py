"""The bench venv: torch's CPU build first (pinned by a constraints file), then guideloom and its peers.

It lives outside the repository (``$GUIDELOOM_BENCH_VENV``, default
``$TMPDIR/guideloom-bench-venv``), so the project's own ``.venv`` stays as ``make`` built it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = os.environ.get("GUIDELOOM_BENCH_TORCH", "torch==2.13.0")
# The peers, with the versions this suite was written against (Python 3.11, torch 2.13).
PEERS = [
    "torchdata==0.11.0",
    "mosaicml-streaming==0.13.0",
    "litdata==0.2.76",
    "polars>1.0",  # LitData's ParquetLoader
    "grain==0.2.18",
    "array-record==0.8.6",
]
TOOLS = ["psutil>=5.9", "matplotlib>=3.8", "py-spy>=0.3", "pyinstrument>=4.6"]

# PyPI's torchvision wheel is a CUDA build, unusable with torch's CPU build; MosaicML Streaming
# imports it at `import streaming` (for its vision datasets only). The suite installs this stub.
_STUB = {
    "__init__.py": '"""Stub installed by guideloom\'s benchmarks: streaming.vision imports torchvision."""\n',
    "datasets.py": (
        "import torch.utils.data\n\n\nclass VisionDataset(torch.utils.data.Dataset):\n    pass\n\n\n"
        "class CIFAR10(VisionDataset):\n    pass\n"
    ),
    "transforms/__init__.py": "",
    "transforms/functional.py": (
        "def to_tensor(*args, **kwargs):\n    raise ImportError('torchvision stub')\n"
    ),
}


def venv_path() -> Path:
    return Path(os.environ.get("GUIDELOOM_BENCH_VENV", Path(tempfile.gettempdir()) / "guideloom-bench-venv"))


def _refuse_cuda_torch(py: Path, env: dict[str, str]) -> None:
    """Resolve ``TORCH`` without installing it and refuse a CUDA build (it pulls gigabytes of
    ``nvidia-*`` wheels the CPU-only suite never uses)."""
    report = subprocess.run(
        [str(py), "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", "-", TORCH],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    names = [item["metadata"]["name"] for item in json.loads(report)["install"]]
    cuda = sorted(n for n in names if n.lower().startswith("nvidia-"))
    if cuda:
        raise SystemExit(
            f"{TORCH} resolves to a CUDA build here (it pulls {', '.join(cuda[:3])}, ...): set "
            "GUIDELOOM_BENCH_TORCH to a CPU build, e.g. GUIDELOOM_BENCH_TORCH='torch==2.13.0+cpu' with "
            "PIP_EXTRA_INDEX_URL set to PyTorch's CPU wheel index, then run --setup-only again"
        )


def ensure_venv(force: bool = False) -> Path:
    venv = venv_path()
    py = venv / "bin" / "python"
    marker = venv / ".guideloom-bench-installed"
    if marker.exists() and not force:
        return py
    print(f"setting up the bench venv at {venv} (once) ...", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    env = dict(os.environ, PIP_CONSTRAINT=str(constraints))
    pip = [str(py), "-m", "pip", "install", "-q"]
    _refuse_cuda_torch(py, env)
    subprocess.run([*pip, TORCH], check=True, env=env)
    subprocess.run([*pip, "-e", f"{ROOT}[torch,remote]", *PEERS, *TOOLS], check=True, env=env)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision"], check=False, env=env)
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    for rel, text in _STUB.items():
        f = Path(site) / "torchvision" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    subprocess.run(
        [str(py), "-c", "import torch, torchdata, streaming, litdata, grain.python; print('peers import')"],
        check=True,
    )
    marker.write_text("ok\n")
    return py


def ensure_bench_python(argv: list[str]) -> None:
    """Re-run in the bench venv (created on first use) unless the peers import here."""
    try:
        import psutil  # noqa: F401
        import streaming  # noqa: F401
        import torchdata  # noqa: F401

        return
    except ImportError:
        pass
    py = ensure_venv()
    if Path(sys.prefix).resolve() == venv_path().resolve():
        raise SystemExit(
            "the bench venv lacks its peers: run `python -m benchmarks suite --setup-only --force`"
        )
    print(f"(running in {py})", flush=True)
    os.execv(str(py), [str(py), "-m", "benchmarks", *argv])

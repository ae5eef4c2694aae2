"""The public surface: names, one __all__, private modules, typing marker."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import guideloom
import guideloom.pytorch
import guideloom.types

CONTRACT_NAMES = {
    "StatefulDataLoader",
    "StreamDataset",
    "DocumentDataset",
    "DatasetAbstract",
    "MemoryStreamStorage",
    "MemoryDocumentStorage",
    "write_stream",
    "write_documents",
    "open_stream",
    "open_documents",
}


def test_all_is_sorted_complete_and_importable() -> None:
    assert guideloom.__all__ == sorted(guideloom.__all__)
    assert set(guideloom.__all__) >= CONTRACT_NAMES
    for name in guideloom.__all__:
        assert hasattr(guideloom, name), name
    public = {n for n in dir(guideloom) if not n.startswith("_")} - {
        "annotations",
        "pytorch",
        "storage",
        "torchft",  # a public module of its own (guideloom.torchft), an attribute once imported
        "types",
    }
    assert public <= set(guideloom.__all__), public - set(guideloom.__all__)


def test_exported_objects_claim_the_public_module() -> None:
    for name in guideloom.__all__:
        obj = getattr(guideloom, name)
        module = getattr(obj, "__module__", None)
        if module is not None and name != "__version__":
            assert module.startswith("guideloom"), (name, module)


def test_loader_is_the_same_object_in_both_modules() -> None:
    assert guideloom.StatefulDataLoader is guideloom.pytorch.StatefulDataLoader
    assert guideloom.StatefulDataLoaderStateDict is guideloom.types.StatefulDataLoaderStateDict


def test_implementation_modules_are_private() -> None:
    pkg = Path(guideloom.__file__).parent
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg)
        if rel.name in ("__init__.py", "__main__.py") or any(p.startswith("_") for p in rel.parts):
            continue
        assert str(rel) in ("pytorch.py", "torchft.py", "types.py", "storage/base.py"), f"public module {rel}"
    assert (pkg / "py.typed").exists()


def test_storage_face_is_sorted_and_the_same_objects() -> None:
    """``guideloom.storage`` is the storage layer's public face: its names are guideloom's own."""
    import guideloom.storage as storage

    assert storage.__all__ == sorted(storage.__all__)
    for name in storage.__all__:
        obj = getattr(storage, name)
        if name in guideloom.__all__:
            assert getattr(guideloom, name) is obj, name


def test_error_hierarchy() -> None:
    from guideloom import DatasetFormatError, DatasetIntegrityError, GuideloomError, StorageError

    assert issubclass(DatasetIntegrityError, DatasetFormatError)
    assert issubclass(DatasetFormatError, ValueError) and issubclass(DatasetFormatError, GuideloomError)
    assert issubclass(StorageError, OSError)


def test_import_without_torch_works_and_the_loader_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, guideloom as gl\n"
        "s = gl.MemoryStreamStorage(np.arange(10))\n"
        "try:\n"
        "    gl.StatefulDataLoader.from_storage(s, list, sequence_length=2)\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "guideloom[torch]" in out


def test_modules_import_cleanly() -> None:
    for mod in ("guideloom._core.plan", "guideloom.storage._format._manifest"):
        m = importlib.import_module(mod)
        assert "torch" not in getattr(m, "__dict__", {})


def test_the_checkpoint_typeddict_requires_the_pages_five_keys() -> None:
    """At run time too (``from __future__ import annotations`` made Python 3.11 count the
    ``NotRequired`` keys as required)."""
    from guideloom.types import StatefulDataLoaderStateDict as State

    assert State.__required_keys__ == {"epoch", "observation_offset", "shuffle", "shuffle_seed", "drop_last"}
    assert State.__optional_keys__ == {
        "dataset",
        "counts",
        "shuffle_block_size",
        "shuffle_window",
        "shuffle_block_auto",
        "history",
    }

"""The training-framework recipes of ``examples/recipes/``, run with the real frameworks.

Each recipe trains on 2 gloo ranks (processes started as torchrun starts them), saves a checkpoint
mid-epoch through the framework's own mechanism and stops; then it resumes from that checkpoint
on another number of ranks with another ``local_batch_size`` and finishes both epochs. The two
runs together must have trained on every sample of each epoch exactly once.

The in-process tests check what the recipes' page says about each framework's own data helpers.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import guideloom as gl
from tests.support import ROOT
from tests.support.recipes import (
    NUM_SAMPLES,
    RECIPES,
    check_save_then_resume,
    position,
    records,
    run_recipe,
    seen_by_epoch,
)

pytestmark = pytest.mark.timeout(240)

EXTRA = 'the recipes extra is not installed: pip install -e ".[recipes]"'


def needs(module: str) -> pytest.MarkDecorator:
    """Skip where ``module`` is not installed, without importing it (Lightning takes seconds)."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=EXTRA)


# Lightning 2.6 builds a torch LeafSpec when it wraps the train loader in its CombinedLoader, which
# torch 2.13 deprecates: a FutureWarning from inside Lightning, not from the recipe. (A -W filter's
# message is plain text, a pytest filter's a regular expression.)
LIGHTNING_LEAFSPEC = "ignore:`isinstance(treespec, LeafSpec)` is deprecated:FutureWarning"
LIGHTNING_LEAFSPEC_PYTEST = r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
# The resumed Trainer writes its checkpoints into the folder it resumed from, as a restarted job
# does, and Lightning warns that the folder is not empty.
LIGHTNING_CKPT_DIR = "ignore:Checkpoint directory:UserWarning"

SAVED_OFFSET = 5 * 4 * 2  # every recipe saves after 5 steps of 4 samples on each of 2 ranks


@pytest.fixture
def ranks_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torchrun gives each rank beyond its rank variables: one OpenMP thread (Accelerate
    warns when that is unset); and this checkout's guideloom on the path."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def flat_keys(state: dict[str, Any], prefix: str) -> list[str]:
    """The entry names DCP gives a nested state dict (``loader.epoch``, ``loader.dataset.kind``...)."""
    keys = []
    for key, value in state.items():
        keys += flat_keys(value, f"{prefix}.{key}") if isinstance(value, dict) else [f"{prefix}.{key}"]
    return keys


# -- each recipe: save on 2 ranks, resume on another number -----------------------------------------


@needs("lightning")
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.usefixtures("ranks_env")
def test_fabric_saves_on_2_ranks_and_resumes_on_1(tmp_path: Path) -> None:
    args = ["--data", "corpus", "--checkpoint", "ckpt.pt"]
    run_recipe("fabric_resume.py", 2, *args, "--stop-after", "5", "--record", "save", cwd=tmp_path)
    run_recipe(
        "fabric_resume.py", 1, *args, "--resume", "--batch-size", "5", "--record", "resume", cwd=tmp_path
    )
    saved = check_save_then_resume(
        records(tmp_path / "save", 2), records(tmp_path / "resume", 1), saved_offset=SAVED_OFFSET
    )
    # fabric.save wrote loader.state_dict() beside the model and the optimizer
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert set(checkpoint) == {"model", "optimizer", "loader"}
    assert checkpoint["loader"] == saved


@needs("lightning")
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.usefixtures("ranks_env")
def test_lightning_trainer_saves_on_2_ranks_and_resumes_on_1(tmp_path: Path) -> None:
    args = ["--data", "corpus", "--checkpoint", "ckpts"]
    save = [*args, "--stop-after", "5", "--record", "save"]
    run_recipe("lightning_trainer_resume.py", 2, *save, cwd=tmp_path, ignore=[LIGHTNING_LEAFSPEC])
    checkpoint = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)
    # A global batch of 6 after 8: a smaller one, which the Trainer's step count allows (a larger
    # one would end its epoch early). The resumed epoch ends when the loader's iterator does, the
    # next one after len(loader) steps, where FinishLoaderEpoch starts the loader's next epoch.
    resume = [*args, "--resume", "--batch-size", "6", "--record", "resume"]
    run_recipe(
        "lightning_trainer_resume.py",
        1,
        *resume,
        cwd=tmp_path,
        ignore=[LIGHTNING_LEAFSPEC, LIGHTNING_CKPT_DIR],
    )
    saved = check_save_then_resume(
        records(tmp_path / "save", 2), records(tmp_path / "resume", 1), saved_offset=SAVED_OFFSET
    )
    # the DataModule's entry; the Trainer also keeps its own copy of a stateful train loader's state
    assert checkpoint["TokenData"] == {"loader": saved}
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [saved]


@needs("accelerate")
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.usefixtures("ranks_env")
def test_accelerate_saves_on_2_ranks_and_resumes_on_3(tmp_path: Path) -> None:
    args = ["--data", "corpus", "--checkpoint", "ckpt"]
    run_recipe("accelerate_resume.py", 2, *args, "--stop-after", "5", "--record", "save", cwd=tmp_path)
    resume = [*args, "--resume", "--batch-size", "3", "--record", "resume"]
    run_recipe("accelerate_resume.py", 3, *resume, cwd=tmp_path)
    saved = check_save_then_resume(
        records(tmp_path / "save", 2), records(tmp_path / "resume", 3), saved_offset=SAVED_OFFSET
    )
    # register_for_checkpointing: save_state wrote loader.state_dict() once, from the main process
    assert torch.load(tmp_path / "ckpt" / "custom_checkpoint_0.pkl", weights_only=True) == saved
    assert [p.name for p in (tmp_path / "ckpt").glob("custom_checkpoint_*")] == ["custom_checkpoint_0.pkl"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.usefixtures("ranks_env")
def test_dcp_train_state_saves_on_2_ranks_and_resumes_on_3(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    args = ["--data", "corpus", "--checkpoint", "ckpts"]
    run_recipe("dcp_train_state.py", 2, *args, "--stop-after", "5", "--record", "save", cwd=tmp_path)
    resume = [*args, "--resume", "--batch-size", "3", "--record", "resume"]
    run_recipe("dcp_train_state.py", 3, *resume, cwd=tmp_path)
    saved = check_save_then_resume(
        records(tmp_path / "save", 2), records(tmp_path / "resume", 3), saved_offset=SAVED_OFFSET
    )
    # the checkpoint holds the loader's state once, as one Stateful, not one per rank
    entries = FileSystemReader(str(tmp_path / "ckpts" / "step-5")).read_metadata().state_dict_metadata
    assert sorted(k for k in entries if k.startswith("loader.")) == sorted(flat_keys(saved, "loader"))
    assert "train_state.step" in entries


# torchtitan's LRSchedulersContainer.load_state_dict calls the scheduler's get_lr() outside step(),
# which torch warns about: a UserWarning from inside torchtitan, not from the recipe.
TORCHTITAN_GET_LR = "ignore:To get the last learning rate computed by the scheduler:UserWarning"


@needs("torchtitan")
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.usefixtures("ranks_env")
def test_torchtitan_saves_on_2_ranks_and_resumes_on_1(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    args = ["--data", "corpus", "--checkpoint", "ckpts"]
    run_recipe("torchtitan_resume.py", 2, *args, "--stop-after", "5", "--record", "save", cwd=tmp_path)
    resume = [*args, "--resume", "--batch-size", "5", "--record", "resume"]
    run_recipe("torchtitan_resume.py", 1, *resume, cwd=tmp_path, ignore=[TORCHTITAN_GET_LR])
    saved = check_save_then_resume(
        records(tmp_path / "save", 2), records(tmp_path / "resume", 1), saved_offset=SAVED_OFFSET
    )
    # CheckpointManager wrote the loader's global state once, as its "dataloader" entry (no
    # dp_rank_<r> keys), beside the model, the optimizer, the LR schedule and the step
    entries = FileSystemReader(str(tmp_path / "ckpts" / "step-5")).read_metadata().state_dict_metadata
    assert sorted(k for k in entries if k.startswith("dataloader.")) == sorted(flat_keys(saved, "dataloader"))
    assert {"train_state.step", "lr_scheduler.last_epoch", "module.head.weight"} <= set(entries)
    assert any(k.startswith("optimizer.state.") for k in entries)


@needs("torchtitan")
@pytest.mark.distributed
@pytest.mark.usefixtures("ranks_env")
def test_torchtitan_saves_on_1_rank_and_resumes_on_2(tmp_path: Path) -> None:
    """The short way round: one epoch, saved after 3 steps of 4 on 1 rank, finished on 2 ranks."""
    args = ["--data", "corpus", "--checkpoint", "ckpts", "--epochs", "1"]
    run_recipe("torchtitan_resume.py", 1, *args, "--stop-after", "3", "--record", "save", cwd=tmp_path)
    resume = [*args, "--resume", "--batch-size", "8", "--record", "resume"]
    run_recipe("torchtitan_resume.py", 2, *resume, cwd=tmp_path, ignore=[TORCHTITAN_GET_LR])
    save, resumed = records(tmp_path / "save", 1), records(tmp_path / "resume", 2)
    assert position(save[0]["state"]) == (0, 12)
    assert all(position(rank["state"]) == (1, 0) for rank in resumed)
    assert seen_by_epoch(save) == {0: sorted(sample for _, sample in save[0]["seen"])}
    assert len(save[0]["seen"]) == 12
    assert seen_by_epoch(save, resumed) == {0: list(range(NUM_SAMPLES))}


# -- what the frameworks' own data helpers do with the loader ----------------------------------------


def ids_tensor(samples: Sequence[np.ndarray]) -> torch.Tensor:
    return torch.tensor([int(s[0]) // 4 for s in samples], dtype=torch.int64)


def small_loader(n: int = 24) -> gl.StatefulDataLoader[Any, torch.Tensor]:
    return gl.StatefulDataLoader.from_storage(
        gl.MemoryStreamStorage(np.arange(n * 4, dtype=np.int64)),
        ids_tensor,
        sequence_length=4,
        local_batch_size=4,
        device=torch.device("cpu"),
    )


@needs("lightning")
def test_fabric_setup_dataloaders_refuses_the_loader() -> None:
    import lightning as L  # noqa: N812 - Lightning's own convention

    fabric = L.Fabric(accelerator="cpu", devices=1)
    with pytest.raises(TypeError, match="Only PyTorch DataLoader are currently supported"):
        fabric.setup_dataloaders(small_loader())


@needs("accelerate")
def test_accelerate_prepare_returns_the_loader_unchanged() -> None:
    from accelerate import Accelerator
    from accelerate.data_loader import skip_first_batches
    from accelerate.state import AcceleratorState

    try:
        accelerator = Accelerator(cpu=True)
        loader = small_loader()
        assert accelerator.prepare(loader) is loader
        # skip_first_batches rebuilds a DataLoader from the one it is given: not a guideloom loader
        with pytest.raises(AttributeError):
            skip_first_batches(loader, 2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the process-wide singletons


@needs("lightning")
@pytest.mark.filterwarnings(LIGHTNING_LEAFSPEC_PYTEST)
def test_the_trainer_iterates_the_loader_as_is_and_needs_its_epochs_finished(tmp_path: Path) -> None:
    """The Trainer iterates the loader it is given (no sampler, no re-wrapping), ends each epoch
    after len(loader) batches and calls iter(loader) again for the next: without the recipe's
    FinishLoaderEpoch the first epoch's iterator is still open, and guideloom refuses a second."""
    import lightning as L  # noqa: N812 - Lightning's own convention
    from lightning.pytorch.callbacks import ModelCheckpoint

    spec = importlib.util.spec_from_file_location("trainer_recipe", RECIPES / "lightning_trainer_resume.py")
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[tuple[int, list[int]]] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen.append((self.current_epoch, batch.tolist()))
            return self.layer(batch.float()[:, None]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Data(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.loader = small_loader()

        def train_dataloader(self) -> gl.StatefulDataLoader[Any, torch.Tensor]:
            return self.loader

    def fit(callbacks: list[Any]) -> tuple[Module, Data, Any]:
        module, data = Module(), Data()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=3,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        try:
            trainer.fit(module, datamodule=data)
        finally:
            data.loader.close()
        return module, data, trainer

    # Without the callback too, each of the Trainer's epochs is a whole epoch of the loader's: its
    # new iter() ends the spent iterator and starts the next epoch.
    module, data, _ = fit(callbacks=[])
    for epoch in range(3):
        assert sorted(i for e, batch in module.seen if e == epoch for i in batch) == list(range(24))

    epoch_ends = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{epoch}", save_top_k=-1)
    module, data, trainer = fit(callbacks=[recipe.FinishLoaderEpoch(), epoch_ends])
    assert trainer.train_dataloader is data.loader
    for epoch in range(3):
        assert sorted(i for e, batch in module.seen if e == epoch for i in batch) == list(range(24))
    assert data.loader.state_dict()["epoch"] == 3
    # FinishLoaderEpoch ran before the epoch-end checkpoint: it holds the next epoch's start
    first = torch.load(tmp_path / "ckpts" / "epoch=0.ckpt", weights_only=True)
    (state,) = first["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert (state["epoch"], state["observation_offset"]) == (1, 0)


def torchtitan_recipe(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The recipe as a module; registered while the test runs, as its dataclasses need."""
    spec = importlib.util.spec_from_file_location("torchtitan_recipe", RECIPES / "torchtitan_resume.py")
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, recipe)
    spec.loader.exec_module(recipe)
    return recipe


@needs("torchtitan")
# torchdata's StatefulDataLoader, which torchtitan's loader is, calls torch.set_vital, which torch
# 2.13 deprecates: a UserWarning from inside torchdata.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_torchtitan_parallel_aware_dataloader_refuses_another_dp_degree() -> None:
    """What the page says of torchtitan's own loader: one state per dp rank, and a checkpoint made
    with another data-parallel degree refused."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    data = torch.utils.data.TensorDataset(torch.arange(8))
    saved = ParallelAwareDataloader(data, dp_rank=0, dp_world_size=2, batch_size=2).state_dict()
    assert set(saved) == {"dp_rank_0", "world_size"}
    resumed = ParallelAwareDataloader(data, dp_rank=0, dp_world_size=1, batch_size=2)
    with pytest.raises(AssertionError, match="dp_degree is inconsistent"):
        resumed.load_state_dict(saved)


@needs("torchtitan")
def test_torchtitan_builds_the_guideloom_loader_from_its_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe's loader is built as the Trainer builds config.dataloader, yields the Trainer's
    ``({"input": ...}, labels)`` batches of seq_len tokens, and resumes from its own state."""
    from torchtitan.components.dataloader import BaseDataLoader

    recipe = torchtitan_recipe(monkeypatch)
    gl.write_stream(tmp_path / "corpus", np.arange(24 * recipe.SEQ, dtype=np.uint32))
    config = recipe.GuideloomDataLoader.Config(dataset_path=str(tmp_path / "corpus"), epochs=1)
    assert isinstance(config, BaseDataLoader.Config)

    def build() -> Any:
        kwargs = {"dp_world_size": 1, "dp_rank": 0, "tokenizer": None, "local_batch_size": 4}
        return config.build(seq_len=recipe.SEQ - 1, snapshot_every_n_steps=None, **kwargs)

    loader = build()
    batches = iter(loader)
    first = [next(batches) for _ in range(2)]
    batches.close()
    for inputs, labels in first:
        assert set(inputs) == {"input"} and inputs["input"].shape == labels.shape == (4, recipe.SEQ - 1)
        assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])
    state = loader.state_dict()
    assert (state["epoch"], state["observation_offset"]) == (0, 8)

    resumed = build()
    resumed.load_state_dict(state)
    rest = [int(i) // recipe.SEQ for inputs, _ in resumed for i in inputs["input"][:, 0]]
    done = [int(i) // recipe.SEQ for inputs, _ in first for i in inputs["input"][:, 0]]
    assert sorted(done + rest) == list(range(24))
    assert [audit.ok for audit in resumed.audits] == [True]
    assert resumed.state_dict()["epoch"] == 1

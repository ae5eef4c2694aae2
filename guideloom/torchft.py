"""guideloom as the data loader of per-step fault-tolerant training with torchft.

torchft splits data parallelism into replica groups that form a quorum every step: a group that
dies drops out while the others go on, and one that comes back heals from a live peer. A
:class:`FaultTolerantLoader` makes a :class:`~guideloom.StatefulDataLoader` follow that quorum:

- each step, the batch is cut for the quorum's ``participating_rank()`` of
  ``num_participants()`` (times the group's ``num_shards`` for a ``dp_replicate x dp_shard``
  mesh): the groups of the step read disjoint data, and every rank of a group (tensor and
  pipeline parallel ranks) with the same ``shard_rank`` the same batch;
- the epoch's position advances only by the steps the Manager committed (the optimizer
  stepped, ``current_step()`` moved on); a step that was not committed is handed out again at
  the next step, cut for the next quorum, so no sample is lost or repeated;
- the loader's committed state travels with the model's through the Manager's
  ``register_state_dict_fn``: a group that joins or heals starts where the live ones are.

The loader's read-ahead (``prefetch``, workers) is dropped and re-planned at a change of quorum
(:meth:`~guideloom.StatefulDataLoader.set_geometry`, :meth:`~guideloom.StatefulDataLoader.rollback`);
the workers are not restarted. torchft is an optional dependency: ``pip install "guideloom[torchft]"``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterator

    from guideloom.pytorch import StatefulDataLoader
    from guideloom.types import StatefulDataLoaderStateDict

__all__ = ["FaultTolerantLoader", "QuorumManager"]

BatchT = TypeVar("BatchT")


class QuorumManager(Protocol):
    """What a :class:`FaultTolerantLoader` uses of a ``torchft.Manager``."""

    def participating_rank(self) -> int | None: ...

    def num_participants(self) -> int: ...

    def current_step(self) -> int: ...

    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None: ...


class FaultTolerantLoader(Generic[BatchT]):
    """A loader that follows a ``torchft.Manager``'s quorum step by step; see the module docstring.

    Ask for each step's batch with :meth:`next` after the step's quorum has started
    (``optimizer.zero_grad()`` of torchft's ``OptimizerWrapper``, or ``manager.start_quorum()``)
    and before ``should_commit()`` (``optimizer.step()``): the batch depends on the quorum, and
    the step's outcome is read from the Manager at the next call. Batches go on across epochs
    (:attr:`epoch` says which one the last batch is of).

    Args:
        loader: the loader, constructed as for one replica group (its ``rank`` and
            ``world_size`` are set each step).
        manager: the replica group rank's ``torchft.Manager``.
        shard_rank: this rank's data-parallel shard within its replica group (``dp_shard``
            rank; 0 without sharding). Ranks of a group with the same ``shard_rank`` get the
            same batch.
        num_shards: the data-parallel shards of a replica group (``dp_shard``).
        key: the name of the loader's state among the Manager's state dicts.
        batches_per_step: the batches each step takes (the micro-batches of gradient
            accumulation): the first :meth:`next` of each run of this many settles the last
            step and cuts for the quorum, the others go on with the same step. torchft's step
            count moves only when a step commits, so a second call within one step cannot be
            told from the first call after a step that failed: with accumulation, say how many.
    """

    def __init__(
        self,
        loader: StatefulDataLoader[Any, BatchT],
        manager: QuorumManager,
        *,
        shard_rank: int = 0,
        num_shards: int = 1,
        key: str = "guideloom",
        batches_per_step: int = 1,
    ) -> None:
        if (
            isinstance(batches_per_step, bool)
            or not isinstance(batches_per_step, int)
            or batches_per_step < 1
        ):
            raise ValueError(f"batches_per_step must be an int >= 1, got {batches_per_step!r}")
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
        if (
            isinstance(shard_rank, bool)
            or not isinstance(shard_rank, int)
            or not 0 <= shard_rank < num_shards
        ):
            raise ValueError(f"shard_rank must be an int in [0, num_shards={num_shards}), got {shard_rank!r}")
        self.loader, self.manager = loader, manager
        self.shard_rank, self.num_shards = shard_rank, num_shards
        self.batches_per_step = batches_per_step
        #: Batches handed out in the current step so far (``batches_per_step`` make a step).
        self._in_step = 0
        self._lock = threading.Lock()
        self._it: Iterator[BatchT] | None = None
        #: The Manager's step when the batch not yet known to be committed was handed out.
        self._pending: int | None = None
        #: The data-parallel world size of the pending step (the geometry a catch-up replays).
        self._pending_world = 0
        #: A live peer's state, received while healing, applied at the next step.
        self._received: dict[str, Any] | None = None
        #: Whether this group took part in the last step (a healing group is handed a batch
        #: for its forward and backward passes, whose gradients torchft zeroes).
        self.participating = False
        #: The epoch of the last batch handed out.
        self.epoch = loader.state_dict()["epoch"]
        manager.register_state_dict_fn(key, self._load_received, self.state_dict)

    # -- the steps ----------------------------------------------------------------------------------
    def __iter__(self) -> FaultTolerantLoader[BatchT]:
        return self

    def __next__(self) -> BatchT:
        return self.next()

    def next(self) -> BatchT:
        """This step's batch, cut for the quorum (waited for if it is not formed yet): the
        outcome of the last step is settled first (committed, or taken back to be handed out
        again), a peer's state received while healing applied."""
        replica = self.manager.participating_rank()  # waits for the quorum: outside the lock,
        participants = self.manager.num_participants()  # which the peers' state fn takes
        if participants < 1:
            raise RuntimeError(
                "guideloom: no quorum yet (the Manager has no participants): start the step's "
                "quorum (optimizer.zero_grad() of torchft's OptimizerWrapper, or "
                "manager.start_quorum()) before asking for its batch"
            )
        with self._lock:
            if 0 < self._in_step < self.batches_per_step and self._received is None:
                self._in_step += 1  # the same step's next micro-batch
                return self._take()
            received = self._received
            if replica is None and received is not None and not self._current(received):
                # healing again: the state received at an earlier heal, never applied and now
                # too old, is superseded by the one this step's heal brings (a group that has
                # just healed and is a spare now keeps it: it is this step's state)
                self._received = None
            self._settle()
            self.participating = replica is not None
            world = participants * self.num_shards
            rank = (replica if replica is not None else 0) * self.num_shards + self.shard_rank
            self.loader.set_geometry(rank=rank, world_size=world)
            batch = self._take()
            self._pending, self._pending_world = self.manager.current_step(), world
            self._in_step = 1
            return batch

    def _current(self, received: dict[str, Any]) -> bool:
        """Whether a peer's state received while healing is of this step or the one before (the
        step the replica healed in), as :meth:`_restart` applies it."""
        return self.manager.current_step() - int(received["step"]) in (0, 1)

    def _take(self) -> BatchT:
        """The loader's next batch, the next epoch's first at the end of one."""
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.loader)
            batch = next(self._it, _END)
            if batch is not _END:
                self.epoch = self.loader.state_dict()["epoch"]
                return batch
            self._it = None
        raise RuntimeError("guideloom: an epoch of the loader has no batch")

    def _settle(self) -> None:
        """Apply the outcome of the pending step: committed if the Manager's step moved on since
        it was handed out, taken back otherwise; a received state replaces both."""
        received, self._received = self._received, None
        if received is not None:
            self._restart(received)
            return
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if self.manager.current_step() > pending:
            self.loader.commit()
        else:
            self.loader.rollback()

    def _restart(self, received: dict[str, Any]) -> None:
        """Go on from a live peer's committed state; the step the peers committed while this
        group healed (its state was taken before it) is taken and committed here too."""
        behind = self.manager.current_step() - int(received["step"])
        if behind not in (0, 1):
            raise RuntimeError(
                f"guideloom: the state received from a peer is {behind} steps behind this replica's "
                "Manager; expected 0 or 1 (the state of the step this replica healed in); it was "
                "not applied"
            )
        if self._it is not None:
            close = getattr(self._it, "close", None)
            if close is not None:
                close()
            self._it = None
        self.loader.load_state_dict(received["loader"])
        if behind:  # the step the peers committed while this group healed, its batches
            self.loader.set_geometry(rank=self.shard_rank, world_size=self._pending_world or self.num_shards)
            for _ in range(self.batches_per_step):
                self._take()
            self.loader.commit()
        self._pending = None
        self._in_step = 0

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The committed state (what the Manager sends a healing peer, and what to save in a
        checkpoint): the loader's position after the last committed step, and the Manager's
        step it belongs to. Safe from the Manager's quorum thread."""
        with self._lock:
            received, self._received = self._received, None
            if received is not None:  # healed, not applied yet: what this replica goes on from
                self._restart(received)
            step = self.manager.current_step()
            done = self._pending is not None and step > self._pending
            loader: StatefulDataLoaderStateDict = self.loader.state_dict(committed=not done)
            return {"loader": loader, "step": step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start from ``state`` (a :meth:`state_dict`, from a checkpoint or a peer) at the next
        step."""
        self._load_received(state)

    def _load_received(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "loader" not in state or "step" not in state:
            raise ValueError(
                "a FaultTolerantLoader state must be a dict with 'loader' and 'step', as "
                f"FaultTolerantLoader.state_dict() returns; got {type(state).__name__}"
            )
        with self._lock:
            self._received = state

    def close(self) -> None:
        """Close the loader's iterator (the loader itself stays open)."""
        with self._lock:
            it, self._it = self._it, None
            close = getattr(it, "close", None)
            if close is not None:
                close()


_END: Any = object()

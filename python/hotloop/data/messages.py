"""The messages between hotloop.DataLoader's main process, its launcher and its workers, one frozen
dataclass each, dispatched with isinstance (as torch's _utils/worker.py does with _ResumeIteration).

Main process -> worker, over the worker's task pipe: Fetch, UseRing, Place, Discard, Setup,
NewEpoch, Exit; over its ring socket, the ring's memfd (SCM_RIGHTS) before UseRing, unless inherited. Worker -> main process, over its result pipe (plain pickle, never ForkingPickler,
which would move tensors through /dev/shm): Started, Layout, EpochStarted, Result, Overflow. Launcher -> main
process, over its status pipe: WorkerStarted, WorkerExited.

A task's outcome is one of SlotBatch, WholeBatch, Failed, Ended. It is pickled at the start of the
task's slot (the slot's metadata) when the task has a slot and it fits there; else it takes the pipe:
as Overflow when the slot holds the batch but not its metadata (the slot is flagged), as Result when
the task had no slot, or had one it never wrote.

The ring and its slots: a worker makes its first batch before the ring exists (the ring is sized
from a batch's layout). It sends Layout, from the batch's first sample on the fast path, and keeps
the batch until Place names its slot. When it makes the ring, the main process sends Place for every
task without a slot right behind UseRing, without waiting for their layouts, so a worker writes its
batch straight in; an outcome that took the pipe meanwhile (an error or a stop before any layout was
sent) is never written to that slot, and the main process gives the slot back when it comes.
"""
import dataclasses

# -- main process -> worker --


@dataclasses.dataclass(frozen=True)
class Fetch:
    """Make the batch of `index` (an IterableDataset: its next batch) for task `task_id`, into `slot`
    (-1: the ring does not exist yet)."""

    task_id: int
    index: object
    slot: int


@dataclasses.dataclass(frozen=True)
class UseRing:
    """The ring exists: map its memfd, which is `fd` in the worker (inherited across fork) or, with
    fd None, the one the main process sent right before over the worker's ring socket (SCM_RIGHTS);
    each slot holds the metadata in its first `meta_bytes`, then tensor leaf k at layout[k] =
    (offset, capacity)."""

    nslots: int
    slot_bytes: int
    layout: list
    meta_bytes: int
    fd: int = None


@dataclasses.dataclass(frozen=True)
class Place:
    """Write the batch kept for `task_id` (made before the ring existed) into `slot`; -1: there will be
    no ring (no batch has a tensor), send it whole."""

    task_id: int
    slot: int


@dataclasses.dataclass(frozen=True)
class Discard:
    """Forget the batch kept for `task_id`: its epoch is over, or it was given to this worker anew."""

    task_id: int


@dataclasses.dataclass(frozen=True)
class Setup:
    """Before the next task, for a resumed epoch or in place of a dead worker: set the global RNG
    states `rng` (from rng_state()), load a Stateful dataset's state `data` (consumer.resume.dataset_state)
    into the dataset, make the IterableDataset's iterator anew (`recreate`; always with `data`) and
    load the iterator's part of `data` into it, fetch and drop `replay` batches of `replay_index`,
    then expect its end (`expect_stop`)."""

    rng: bytes = None
    recreate: bool = False
    replay: int = 0
    expect_stop: bool = False
    replay_index: object = None
    data: dict = None

    def changes_anything(self) -> bool:
        return self.rng is not None or self.recreate or self.replay > 0 or self.expect_stop or self.data is not None


@dataclasses.dataclass(frozen=True)
class NewEpoch:
    """Persistent workers: a new epoch begins. Drop the batches kept for the last one, seed a
    DataPipe's random operations with `shared_seed` (the same in every worker, as torch's
    _ResumeIteration), make the iterator anew, answer EpochStarted."""

    shared_seed: int = None


@dataclasses.dataclass(frozen=True)
class Exit:
    """Finish: the worker returns from its loop."""


# -- worker -> main process --


@dataclasses.dataclass(frozen=True)
class Started:
    """A worker's first message: its process is past its start (a spawned or forkserver one has
    imported the main module again and unpickled its arguments), so a death from here on is its
    dataset's, not its start's."""

    worker_id: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """The batch of `task_id` was made (or begun) before the ring existed: bytes of each tensor leaf,
    in slot order, and bytes of what travels in the metadata."""

    task_id: int
    sizes: list
    side_bytes: int


@dataclasses.dataclass(frozen=True)
class EpochStarted:
    """Answer to NewEpoch: the worker's RNG states as the new epoch begins."""

    worker_id: int
    rng: bytes


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of a task that took the pipe: it had no slot, or never wrote the one it was given."""

    task_id: int
    outcome: object


@dataclasses.dataclass(frozen=True)
class Overflow:
    """The outcome of a task whose batch is in its slot but whose metadata did not fit there."""

    task_id: int
    outcome: object


# -- outcomes: `busy` is the seconds the worker spent on the task, `rng` its RNG states right after
# it (rng_state()), `data` its dataset's state right after it when the dataset (or its iterator) is
# Stateful (consumer.resume.dataset_state), else None: the main process keeps those after the last batch it
# handed out from each worker, for state_dict() --


@dataclasses.dataclass(frozen=True)
class SlotBatch:
    """The batch is in its slot: tensor leaves at (offset, dtype, shape), the rest in `spec`."""

    spec: object
    leaves: list
    busy: float = 0.0
    rng: bytes = None
    data: dict = None


@dataclasses.dataclass(frozen=True)
class WholeBatch:
    """The collated batch itself (there is no ring: no batch has a tensor)."""

    batch: object
    busy: float = 0.0
    rng: bytes = None
    data: dict = None


@dataclasses.dataclass(frozen=True)
class Failed:
    """The dataset or collate_fn raised: torch's ExceptionWrapper, re-raised in the main process."""

    error: object
    busy: float = 0.0
    rng: bytes = None
    data: dict = None


@dataclasses.dataclass(frozen=True)
class Ended:
    """The worker's IterableDataset is exhausted: this task, and every later one, has no batch."""

    busy: float = 0.0
    rng: bytes = None
    data: dict = None


# -- launcher -> main process --


@dataclasses.dataclass(frozen=True)
class WorkerStarted:
    """The launcher forked its k-th worker."""

    k: int
    pid: int


@dataclasses.dataclass(frozen=True)
class WorkerExited:
    """The launcher reaped its k-th worker (exit code as multiprocessing gives it: -signal if killed)."""

    k: int
    code: int

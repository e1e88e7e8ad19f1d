"""A worker pool's tasks (Task) and where each worker stands in the epoch (WorkerEpoch), as far as the
main process knows: what a replacement for a dead worker is sent to carry on where it died."""
import collections
import dataclasses
import enum

from ..messages import Ended, Failed, Setup


class TaskKind(str, enum.Enum):
    """What a task turned out to be once the main process took its outcome (a str: equal to its name)."""

    BATCH = "batch"  # a batch
    ERROR = "error"  # the error its batch raised in the worker (Failed)
    STOP = "stop"  # its worker's IterableDataset had ended (Ended)
    DROP = "drop"  # never done: its worker had ended before it

    @classmethod
    def of(cls, outcome) -> "TaskKind":
        return cls.STOP if isinstance(outcome, Ended) else cls.ERROR if isinstance(outcome, Failed) else cls.BATCH


@dataclasses.dataclass(eq=False)
class Task:
    id: int
    wid: int
    index: object
    slot: int
    consumed: bool = False
    kind: TaskKind = None  # once taken
    rng: bytes = None  # the worker's RNG states right after it, until the iterator logged it
    data: dict = None  # and its Stateful dataset's state, likewise
    handed: bool = False  # its batch went to the consumer (or its error was raised)


@dataclasses.dataclass
class WorkerEpoch:
    """Where one worker stands in the current epoch, as far as the main process knows: what a
    replacement needs to carry on where it died."""

    start_rng: bytes = None  # the RNG states it started the epoch with (None: as seeded at its start)
    start_data: dict = None  # the Stateful dataset's state it started with (None: as made)
    recreate: bool = False  # its iterator was made anew after start_rng was set
    base: int = 0  # batches (and errors) of its IterableDataset it replayed at the epoch's start
    base_stopped: bool = False  # and its iteration had ended there
    taken: int = 0  # batches and errors the main process took from it since (in the order it made them)
    stopped: bool = False  # its Ended was taken
    last_rng: bytes = None  # its states after the last of those outcomes (None: none yet)
    last_data: dict = None  # its Stateful dataset's state after it, likewise
    # its tasks after those, in the order it makes them: a worker's second batch can be ready before
    # its first (the first waits for Place), and in_order=False takes it first
    open: collections.deque = dataclasses.field(default_factory=collections.deque)

    def fold(self):
        """Count the worker's taken outcomes in, as far as they follow each other."""
        while self.open and self.open[0].kind is not None:
            t = self.open.popleft()
            if t.kind == TaskKind.STOP:
                self.stopped = True
            elif t.kind in (TaskKind.BATCH, TaskKind.ERROR):
                self.taken += 1
            if t.rng is not None:
                self.last_rng = t.rng
            if t.data is not None:
                self.last_data = t.data


def successor_plan(track, lost, iterable, replay_index, done):
    """What a fresh worker is sent to stand where the worker of `track` (its WorkerEpoch) stood:
    Setup messages and the lost tasks, in the order it made them. A map-style worker is given the RNG
    states after the last outcome before each lost task, so that redone batches are the ones it would
    have made; an IterableDataset's worker (iterable), whose position is not an RNG state, starts
    from its epoch's start and replays (fetches and drops) every batch the main process already has
    from it. done: task id -> the outcome of each open task done but not taken yet (None: none there)."""
    missing = [t for t in lost if not any(t is o for o in track.open)]  # none expected: redone all the same
    lost = set(lost)
    items = list(missing)
    rng = data = None
    if iterable:
        replay, ended = track.base + track.taken, track.base_stopped or track.stopped
        if track.last_data is not None:  # a Stateful dataset: set where it stood, nothing replayed
            setup = Setup(track.last_rng, True, 0, ended, replay_index, track.last_data)
        else:
            setup = Setup(track.start_rng, track.recreate, replay, ended, replay_index, track.start_data)
        if setup.changes_anything():
            items.append(setup)
    else:  # a Stateful map-style dataset's state goes with the RNG states
        rng = track.last_rng if track.last_rng is not None else track.start_rng
        data = track.last_data if track.last_rng is not None else track.start_data
    for t in track.open:
        if t in lost:
            if rng is not None:
                items.append(Setup(rng, data=data))
                rng = None
            items.append(t)
            continue
        kind, after, after_data = t.kind, t.rng, t.data
        if kind is None:  # done, not taken yet: its outcome is in the ring or the pipe
            outcome = done.get(t.id)
            if outcome is None:
                continue
            kind = TaskKind.STOP if isinstance(outcome, Ended) else TaskKind.BATCH
            after, after_data = outcome.rng, outcome.data
        if kind == TaskKind.DROP:
            continue
        if iterable:
            stop = kind == TaskKind.STOP
            if after_data is not None:  # Stateful: set past it rather than fetch it again
                items.append(Setup(after, True, 0, stop, replay_index, after_data))
            else:
                items.append(Setup(replay=0 if stop else 1, expect_stop=stop, replay_index=replay_index))
        elif after is not None:
            rng, data = after, after_data
    if rng is not None:  # for the tasks still to come
        items.append(Setup(rng, data=data))
    return items

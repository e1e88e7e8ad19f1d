"""Mid-epoch resume of hotloop.DataLoader with several workers: where each worker stood (its RNG
states after the last batch handed out, its IterableDataset position), recorded as the epoch runs
(EpochLog) and applied to a resumed epoch (Plan). DataLoader.state_dict's docstring says what holds."""
import collections
import dataclasses
import warnings

from ._messages import Setup


@dataclasses.dataclass
class Plan:
    """A loaded version-2 state, as a multi-worker iterator applies it."""

    positions: int  # map-style: the epoch's first index batches, all handed out
    yielded_after: list  # map-style: later index batches handed out too (in_order=False)
    yielded_after_rng: list  # and for each, None or its worker's RNG states after it
    next_worker: int  # the worker the next task goes to (round robin)
    setups: list  # per worker: its Setup (the pool adds the replay index); None: no worker state applies
    stopped: list  # per worker: its IterableDataset had ended
    ahead: list  # per worker: which of its next batches were handed out already (in_order=False)

    @classmethod
    def of(cls, state, n, iterable):
        saved_n = state["num_workers"]
        usable = saved_n == n and state["iterable"] == iterable and state["worker_rng"] is not None
        if not usable and saved_n > 0 and state["worker_rng"] is not None:
            kinds = {True: "an IterableDataset", False: "a map-style dataset"}
            warnings.warn(f"DataLoader.load_state_dict: the state was taken with num_workers={saved_n} and "
                          f"{kinds[bool(state['iterable'])]}, this loader has {n} and {kinds[iterable]}: it resumes "
                          "at the same batch, but random transforms in workers will differ", stacklevel=4)
        positions = int(state["sampler_batches"])
        after = [int(p) for p in state["yielded_after"]]
        if not usable:
            # an IterableDataset is walked from its start through the workers, round robin from worker 0
            return cls(positions, after, [None] * len(after), 0 if iterable else positions % n, None, [False] * n,
                       [[] for _ in range(n)])
        rngs, batches, stopped = state["worker_rng"], state["worker_batches"], state["worker_stopped"]
        setups = [Setup(rngs[w], iterable and rngs[w] is not None, int(batches[w]) if iterable else 0,
                        bool(stopped[w]) if iterable else False) for w in range(n)]
        return cls(positions, after, list(state["yielded_after_rng"]), int(state["next_worker"]) % n, setups,
                   [bool(x) and iterable for x in stopped], [sorted(int(i) for i in a) for a in state["worker_ahead"]])


def settled(task):
    """Handed out (or raised), or taken without a batch: a stop, or dropped after its worker ended."""
    return task.handed or task.kind in ("stop", "drop")


class EpochLog:
    """What a multi-worker epoch handed out, per worker and by position: the half of state_dict()
    that the sampler's position does not say. Kept by the loader, so that state_dict() works after
    the iterator is gone."""

    def __init__(self, n, iterable, order, pos0, start_worker, tracks):
        self.n, self.iterable = n, iterable
        self.order = order  # the iterator's tasks (and placeholders) of this epoch, from position pos0
        self.pos0 = pos0
        self.start_worker = start_worker
        self.prefix = 0  # order[:prefix] are all settled
        self.queues = [collections.deque() for _ in range(n)]  # each worker's tasks not yet settled
        self.start_rng = [t.start_rng for t in tracks]
        self.rng = list(self.start_rng)  # after the last settled outcome of each worker
        self.batches = [t.base for t in tracks]  # batches (and errors) settled, replayed ones included
        self.stopped = [t.base_stopped for t in tracks]

    def add(self, task):
        self.queues[task.wid].append(task)
        if settled(task):  # a resumed epoch's stand-in for a batch handed out before
            self.settle(task)

    def settle(self, task):
        """The task was handed out, or taken without a batch: log its worker's settled prefix (one
        worker's tasks finish, and are handed out, in order)."""
        w = task.wid
        queue = self.queues[w]
        while queue and settled(queue[0]):
            t = queue.popleft()
            if t.kind == "stop":
                self.stopped[w] = True
            elif t.kind in ("batch", "error"):
                self.batches[w] += 1
            if t.rng is not None:
                self.rng[w] = t.rng
                t.rng = None  # an epoch's tasks stay in `order`: keep 10 kB per worker, not per batch
        self._advance()

    def _advance(self):
        order = self.order
        while self.prefix < len(order) and settled(order[self.prefix]):
            self.prefix += 1

    def snapshot(self):
        self._advance()
        order, prefix = self.order, self.prefix
        after, after_rng = [], []
        if not self.iterable:  # in_order=False: handed out past the first one that was not
            for i in range(prefix, len(order)):
                t = order[i]
                if settled(t):
                    after.append(self.pos0 + i)
                    # past its worker's own settled run, a resumed worker must be brought past it
                    after_rng.append(t.rng if any(q is t for q in self.queues[t.wid]) else None)
        # an IterableDataset: which of each worker's next batches were handed out (in_order=False)
        ahead = [[i for i, t in enumerate(q) if settled(t) and t.kind in ("batch", "error")] if self.iterable else []
                 for q in self.queues]
        return {"sampler_batches": self.pos0 + prefix, "yielded_after": after, "yielded_after_rng": after_rng,
                "next_worker": (order[prefix - 1].wid + 1) % self.n if prefix else self.start_worker,
                # map-style: the states to set; an IterableDataset: those to replay its batches from
                "worker_rng": list(self.start_rng if self.iterable else self.rng),
                "worker_batches": list(self.batches), "worker_stopped": list(self.stopped), "worker_ahead": ahead}

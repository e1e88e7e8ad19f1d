"""Mid-epoch resume of hotloop.DataLoader: where each worker stood (its RNG states after the last
batch handed out, its IterableDataset position, a Stateful dataset's state), recorded as the epoch
runs (EpochLog) and applied to a resumed epoch (Plan); the Stateful protocol of datasets and
samplers; which states load into which loader (check_loadable). DataLoader.state_dict's docstring
says what holds."""
import collections
import dataclasses
import warnings

from torch.utils.data import BatchSampler

from ..messages import Setup
from .tasks import TaskKind


def stateful(obj) -> bool:
    """torchdata's Stateful protocol (a streaming dataset's, a resumable sampler's): state_dict() and
    load_state_dict(); such an object is saved and restored instead of replayed."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def dataset_state(dataset, fetcher):
    """A Stateful dataset's state as it stands: {"dataset": its state_dict(), "iter": its
    iterator's} (torchdata's rule: the dataset's only when it is not its own iterator), or None when
    neither is Stateful (its position is then replayed)."""
    it = getattr(fetcher, "dataset_iter", None)  # an IterableDataset's iterator (torch's fetcher)
    own = stateful(dataset) and it is not dataset
    of_iter = it is not None and stateful(it)
    if not own and not of_iter:
        return None
    return {"dataset": dataset.state_dict() if own else None, "iter": it.state_dict() if of_iter else None}


def load_dataset_state(dataset, state, new_fetcher):
    """The dataset set to `state` (dataset_state's): the dataset's own state first, then its
    iterator made anew (by new_fetcher), then the iterator's state. Returns the new fetcher."""
    if state["dataset"] is not None:
        dataset.load_state_dict(state["dataset"])
    fetcher = new_fetcher()
    if state["iter"] is not None:
        fetcher.dataset_iter.load_state_dict(state["iter"])
    if hasattr(fetcher, "ended"):
        fetcher.ended = False
    return fetcher


def _stateful_sampler(index_sampler):
    """The Stateful object behind the index batches: the batch sampler, or the sampler inside torch's
    own BatchSampler (which reads exactly batch_size indices of it per batch); None if neither is."""
    if stateful(index_sampler):
        return index_sampler
    if type(index_sampler) is BatchSampler and stateful(index_sampler.sampler):
        return index_sampler.sampler
    return None


def sampler_state(index_sampler, sampler_iter):
    """The index sampler's state as it stands (a Stateful sampler, batch sampler or their iterator,
    as torchdata saves them), or None when none is Stateful (its position is then replayed)."""
    owner = _stateful_sampler(index_sampler)
    of_iter = stateful(sampler_iter)
    if owner is None and not of_iter:
        return None
    return {"sampler": owner.state_dict() if owner is not None else None,
            "iter": sampler_iter.state_dict() if of_iter else None}


def load_sampler_state(index_sampler, state):
    """The sampler set to `state` (sampler_state's); returns the epoch's sampler iterator, made anew."""
    owner = _stateful_sampler(index_sampler)
    if state["sampler"] is not None:
        if owner is None:
            raise ValueError("DataLoader.load_state_dict: the state holds a Stateful sampler's state_dict(), this "
                             "loader's sampler has no load_state_dict")
        owner.load_state_dict(state["sampler"])
    sampler_iter = iter(index_sampler)
    if state["iter"] is not None:
        if not stateful(sampler_iter):
            raise ValueError("DataLoader.load_state_dict: the state holds a Stateful sampler iterator's "
                             "state_dict(), this loader's sampler iterator has no load_state_dict")
        sampler_iter.load_state_dict(state["iter"])
    return sampler_iter


def check_loadable(state, n, iterable):
    """Refuse (ValueError) a state that would resume with samples repeated or lost; warn where the
    resume is exact in its samples but not in the random draws of worker-side transforms."""
    if state["version"] < 2:
        return
    saved_n = int(state["num_workers"])
    in_epoch = not state["epoch_done"]  # taken before the epoch's end, maybe before its first batch
    mid_epoch = in_epoch and int(state["batches_yielded"]) > 0
    kinds = {True: "an IterableDataset", False: "a map-style dataset"}
    if mid_epoch and bool(state["iterable"]) != iterable:
        saved = kinds[bool(state["iterable"])]
        raise ValueError(f"DataLoader.load_state_dict: the state was taken mid-epoch with {saved}, this loader has "
                         f"{kinds[iterable]}: load it into a loader made as the saved one was")
    if saved_n == n:
        return
    if mid_epoch and iterable:
        # an IterableDataset's position is per worker, and its split among workers (get_worker_info())
        # changes with their number: no position of the new split is where the saved one stood
        raise ValueError(f"DataLoader.load_state_dict: the state was taken mid-epoch with an IterableDataset and "
                         f"num_workers={saved_n}, this loader has num_workers={n}: each worker's position in its "
                         "share of the stream does not translate to another number of workers, so samples would "
                         f"be repeated and others lost. Resume with num_workers={saved_n}, or from a state taken "
                         "at an epoch's end")
    carried = state.get("persistent") and state["worker_rng"] is not None  # RNG states into the next epoch
    if in_epoch or carried:
        warnings.warn(f"DataLoader.load_state_dict: the state was taken with num_workers={saved_n}, this loader has "
                      f"num_workers={n}: it resumes at the same batch, but random transforms in workers will differ "
                      f"from the saved run's (resume with num_workers={saved_n} for the same draws)", stacklevel=3)


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
        """check_loadable has refused the states that cannot apply (and warned of the others)."""
        saved_n = state["num_workers"]
        usable = saved_n == n and state["iterable"] == iterable and state["worker_rng"] is not None
        positions = int(state["sampler_batches"])
        after = [int(p) for p in state["yielded_after"]]
        if not usable:
            # an IterableDataset is walked from its start through the workers, round robin from worker 0
            return cls(positions, after, [None] * len(after), 0 if iterable else positions % n, None, [False] * n,
                       [[] for _ in range(n)])
        rngs, batches, stopped = state["worker_rng"], state["worker_batches"], state["worker_stopped"]
        data = state.get("worker_data") or [None] * n
        # a Stateful dataset is set to its state (its RNG states are those after it, as map-style ones
        # are), any other IterableDataset replays its batches from its epoch's start
        setups = [Setup(rngs[w], iterable and rngs[w] is not None or data[w] is not None,
                        int(batches[w]) if iterable and data[w] is None else 0,
                        bool(stopped[w]) if iterable else False, data=data[w]) for w in range(n)]
        return cls(positions, after, list(state["yielded_after_rng"]), int(state["next_worker"]) % n, setups,
                   [bool(x) and iterable for x in stopped], [sorted(int(i) for i in a) for a in state["worker_ahead"]])


def settled(task):
    """Handed out (or raised), or taken without a batch: a stop, or dropped after its worker ended."""
    return task.handed or task.kind in (TaskKind.STOP, TaskKind.DROP)


class EpochLog:
    """What a multi-worker epoch handed out, per worker and by position: the half of state_dict()
    that the sampler's position does not say. Kept by the loader, so that state_dict() works after
    the iterator is gone."""

    def __init__(self, n, iterable, order, pos0, start_worker, tracks, sampler_start=None):
        self.n, self.iterable = n, iterable
        self.order = order  # the iterator's tasks (and placeholders) of this epoch, from position pos0
        self.pos0 = pos0
        self.start_worker = start_worker
        self.prefix = 0  # order[:prefix] are all settled
        self.queues = [collections.deque() for _ in range(n)]  # each worker's tasks not yet settled
        self.start_rng = [t.start_rng for t in tracks]
        self.rng = list(self.start_rng)  # after the last settled outcome of each worker
        self.data = [t.start_data for t in tracks]  # a Stateful dataset's state, likewise
        self.batches = [t.base for t in tracks]  # batches (and errors) settled, replayed ones included
        self.stopped = [t.base_stopped for t in tracks]
        # a Stateful sampler's state after k index batches drawn (k = 0: the state loaded, if any), kept
        # from the settled prefix on: the sampler is read prefetch_factor * workers batches ahead
        self.sampler_states = {0: sampler_start}

    def drew(self, k, state):
        """The iterator drew its k-th index batch of the epoch (position pos0 + k - 1): the Stateful
        sampler's state after it."""
        self.sampler_states[k] = state

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
            if t.kind == TaskKind.STOP:
                self.stopped[w] = True
            elif t.kind in (TaskKind.BATCH, TaskKind.ERROR):
                self.batches[w] += 1
            if t.rng is not None:
                self.rng[w] = t.rng
                t.rng = None  # an epoch's tasks stay in `order`: keep 10 kB per worker, not per batch
            if t.data is not None:
                self.data[w] = t.data
                t.data = None
        self._advance()

    def _advance(self):
        order, start = self.order, self.prefix
        while self.prefix < len(order) and settled(order[self.prefix]):
            self.prefix += 1
        for k in range(start, self.prefix):
            self.sampler_states.pop(k, None)

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
        ahead = [[i for i, t in enumerate(q) if settled(t) and t.kind in (TaskKind.BATCH, TaskKind.ERROR)] if self.iterable else []
                 for q in self.queues]
        return {"sampler_batches": self.pos0 + prefix, "yielded_after": after, "yielded_after_rng": after_rng,
                "next_worker": (order[prefix - 1].wid + 1) % self.n if prefix else self.start_worker,
                # map-style and Stateful datasets: the states to set; any other IterableDataset: those
                # to replay its batches from
                "worker_rng": [self.rng[w] if not self.iterable or self.data[w] is not None else self.start_rng[w]
                               for w in range(self.n)],
                "worker_data": list(self.data), "sampler_state": self.sampler_states.get(prefix),
                "worker_batches": list(self.batches), "worker_stopped": list(self.stopped), "worker_ahead": ahead}


def epoch_sampler(batch_sampler, sampler):
    """Of a loader's batch_sampler and sampler, the one whose set_epoch(e) orders each epoch,
    DistributedSampler's way (the batch sampler's own sampler, or the batch sampler itself), or None."""
    for sampler in (batch_sampler, getattr(batch_sampler, "sampler", None), sampler):
        epoch = getattr(sampler, "epoch", None)
        if callable(getattr(sampler, "set_epoch", None)) and isinstance(epoch, int) and not isinstance(epoch, bool):
            return sampler
    return None


def resume_sampler_epoch(sampler, epoch, epoch_at_load):
    """A state taken mid-epoch resumes that epoch's order: its sampler is set back to the epoch it
    had (a DistributedSampler draws its permutation from seed + epoch), whatever set_epoch said since.
    The warning is for a set_epoch(other) called after load_state_dict: a sampler still at the epoch
    it had then was told nothing since (Lightning loads the state into a fresh sampler, at epoch 0,
    and calls iter() before its set_epoch(the saved epoch)), so the state's epoch is taken silently."""
    if sampler is None:
        warnings.warn(f"DataLoader: the state was taken with a sampler at epoch {epoch} (set_epoch), this "
                      "loader's sampler has no set_epoch: the resumed epoch may draw another order", stacklevel=3)
        return
    if sampler.epoch != epoch:
        if sampler.epoch != epoch_at_load:
            warnings.warn(f"DataLoader: the state was taken in the sampler's epoch {epoch}, the sampler is at epoch "
                          f"{sampler.epoch}: the resumed epoch runs as epoch {epoch} (set_epoch({epoch}))", stacklevel=3)
        sampler.set_epoch(epoch)

"""hotloop.DataLoader mid-epoch resume with random transforms, and replaced IterableDataset workers (CPU)."""
import io
import os
import random
import signal
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data import DataLoader as TorchDataLoader

import hotloop

from ..seeding import current_seed, seeded_generator
from .conftest import draw_from_rngs, fake_device

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")






class Noisy(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return draw_from_rngs(i, 3)


class NoisyStream(IterableDataset):
    """Worker w yields w, w + num_workers, ...; how many it skips between samples is random too, so
    that its position depends on its RNG."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        i = wid
        while i < self.n:
            yield draw_from_rngs(i, 3)
            i += nw * (1 + (torch.rand(()) < 0.2).item())


def assert_same(a, b, path="batch"):
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{b.shape}"
        assert torch.equal(a, b), f"{path}: values differ:\n{a}\n{b}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def assert_batches(theirs, ours, what):
    assert len(ours) == len(theirs), f"{what}: {len(ours)} batches, expected {len(theirs)}"
    for j, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert_same(a, b, f"{what}: batch {j}")


def make(kind, num_workers, persistent, seed, in_order=True, **extra):
    ds = Noisy(23) if kind == "map" else NoisyStream(23)
    kwargs = dict(batch_size=3, num_workers=num_workers, persistent_workers=persistent, in_order=in_order, **extra)
    if kind == "map":
        kwargs.update(shuffle=True, generator=torch.Generator().manual_seed(seed))
    return hotloop.DataLoader(ds, **kwargs)


def through_torch_save(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only (the default): the state is plain data


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("num_workers", [1, 3])
def test_resume_matches_every_later_batch(num_workers, kind, persistent):
    """States taken in the second epoch after k batches (k = 0, within the prefetch window, mid-epoch,
    after the last batch) and at the end of the first and second epoch: a fresh loader that loads one
    yields, batch for batch, what the original yielded after it, that epoch and the next."""
    seed = random.randrange(1 << 20)
    torch.manual_seed(seed)
    loader = make(kind, num_workers, persistent, seed)
    epochs, states = [], {}
    epochs.append(list(loader))
    states["end1"] = loader.state_dict()
    it = iter(loader)
    second = []
    n = 8 if kind == "map" else None  # an iterable's length is random
    while True:
        k = len(second)
        states[k] = loader.state_dict()
        try:
            second.append(next(it))
        except StopIteration:
            break
    states["last"] = states.pop(len(second))  # after the last batch, before StopIteration
    epochs.append(second)
    states["end2"] = loader.state_dict()
    epochs.append(list(loader))
    if n is not None:
        assert [len(e) for e in epochs] == [n] * 3
    assert len(second) >= 4
    for key, state in states.items():
        if key not in ("end1", "end2", "last", 0, 1, 2, len(second) // 2):
            continue
        if key == "end1":
            expected = [epochs[1], epochs[2]]
        elif key == "end2":
            expected = [epochs[2]]
        elif key == "last":
            expected = [[], epochs[2]]
        else:
            expected = [second[key:], epochs[2]]
        state = through_torch_save(state)
        torch.manual_seed(seed + 1)  # the resumed process's own seeds differ
        np.random.seed(seed + 1)
        random.seed(seed + 1)
        resumed = make(kind, num_workers, persistent, seed + 2)
        resumed.load_state_dict(state)
        for e, want in enumerate(expected):
            assert_batches(want, list(resumed), f"state {key!r}, epoch {e} after it")
    # into the loader that made it, whose (persistent) workers have moved on meanwhile
    loader.load_state_dict(states[2])
    assert_batches(second[2:], list(loader), "state 2 loaded into its own loader")
    assert_batches(epochs[2], list(loader), "the epoch after that")


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_resume_in_order_false_yields_exactly_the_rest(kind, persistent):
    """in_order=False: the order is timing's, but the resumed loader yields exactly the batches the
    original had not yielded yet, each equal; and so does a loader resumed from a resumed one; with
    persistent workers, the next epoch too."""
    seed = random.randrange(1 << 20)
    key = lambda b: tuple(b[0].tolist())  # noqa: E731  (sample ids identify a batch)

    def as_set(batches):
        return sorted(batches, key=key)

    torch.manual_seed(seed)
    loader = make(kind, 3, persistent, seed, in_order=False)
    list(loader)  # persistent workers: the states carried into the second epoch matter
    it = iter(loader)
    head = [next(it) for _ in range(4)]
    state = loader.state_dict()
    rest = list(it)
    following = list(loader)
    torch.manual_seed(seed + 1)
    resumed = make(kind, 3, persistent, seed + 2, in_order=False)
    resumed.load_state_dict(through_torch_save(state))
    it = iter(resumed)
    got = [next(it) for _ in range(2)]
    state = resumed.state_dict()
    got += list(it)
    assert sorted(map(key, head + rest)) == sorted(map(key, head + got))
    assert_batches(as_set(rest), as_set(got), "rest")
    if persistent:
        assert_batches(as_set(following), as_set(list(resumed)), "the next epoch")
    again = make(kind, 3, persistent, seed + 3, in_order=False)
    again.load_state_dict(state)
    assert_batches(as_set(rest), as_set(got[:2] + list(again)), "rest, resumed twice")
    if persistent:
        assert_batches(as_set(following), as_set(list(again)), "the next epoch, resumed twice")


def test_state_dict_is_plain_and_old_versions_load():
    seed = random.randrange(1 << 20)
    loader = make("map", 2, False, seed)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = list(it)
    assert state["version"] == 3 and state["batches_yielded"] == 3 and state["sampler_batches"] == 3
    assert all(type(r) is bytes for r in state["worker_rng"]) and len(state["worker_rng"]) == 2
    assert isinstance(state["generator_state"], torch.Tensor)
    # a version-1 state (indices only) still loads, with the old behaviour: same samples from then on
    old = {k: state[k] for k in ("batches_yielded", "generator_state", "base_seed", "epoch_done")}
    old["version"] = 1
    resumed = make("map", 2, False, seed + 1)
    resumed.load_state_dict(old)
    got = list(resumed)
    assert [b[0].tolist() for b in got] == [b[0].tolist() for b in rest]
    # a version-2 state (no Stateful states) loads as before
    two = {k: v for k, v in state.items() if k not in ("worker_data", "sampler_state", "dataset_state")}
    two["version"] = 2
    resumed = make("map", 2, False, seed + 1)
    resumed.load_state_dict(two)
    assert_batches(rest, list(resumed), "a version-2 state")
    # another num_workers: same samples, a warning that the random draws will differ
    other = make("map", 3, False, seed + 1)
    with pytest.warns(UserWarning, match="num_workers=2"):
        other.load_state_dict(state)
    got = list(other)
    assert [b[0].tolist() for b in got] == [b[0].tolist() for b in rest]
    with pytest.raises(ValueError, match="missing"):
        resumed.load_state_dict({"version": 2, "batches_yielded": 0})
    assert len(head) == 3


# a worker that dies ---------------------------------------------------------------------------------
class DyingStream(IterableDataset):
    """Worker w yields w, w + num_workers, ... with random draws; the worker that reaches `victim`
    (or, with victim="end", the end of its shard) kills itself with SIGKILL, once per marker file.
    With short_after_death, a worker that starts once the marker exists yields nothing."""

    def __init__(self, n, victim, marker, short_after_death=False):
        self.n, self.victim, self.marker, self.short = n, victim, marker, short_after_death

    def _die(self):
        if self.marker and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        stop = self.n
        if self.short and os.path.exists(self.marker):
            stop = wid
        for i in range(wid, stop, nw):
            if i == self.victim:
                self._die()
            yield draw_from_rngs(i, 3)
        if self.victim == "end" and wid == 0:
            self._die()


@pytest.mark.parametrize("victim", [1, 20, 37, "end"])  # 1: in a worker's first batch, before the ring
def test_iterable_worker_killed_is_replaced(tmp_path, victim):
    marker = str(tmp_path / "died")
    kwargs = dict(batch_size=4, num_workers=3)
    torch.manual_seed(current_seed() + 5)
    ref = list(TorchDataLoader(DyingStream(50, -1, ""), **kwargs))
    torch.manual_seed(current_seed() + 5)
    loader = hotloop.DataLoader(DyingStream(50, victim, marker), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = list(loader)
    assert os.path.exists(marker)
    assert loader.stats.worker_restarts == 1
    ids = torch.cat([b[0] for b in got]).tolist()
    assert sorted(ids) == list(range(50))  # every sample exactly once
    assert_batches(ref, got, "after a restart")  # random draws included: the replacement replayed


def test_iterable_worker_killed_with_persistent_workers(tmp_path):
    marker = str(tmp_path / "died")
    kwargs = dict(batch_size=3, num_workers=2, persistent_workers=True)
    torch.manual_seed(current_seed() + 6)
    ref_loader = TorchDataLoader(DyingStream(30, -1, ""), **kwargs)
    ref = [list(ref_loader) for _ in range(3)]
    del ref_loader  # its workers and queue threads end before hotloop's workers are forked (conftest.py)
    torch.manual_seed(current_seed() + 6)
    loader = hotloop.DataLoader(DyingStream(30, -1, marker), **kwargs)
    first = list(loader)
    loader.dataset.victim = 13  # the workers hold their own copy: only a replacement sees this
    loader._hl_pool.procs[1].kill()  # dies between epochs: replaced at the next epoch's start ...
    loader._hl_pool.procs[1].join()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [first, list(loader), list(loader)]  # ... and the replacement dies at sample 13
    for e in range(3):
        assert_batches(ref[e], got[e], f"epoch {e}")
    assert loader.stats.worker_restarts == 2


def test_map_worker_killed_redoes_the_same_random_draws(tmp_path):
    """A replaced map-style worker starts from the RNG states after the last batch the main process
    has from it: its redone batches are the ones torch would have yielded, random draws included."""
    marker = str(tmp_path / "died")

    class Dying(Noisy):
        def __getitem__(self, i):
            if i == 17 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return draw_from_rngs(i, 3)

    kwargs = dict(batch_size=4, num_workers=3, shuffle=True)
    torch.manual_seed(current_seed() + 8)
    ref = list(TorchDataLoader(Noisy(50), generator=seeded_generator(4), **kwargs))
    torch.manual_seed(current_seed() + 8)
    loader = hotloop.DataLoader(Dying(50), generator=seeded_generator(4), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = list(loader)
    assert os.path.exists(marker) and loader.stats.worker_restarts == 1
    assert_batches(ref, got, "after a restart")


def test_iterable_worker_killed_without_restarts_raises(tmp_path):
    loader = hotloop.DataLoader(DyingStream(50, 20, str(tmp_path / "died")), batch_size=4, num_workers=3,
                                max_worker_restarts=0)
    it = iter(loader)
    pool = it._pool
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal: Killed\. It was "
                                           r"worker 2, holding the indices .*; 0 worker\(s\) were restarted already "
                                           r"\(max_worker_restarts=0\)"):
        list(it)
    assert pool.closed


def test_iterable_that_is_not_a_function_of_its_seed_is_named(tmp_path):
    """A replacement whose replay does not reach where its predecessor stood raises, not hangs."""
    loader = hotloop.DataLoader(DyingStream(50, 38, str(tmp_path / "died"), short_after_death=True), batch_size=4,
                                num_workers=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="replaying the IterableDataset"):
            list(loader)


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_resume_with_batches_prepared_for_the_device(fake_cuda, kind):
    """With device=, batches are taken from the ring prefetch_batches ahead of the one handed out:
    the state counts what was handed out, not what was taken (the device path on a fake CUDA)."""
    seed = random.randrange(1 << 20)

    def on_device(loader):
        loader.prefetch_batches = 3
        return fake_device(loader)

    torch.manual_seed(seed)
    loader = on_device(make(kind, 3, False, seed))
    it = iter(loader)
    head = [next(it)]
    time.sleep(0.3)  # lets the workers get ahead: the next call prepares batches past the one it hands out
    head.append(next(it))
    state = loader.state_dict()
    rest = list(it)
    torch.manual_seed(seed + 1)
    resumed = on_device(make(kind, 3, False, seed + 2))
    resumed.load_state_dict(state)
    assert_batches(rest, list(resumed), "rest")
    assert len(head) == 2


def test_successor_plan_follows_the_order_the_worker_made_its_batches():
    """A worker's first batch can wait for Place while its second is ready (and, with in_order=False,
    taken): a replacement must redo, replay or skip each in the order the dead worker made them."""
    import collections
    import types

    from torch.utils.data.dataloader import _DatasetKind

    from hotloop.data.messages import Setup, SlotBatch
    from hotloop.data.consumer.pool import Pool
    from hotloop.data.consumer.tasks import Task, WorkerEpoch

    idx = [None] * 4
    lost_a, ready_b, lost_c = Task(5, 0, idx, -1), Task(6, 0, idx, 2), Task(7, 0, idx, 3)
    ahead_d = Task(8, 0, idx, 4, consumed=True, kind="batch", rng=b"after-d")
    ready = {6: SlotBatch(None, [], 0.0, b"after-b")}

    def plan(kind, track):
        pool = types.SimpleNamespace(track=[track], kind=kind, resuming=False, replay_index=idx,
                                     _peek=lambda t: ready.get(t.id))
        return Pool._successor_plan(pool, 0, [lost_a, lost_c])

    def track():
        return WorkerEpoch(start_rng=b"start", recreate=True, base=1, taken=2, last_rng=b"after-prefix",
                           open=collections.deque([lost_a, ready_b, lost_c, ahead_d]))

    # an IterableDataset: from the epoch's start, replay the 3 batches before A, make A, replay B, make C, replay D
    assert plan(_DatasetKind.Iterable, track()) == [
        Setup(b"start", True, 3, False, idx), lost_a, Setup(None, False, 1, False, idx), lost_c,
        Setup(None, False, 1, False, idx)]
    # map-style: A from the states after the prefix, C from those after B, what follows from those after D
    assert plan(_DatasetKind.Map, track()) == [
        Setup(b"after-prefix"), lost_a, Setup(b"after-b"), lost_c, Setup(b"after-d")]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_resume_on_the_gpu(kind):
    """device="cuda" with batches prepared ahead: the resumed loader's device batches equal the
    original's after the saved point, random draws included, that epoch and the next."""
    seed = random.randrange(1 << 20)

    def on_gpu(seed):
        return make(kind, 3, True, seed, device="cuda", prefetch_batches=3)

    torch.manual_seed(seed)
    loader = on_gpu(seed)
    first = [[t.cpu() for t in b] for b in loader]
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = [[t.cpu() for t in b] for b in it]
    following = [[t.cpu() for t in b] for b in loader]
    torch.manual_seed(seed + 1)
    resumed = on_gpu(seed + 2)
    resumed.load_state_dict(through_torch_save(state))
    assert all(t.is_cuda for t in head[0])
    assert_batches(rest, [[t.cpu() for t in b] for b in resumed], "rest")
    assert_batches(following, [[t.cpu() for t in b] for b in resumed], "the next epoch")
    assert len(first) > 0

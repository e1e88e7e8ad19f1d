"""hotloop.DataLoader resume of Stateful datasets and samplers (state_dict/load_state_dict, torchdata's
protocol): their states are saved and loaded, not replayed, against torchdata's StatefulDataLoader (CPU)."""
import multiprocessing
import os
import random
import signal
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

import hotloop

from ..seeding import current_seed, seeded_generator
from .conftest import assert_same, draw_from_rngs, fake_device

# torchdata's loader is the oracle here: a machine without torchdata (the GPU one) skips the module
StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

N = 64
BATCH = 4
CUT = 5  # batches handed out before the state is taken




class CountingStream(IterableDataset):
    """A stream shared out among workers by get_worker_info() that counts every sample it makes (in
    `made`, shared with the workers) and says where it stands (state_dict: the next sample of its
    share), as streaming datasets do. Replaying it would make (and count) the samples again."""

    def __init__(self, made, die_at=None, marker=None):
        self.made, self.start, self.next = made, 0, 0
        self.die_at, self.marker = die_at, marker

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        self.next, self.start = self.start, 0
        while wid + nw * self.next < N:
            i = wid + nw * self.next
            if i == self.die_at and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            with self.made.get_lock():
                self.made.value += 1
            self.next += 1
            yield draw_from_rngs(i)

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.start = state["next"]


def global_rng():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def set_global_rng(states):
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def samples(batches):
    return [tuple(leaf[j] for leaf in b) for b in batches for j in range(len(b[0]))]


def cut_and_resume(make, made):
    """(the uninterrupted run's batches after CUT, the resumed run's, samples the resumed run made)."""
    torch.manual_seed(current_seed() + 11)
    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(CUT)]
    time.sleep(0.2)  # the workers make batches ahead: the state must be that of the batches handed out
    state, rng = loader.state_dict(), global_rng()
    rest = list(it)
    del it
    torch.manual_seed(current_seed() + 12)
    resumed = make()
    resumed.load_state_dict(state)
    set_global_rng(rng)  # num_workers=0: the samples draw from the caller's generators
    made.value = 0
    got = list(resumed)
    assert len(head) == CUT
    return rest, got, made.value


@pytest.mark.parametrize("num_workers", [0, 1, 2, 4])
def test_stateful_stream_is_set_where_it_stood_not_replayed(num_workers):
    """The resumed loader yields what the uninterrupted one did, sample for sample, random draws
    included, and makes only the samples still to come (a replay makes those handed out again);
    torchdata's StatefulDataLoader makes as many, the same ones."""
    made = multiprocessing.Value("i", 0)
    # a generator of its own: with none, the loader rewinds torch's global one, where num_workers=0 draws
    rest, got, count = cut_and_resume(
        lambda: hotloop.DataLoader(CountingStream(made), batch_size=BATCH, num_workers=num_workers,
                                   generator=seeded_generator(3)), made)
    for j, (want, have) in enumerate(zip(samples(rest), samples(got), strict=True)):
        assert_same(want, have, f"sample {j} after the state")
    assert count == N - CUT * BATCH

    loader = StatefulDataLoader(CountingStream(made), batch_size=BATCH, num_workers=num_workers)
    it = iter(loader)
    for _ in range(CUT):
        next(it)
    state = loader.state_dict()
    del it
    resumed = StatefulDataLoader(CountingStream(made), batch_size=BATCH, num_workers=num_workers)
    resumed.load_state_dict(state)
    made.value = 0
    theirs = list(resumed)
    assert count <= made.value  # torchdata's workers may make a batch more
    assert [int(s[0]) for s in samples(theirs)] == [int(s[0]) for s in samples(got)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_stream_with_batches_prepared_for_the_device(fake_cuda, num_workers):
    """With device=, batches are made and copied prefetch_batches ahead: the state is that of the
    batches handed out (the device path, on a fake CUDA)."""
    made = multiprocessing.Value("i", 0)

    def make():
        return fake_device(hotloop.DataLoader(CountingStream(made), batch_size=BATCH, num_workers=num_workers,
                                              prefetch_batches=3, generator=seeded_generator(3)))

    rest, got, count = cut_and_resume(make, made)
    for j, (want, have) in enumerate(zip(samples(rest), samples(got), strict=True)):
        if num_workers == 0:  # the batches made ahead drew from the caller's generators before the state
            assert int(want[0]) == int(have[0]), f"sample {j} after the state"
        else:
            assert_same(want, have, f"sample {j} after the state")
    assert count == N - CUT * BATCH


def test_stateful_stream_worker_killed_is_set_where_it_stood(tmp_path):
    """A replaced worker of a Stateful stream loads the state after the last batch taken from its
    predecessor: every sample once, equal to an uninterrupted run's, and none made twice but those lost."""
    made = multiprocessing.Value("i", 0)
    kwargs = dict(batch_size=BATCH, num_workers=2)
    torch.manual_seed(current_seed() + 13)
    ref = list(hotloop.DataLoader(CountingStream(made), **kwargs))
    torch.manual_seed(current_seed() + 13)
    made.value = 0
    loader = hotloop.DataLoader(CountingStream(made, die_at=41, marker=str(tmp_path / "died")), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = list(loader)
    assert loader.stats.worker_restarts == 1
    for j, (want, have) in enumerate(zip(samples(ref), samples(got), strict=True)):
        assert_same(want, have, f"sample {j}")
    # a replay from the epoch's start would make worker 1's 20 samples before 41 again; a state
    # loaded makes again at most the batches in flight when it died (prefetch_factor of them)
    assert N <= made.value <= N + 2 * BATCH


class Noisy(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return draw_from_rngs(i)


class CountingSampler(Sampler):
    """A shuffled order that counts the indices it hands out and says where it stands (state_dict),
    as a resumable sampler (torchdata's StatefulDistributedSampler) does."""

    def __init__(self, seed):
        self.seed, self.start, self.yielded, self.drawn = seed, 0, 0, 0

    def __len__(self):
        return N

    def __iter__(self):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(self.seed)).tolist()
        self.yielded, self.start = self.start, 0
        while self.yielded < N:
            self.drawn += 1
            self.yielded += 1
            yield order[self.yielded - 1]

    def state_dict(self):
        return {"yielded": self.yielded}

    def load_state_dict(self, state):
        self.start = state["yielded"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_sampler_is_set_where_it_stood_not_replayed(num_workers):
    """A sampler with state_dict resumes from its state: the same samples as the uninterrupted run,
    random draws included, and only the indices still to come drawn, as torchdata's loader draws."""
    seed = random.randrange(1 << 20)
    torch.manual_seed(seed)
    loader = hotloop.DataLoader(Noisy(), batch_size=BATCH, sampler=CountingSampler(seed), num_workers=num_workers,
                                generator=torch.Generator().manual_seed(seed))
    it = iter(loader)
    head = [next(it) for _ in range(CUT)]
    time.sleep(0.2)  # the index batches of the workers' next tasks are drawn already
    state, rng = loader.state_dict(), global_rng()
    rest = list(it)
    del it
    sampler = CountingSampler(seed)
    resumed = hotloop.DataLoader(Noisy(), batch_size=BATCH, sampler=sampler, num_workers=num_workers,
                                 generator=torch.Generator().manual_seed(seed + 1))
    resumed.load_state_dict(state)
    set_global_rng(rng)
    got = list(resumed)
    for j, (want, have) in enumerate(zip(samples(rest), samples(got), strict=True)):
        assert_same(want, have, f"sample {j} after the state")
    assert sampler.drawn == N - CUT * BATCH and len(head) == CUT

    theirs = StatefulDataLoader(Noisy(), batch_size=BATCH, sampler=CountingSampler(seed), num_workers=num_workers)
    it = iter(theirs)
    for _ in range(CUT):
        next(it)
    state = theirs.state_dict()
    del it
    sampler = CountingSampler(seed)
    again = StatefulDataLoader(Noisy(), batch_size=BATCH, sampler=sampler, num_workers=num_workers)
    again.load_state_dict(state)
    ids = [int(s[0]) for s in samples(list(again))]
    assert sampler.drawn == N - CUT * BATCH
    assert ids == [int(s[0]) for s in samples(got)]


@pytest.mark.parametrize("persistent, in_order", [(True, True), (False, False)])
def test_stateful_stream_persistent_or_out_of_order(persistent, in_order):
    """Persistent workers (a state taken in the second epoch, then the epoch after it) and
    in_order=False (batches in timing's order): the resumed loader yields the batches the original had
    not yielded, each equal, and makes only those samples."""
    made = multiprocessing.Value("i", 0)

    def make():
        return hotloop.DataLoader(CountingStream(made), batch_size=BATCH, num_workers=3, in_order=in_order,
                                  persistent_workers=persistent)

    def key(b):
        return tuple(b[0].tolist())

    torch.manual_seed(current_seed() + 14)
    loader = make()
    list(loader)
    it = iter(loader)
    head = [next(it) for _ in range(CUT)]
    time.sleep(0.2)
    state = loader.state_dict()
    rest, following = list(it), list(loader)
    del it
    resumed = make()
    resumed.load_state_dict(state)
    made.value = 0
    got = list(resumed)
    assert made.value == N - CUT * BATCH and len(head) == CUT
    for a, b in zip(sorted(rest, key=key), sorted(got, key=key), strict=True):
        assert_same(a, b)
    if persistent:
        for a, b in zip(following, list(resumed), strict=True):
            assert_same(a, b)


class Serving(Dataset):
    """A map-style dataset with a state of its own: how many samples it served (in this process),
    which each sample carries; state_dict says it."""

    def __init__(self, die_at=None, marker=None):
        self.served, self.die_at, self.marker = 0, die_at, marker

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i == self.die_at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        self.served += 1
        return torch.tensor(i), torch.tensor(self.served), torch.rand(2)

    def state_dict(self):
        return {"served": self.served}

    def load_state_dict(self, state):
        self.served = state["served"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_map_dataset_is_set_where_it_stood(num_workers):
    """A map-style dataset with state_dict: the resumed loader's (workers') datasets are loaded with
    the states after the batches handed out, so its samples equal the uninterrupted run's."""
    seed = random.randrange(1 << 20)

    def make(seed):
        return hotloop.DataLoader(Serving(), batch_size=BATCH, shuffle=True, num_workers=num_workers,
                                  generator=torch.Generator().manual_seed(seed))

    torch.manual_seed(seed)
    loader = make(seed)
    it = iter(loader)
    head = [next(it) for _ in range(CUT)]
    time.sleep(0.2)
    state, rng = loader.state_dict(), global_rng()
    rest = list(it)
    del it
    resumed = make(seed + 1)
    resumed.load_state_dict(state)
    set_global_rng(rng)
    got = list(resumed)
    for j, (want, have) in enumerate(zip(samples(rest), samples(got), strict=True)):
        assert_same(want, have, f"sample {j} after the state")
    assert len(head) == CUT and int(got[-1][1].max()) > BATCH


def test_stateful_map_dataset_worker_killed_is_set_where_it_stood(tmp_path):
    """A replaced map-style worker starts from its predecessor's dataset state (and RNG states) after
    the last batch taken from it: its redone batches equal those of a run without a death."""
    kwargs = dict(batch_size=BATCH, num_workers=2, shuffle=True)
    torch.manual_seed(current_seed() + 15)
    ref = list(hotloop.DataLoader(Serving(), generator=seeded_generator(4), **kwargs))
    torch.manual_seed(current_seed() + 15)
    loader = hotloop.DataLoader(Serving(die_at=37, marker=str(tmp_path / "died")),
                                generator=seeded_generator(4), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = list(loader)
    assert loader.stats.worker_restarts == 1
    for j, (want, have) in enumerate(zip(samples(ref), samples(got), strict=True)):
        assert_same(want, have, f"sample {j}")

"""hotloop.DataLoader resume across num_workers: exact where defined, refused or warned where not (CPU)."""
import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import hotloop

from .conftest import assert_same, draw_from_rngs

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

N = 40
BATCH = 3
CUT = 3  # batches handed out before the state is taken




class Noisy(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return draw_from_rngs(i)


class Sharded(IterableDataset):
    """A stream of N samples shared out among workers by get_worker_info(), as a user writes one."""

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i in range(wid, N, nw):
            yield draw_from_rngs(i)


def make(kind, num_workers, seed):
    if kind == "map":
        return hotloop.DataLoader(Noisy(), batch_size=BATCH, shuffle=True, num_workers=num_workers,
                                  generator=torch.Generator().manual_seed(seed))
    return hotloop.DataLoader(Sharded(), batch_size=BATCH, num_workers=num_workers)


def global_rng():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def set_global_rng(states):
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def samples(batches):
    """Each sample of the batches, in order: (id, its random draws)."""
    return [tuple(leaf[j] for leaf in b) for b in batches for j in range(len(b[0]))]


@pytest.mark.parametrize("after", [0, 1, 2, 4])
@pytest.mark.parametrize("before", [0, 1, 2, 4])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_resume_with_another_num_workers(kind, before, after):
    """A state taken after CUT batches with `before` workers, loaded into a loader with `after`: the
    same num_workers resumes exactly, sample for sample, random draws included; a map-style dataset
    resumes at the same samples with a warning that worker-side draws change; an IterableDataset
    refuses (its split among workers changes with their number: samples would repeat and go missing)."""
    seed = random.randrange(1 << 20)
    torch.manual_seed(seed)
    loader = make(kind, before, seed)
    it = iter(loader)
    head = [next(it) for _ in range(CUT)]
    state, rng = loader.state_dict(), global_rng()
    rest = list(it)  # the uninterrupted run's
    del it
    torch.manual_seed(seed + 1)  # the resumed process's own seeds
    np.random.seed(seed + 1)
    resumed = make(kind, after, seed + 2)
    if kind == "iterable" and before != after:
        with pytest.raises(ValueError, match=rf"num_workers={before}, this loader has num_workers={after}.*"
                                             rf"repeated.*Resume with num_workers={before}"):
            resumed.load_state_dict(state)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
    named = [str(w.message) for w in caught if "random transforms" in str(w.message)]
    assert len(named) == (before != after), named
    if after == 0:
        set_global_rng(rng)  # in the main process, transforms draw from the caller's generators
    got = list(resumed)
    assert [b[0].tolist() for b in head] and len(head) == CUT
    # num_workers=0 and an IterableDataset without state_dict: its position is replayed in the main
    # process, whose draws are the caller's (test_loader_resume_stateful.py has one with state_dict)
    exact = before == after and not (kind == "iterable" and after == 0)
    for j, (want, have) in enumerate(zip(samples(rest), samples(got), strict=True)):
        assert int(want[0]) == int(have[0]), f"sample {j} after the state: {int(have[0])}, expected {int(want[0])}"
        if exact:
            assert_same(want, have, f"sample {j} after the state")
    if kind == "iterable":
        ids = sorted(int(x) for b in head + got for x in b[0])
        assert ids == list(range(N))  # every sample once


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_state_at_an_epoch_boundary_loads_into_any_num_workers(kind):
    """Taken before the first batch or after an epoch's last, a state holds no position inside a
    worker's share: any num_workers starts from it (an IterableDataset too); before the first batch
    with a warning (the epoch's worker-side draws change), after the last without a word."""
    seed = random.randrange(1 << 20)
    loader = make(kind, 2, seed)
    it = iter(loader)
    first = loader.state_dict()  # no batch handed out yet
    del it
    list(loader)
    end = loader.state_dict()
    for state in (first, end):
        for n in (0, 3):
            resumed = make(kind, n, seed + 1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                resumed.load_state_dict(state)
                got = list(resumed)
            said = [str(w.message) for w in caught if "This DataLoader will create" not in str(w.message)]
            if state is first:
                assert len(said) == 1 and "num_workers=2, this loader has num_workers=" in said[0], said
            else:
                assert not said
            assert sorted(int(x) for b in got for x in b[0]) == list(range(N))


def test_state_of_another_dataset_kind_is_refused():
    seed = random.randrange(1 << 20)
    loader = make("iterable", 2, seed)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    with pytest.raises(ValueError, match="IterableDataset, this loader has a map-style dataset"):
        make("map", 2, seed).load_state_dict(state)

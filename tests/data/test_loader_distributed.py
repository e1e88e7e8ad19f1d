"""hotloop.DataLoader under torch.distributed (2 gloo ranks; NCCL on 2 GPUs): DistributedSampler batches
equal torch's on every rank, a ring per rank, mid-epoch resume per rank, stats gathered to one rank,
device="cuda" as each rank's current device."""
import dataclasses
import gc
import io
import os
import random
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

import hotloop
from hotloop.data import GatheredStats, LoaderStats
from hotloop.data.ring.copies import DeviceCopies

from ..distributed import run_ranks
from .conftest import assert_same, fake_device, shm_files

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

# a rank that run_ranks spawned would start its loaders' workers with spawn too (multiprocessing's
# default in a spawned process), each importing torch anew (seconds here); torchrun's ranks fork
# them, and so do these tests, torch's loader and ours alike
WORKERS = "fork"


class Draws(Dataset):
    """Sample i: a fixed random row plus a draw from each global RNG a worker seeds, i itself, and a
    sleep of `delay` seconds (a slow rank)."""

    def __init__(self, n, seed, delay=0.0):
        self.base = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))
        self.delay = delay

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return self.base[i] + torch.rand(3), torch.from_numpy(np.random.rand(2)), i, random.random()


def seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def assert_batches(theirs, ours, what):
    assert len(ours) == len(theirs), f"{what}: {len(ours)} batches, expected {len(theirs)}"
    for j, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert_same(a, b, f"{what}: batch {j}")


def ring_memfds():
    """The inode of each hotloop ring this process has open: memfds, never a named file."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "hotloop-ring" in target:
            assert target.startswith("/memfd:"), target
            found.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    return found


def new_shm_files(before):
    """Files in /dev/shm that were not there before, but multiprocessing's named semaphores
    (sem.mp-*: run_ranks' queue, and any other test process on this machine)."""
    return {f for f in shm_files() - before if not f.startswith("sem.mp-")}


def make(cls, ds, sampler, nw, **kwargs):
    return cls(ds, batch_size=5, sampler=sampler, num_workers=nw, multiprocessing_context=WORKERS if nw else None,
               **kwargs)


# DistributedSampler: the same batches as torch's on every rank -------------------------------------
def _same_batches_as_torch(rank, world_size, seed, configs, epochs):
    """Each config's epochs on this rank, from torch's loader and ours (set_epoch(e) before epoch e,
    the same global seeds); the sample ids ours yielded per epoch, and the rings each config had open."""
    ids, rings = [], []
    for n, nw, shuffle, drop_last, sampler_drop_last, persistent in configs:
        ds = Draws(n, seed)
        what = f"rank {rank}, n={n} num_workers={nw} shuffle={shuffle} drop_last={drop_last}/{sampler_drop_last}"
        runs = []
        for cls in (TorchDataLoader, hotloop.DataLoader):
            seed_all(seed * 7 + rank)  # each rank's own global seeds (workers' base seeds, num_workers=0 draws)
            sampler = DistributedSampler(ds, shuffle=shuffle, seed=seed, drop_last=sampler_drop_last)
            loader = make(cls, ds, sampler, nw, drop_last=drop_last, persistent_workers=persistent)
            epochs_out, seen = [], set()
            for e in range(epochs):
                sampler.set_epoch(e)
                it = iter(loader)
                batches = [next(it)]
                # mid-epoch: this epoch's ring, and past epochs' while batches handed out as views of them live
                open_now = ring_memfds()
                assert bool(open_now) == bool(nw and cls is hotloop.DataLoader), f"{what}: rings {open_now}"
                seen |= open_now
                batches += list(it)
                epochs_out.append(batches)
            runs.append(epochs_out)
            del it, loader
        for e in range(epochs):
            assert_batches(runs[0][e], runs[1][e], f"{what}, epoch {e}")
        ids.append([[i for b in batches for i in b[2].tolist()] for batches in runs[1]])
        rings.append(sorted(seen))
    gc.collect()
    return ids, rings, sorted(ring_memfds())


def test_distributed_sampler_batches_equal_torchs_on_every_rank():
    """DistributedSampler with and without shuffle, drop_last on the loader and on the sampler, 0
    and 2 workers (persistent or not), 3 epochs: every rank's batches equal torch's, element for
    element; the ranks' shards of an epoch are disjoint and together the whole dataset (plus the
    sampler's padding); each rank's workers write into a ring of its own (a memfd: no name to
    collide, no /dev/shm file), and none is left open once the loaders are gone."""
    seed = random.randrange(1 << 20)
    configs = [(23, 0, shuffle, drop_last, sampler_drop_last, False)
               for shuffle in (False, True) for drop_last in (False, True) for sampler_drop_last in (False, True)]
    configs += [(22, 2, shuffle, drop_last, False, shuffle) for shuffle in (False, True) for drop_last in (False, True)]
    configs += [(23, 2, True, False, True, False), (22, 0, True, False, False, False)]
    before = shm_files()
    results = run_ranks(_same_batches_as_torch, 2, args=(seed, configs, 3))
    assert not new_shm_files(before)
    for c, (n, nw, shuffle, drop_last, sampler_drop_last, _) in enumerate(configs):
        per_rank = [results[r][0][c] for r in range(2)]
        for e in range(3):
            shards = [per_rank[r][e] for r in range(2)]
            every = shards[0] + shards[1]
            if drop_last:  # the sampler's padding (n odd) sits in the short last batch, dropped
                assert len(set(every)) == len(every), f"config {c}, epoch {e}: shards overlap"
                continue
            if sampler_drop_last:  # the last odd sample dropped, the rest shared out once
                assert len(set(every)) == len(every) == n - n % 2, f"config {c}, epoch {e}"
            else:  # the whole dataset, plus the sampler's padding (n odd: the first index again)
                assert set(every) == set(range(n)), f"config {c}, epoch {e}: shards miss samples"
                assert len(every) == n + n % 2, f"config {c}, epoch {e}"
            assert len(shards[0]) == len(shards[1])
        if shuffle:  # set_epoch reached the sampler: each epoch has its own order
            assert per_rank[0][0] != per_rank[0][1] or per_rank[0][1] != per_rank[0][2]
    for c, (_, nw, *_rest) in enumerate(configs):
        if nw:
            assert not set(results[0][1][c]) & set(results[1][1][c]), f"config {c}: the ranks share a ring"
    assert results[0][2] == [] and results[1][2] == [], "a ring is still open after the loaders are gone"


# mid-epoch resume on every rank ------------------------------------------------------------------
def through_torch_save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def global_rng():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def set_global_rng(states):
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def _resume_on_every_rank(rank, world_size, seed, configs):
    """Per config: epoch 1 cut after 2 + rank batches (a different point on each rank), resumed by a
    new loader and sampler in each way of `hows`: the rest of epoch 1, and epoch 2, equal torch's.
    Returns the sample ids of each config's resumed rest."""
    ds = Draws(37, seed)
    cut = 2 + rank
    rests = []
    for nw, persistent, hows in configs:
        what = f"rank {rank}, num_workers={nw}, persistent_workers={persistent}"

        def loader_kwargs():
            if nw == 0:  # the samples draw from the global RNGs, the caller's to save: the loader's generator apart
                return dict(persistent_workers=persistent, generator=torch.Generator().manual_seed(seed))
            return dict(persistent_workers=persistent)

        seed_all(seed + rank)
        sampler = DistributedSampler(ds, shuffle=True, seed=seed)
        theirs = make(TorchDataLoader, ds, sampler, nw, **loader_kwargs())
        want = []
        for e in range(3):
            sampler.set_epoch(e)
            want.append(list(theirs))
        del theirs

        seed_all(seed + rank)
        sampler = DistributedSampler(ds, shuffle=True, seed=seed)
        ours = make(hotloop.DataLoader, ds, sampler, nw, **loader_kwargs())
        sampler.set_epoch(0)
        assert_batches(want[0], list(ours), f"{what}: epoch 0")
        sampler.set_epoch(1)
        it = iter(ours)
        head = [next(it) for _ in range(cut)]
        state, rng = through_torch_save(ours.state_dict()), global_rng()
        assert state["sampler_epoch"] == 1
        assert_batches(want[1][:cut], head, f"{what}: epoch 1 before the state")
        del it, ours

        for how in hows:
            seed_all(seed + 100 + rank)  # the resumed process's own seeds
            sampler = DistributedSampler(ds, shuffle=True, seed=seed)
            resumed = make(hotloop.DataLoader, ds, sampler, nw, **loader_kwargs())
            resumed.load_state_dict(state)
            set_global_rng(rng)
            if isinstance(how, int):
                sampler.set_epoch(how)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                it = iter(resumed)
                if how == "iter first":  # Lightning's order on a resume: iter(), then set_epoch(the saved epoch)
                    sampler.set_epoch(1)
                rest = list(it)
                del it
            named = [str(w.message) for w in caught if "sampler" in str(w.message)]
            if how == 5:  # set_epoch said another epoch after the state was loaded
                assert len(named) == 1 and "runs as epoch 1" in named[0], named
            else:  # set to the saved epoch, before or after iter(), or left as it was when the state was loaded
                assert not named, named
            assert sampler.epoch == 1
            assert_batches(want[1][cut:], rest, f"{what}, set_epoch({how}): the rest of epoch 1")
            sampler.set_epoch(2)
            assert_batches(want[2], list(resumed), f"{what}, set_epoch({how}): epoch 2")
            del resumed
        rests.append([i for b in rest for i in b[2].tolist()])
    return rests


def test_state_dict_resumes_every_rank_where_it_was():
    """Each rank saves its state at its own point of epoch 1 (random draws in the samples; 0 or 2
    workers, persistent or not); a new loader and DistributedSampler in each rank load it and yield
    torch's remaining batches of that epoch, then torch's epoch 2. The state holds the sampler's
    epoch: a resumed sampler set to another epoch after load_state_dict is set back to it, with a
    warning; left at epoch 0, or set to it (before iter(), or after it as Lightning does), no warning."""
    seed = random.randrange(1 << 20)
    configs = [(0, False, (1, None, 5, "iter first")), (2, False, (None, "iter first")), (2, True, (1, 5))]
    rests = run_ranks(_resume_on_every_rank, 2, args=(seed, configs))
    for c in range(len(configs)):
        assert rests[0][c] and not set(rests[0][c]) & set(rests[1][c])  # each rank went on with its own shard


# stats gathered to one rank -----------------------------------------------------------------------
def _gather_stats(rank, world_size, seed):
    """Rank 1's samples are slow: its loop waits most of its time. Every rank gathers to rank 0,
    then to rank 1 through a group of both, then asks for a rank outside the group."""
    ds = Draws(24, seed, delay=0.03 if rank == 1 else 0.0)
    loader = hotloop.DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, shuffle=True, seed=seed))
    for _ in loader:
        time.sleep(0.01)  # the training step
    own = dataclasses.asdict(loader.stats)
    to0 = loader.stats.gather()
    group = dist.new_group([0, 1])
    to1 = loader.stats.gather(dst=1, group=group)
    try:
        loader.stats.gather(dst=2)
    except ValueError as exc:
        bad = str(exc)
    else:
        bad = None
    dist.barrier()  # nobody was left waiting in a collective by the bad call
    return own, plain(to0), plain(to1), bad


def plain(gathered):
    """What a GatheredStats says, as plain data (a rank's return value travels pickled)."""
    if gathered is None:
        return None
    return (gathered.ranks, [dataclasses.asdict(s) for s in gathered], gathered.slowest_rank, gathered.summary,
            str(gathered), isinstance(gathered, GatheredStats))


def test_stats_gather_to_rank_0():
    """loader.stats.gather() returns every rank's LoaderStats on the destination rank (equal, field
    for field, to what each rank had) and None elsewhere, names the rank that waited most, and says
    so in one line; a destination outside the group is a ValueError on every rank, before the
    collective."""
    seed = random.randrange(1 << 20)
    (own0, to0_at0, to1_at0, bad0), (own1, to0_at1, to1_at1, bad1) = run_ranks(_gather_stats, 2, args=(seed,))
    assert to0_at1 is None and to1_at0 is None
    for ranks, stats, slowest, summary, text, typed in (to0_at0, to1_at1):
        assert typed and ranks == [0, 1]
        assert stats == [own0, own1]
        assert slowest == 1
        fractions = [LoaderStats(**s).stall_fraction for s in stats]
        assert own1["wait_seconds"] >= 6 * 2 * 0.03 and fractions[1] > fractions[0]
        assert summary == text and "\n" not in summary
        assert summary.startswith("hotloop.DataLoader on 2 ranks: rank 1 waited longest")
        assert f"{fractions[1]:.1%} of its time" in summary and f"other ranks {fractions[0]:.1%}" in summary
        assert f"{own1['batches']} batches" in summary and own1["batches"] == 6
    assert bad0 == bad1 and "expected dst to be a rank of the group [0, 1], got 2" in bad0


def test_stats_gather_needs_a_process_group():
    stats = LoaderStats()
    with pytest.raises(RuntimeError, match="init_process_group"):
        stats.gather()
    with pytest.raises(TypeError, match="dst to be an int"):
        stats.gather(dst="0")


def test_gathered_summary_of_one_rank_and_of_no_batches():
    idle = GatheredStats([0, 1], [LoaderStats(), LoaderStats()])
    assert idle.summary == "hotloop.DataLoader on 2 ranks: no batches yet"
    one = GatheredStats([3], [LoaderStats(batches=4, wait_seconds=0.5, elapsed_seconds=2.0)])
    assert one.slowest_rank == 3 and one.slowest is one[0]
    assert one.summary == ("hotloop.DataLoader on 1 rank: rank 3 waited longest for its batches, 25.0% of its time "
                           "(0.500 s of 2.000 s, 4 batches)")


# device="cuda": the rank's current device ----------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_cuda_is_the_current_device_when_iteration_starts(fake_cuda, monkeypatch, num_workers):
    """device="cuda" without an index follows torch.cuda.current_device() until the first epoch
    starts (a loader made before torch.cuda.set_device(local_rank) still goes to the rank's device),
    then keeps that device; the copies go there (fake CUDA: the device path on the CPU)."""
    current = [0]
    monkeypatch.setattr(hotloop._C, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    devices = []

    class Recording(DeviceCopies.calls):
        def __init__(self, device):
            devices.append(device)
            super().__init__(device)

    monkeypatch.setattr(DeviceCopies, "calls", Recording)
    ds = Draws(13, random.randrange(1 << 20))
    seed_all(5)
    want = list(TorchDataLoader(ds, batch_size=4, num_workers=num_workers))
    seed_all(5)
    loader = hotloop.DataLoader(ds, batch_size=4, num_workers=num_workers, device="cuda")
    assert loader.device == torch.device("cuda", 0)
    current[0] = 1  # torch.cuda.set_device(1) after the loader was made
    assert loader.device == torch.device("cuda", 1)
    got = list(loader)
    assert devices and all(d == torch.device("cuda", 1) for d in devices)
    assert_batches(want, got, "batches")  # the fake's "device" memory is host memory
    current[0] = 0
    assert loader.device == torch.device("cuda", 1)  # settled by the first epoch
    explicit = hotloop.DataLoader(ds, device="cuda:1")
    assert explicit.device == torch.device("cuda", 1)
    assert fake_device(hotloop.DataLoader(ds)).device.index == 0  # the tests' own seam still sets it


# two GPUs (NCCL) ----------------------------------------------------------------------------------
def _on_each_gpu(rank, world_size, seed, nw):
    """The loader is made while device 0 is current, then the rank sets its own (as a script that
    builds its data before torch.cuda.set_device(local_rank)): batches land on the rank's GPU, equal
    to torch's; the stats gather over NCCL."""
    ds = Draws(41, seed)
    runs = []
    for cls, device in ((TorchDataLoader, None), (hotloop.DataLoader, "cuda")):
        torch.cuda.set_device(0)
        seed_all(seed + rank)
        sampler = DistributedSampler(ds, shuffle=True, seed=seed)
        kwargs = {"device": device} if device else {}
        loader = make(cls, ds, sampler, nw, **kwargs)
        torch.cuda.set_device(rank)
        out = []
        for e in range(2):
            sampler.set_epoch(e)
            out.append(list(loader))
        runs.append(out)
    for e in range(2):
        theirs, ours = runs[0][e], runs[1][e]
        assert len(ours) == len(theirs) > 0
        for j, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            for k in range(len(b)):
                assert b[k].device == torch.device("cuda", rank), f"rank {rank}: batch {j}[{k}] on {b[k].device}"
            assert_same(list(a), [t.cpu() for t in b], f"rank {rank}, epoch {e}, batch {j}")
    gathered = loader.stats.gather()
    if rank == 0:
        assert gathered.ranks == [0, 1] and gathered[0] == loader.stats and gathered[1].batches > 0
        assert gathered.summary.startswith("hotloop.DataLoader on 2 ranks")
    else:
        assert gathered is None
    return loader.stats.h2d_bytes


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_rank_gets_its_batches_on_its_own_gpu(num_workers):
    seed = random.randrange(1 << 20)
    h2d = run_ranks(_on_each_gpu, 2, args=(seed, num_workers), backend="nccl")
    assert all(b > 0 for b in h2d)

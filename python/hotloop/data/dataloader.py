"""hotloop.DataLoader: torch's DataLoader, with workers that write batches into a shared pinned ring.

Swap `torch.utils.data.DataLoader` for `hotloop.DataLoader` and nothing changes in what the loop
receives: the same arguments and defaults, torch's own samplers (so the same batches in the same
order for the same generator), workers seeded as torch seeds them. What changes is how batches move:

* workers write each sample's leaves straight into a slot of a ring of shared memory (memfd, no
  /dev/shm file, nothing pickled for tensor data), the main process never unpickles batch data;
* with `device="cuda"` the ring is page-locked once (`cuMemHostRegister`) and each batch goes to the
  GPU with one `cuMemcpyHtoDAsync` per leaf on a side stream, `prefetch_batches` ahead; the consumer's
  stream waits on an event, and a slot is reused only once its copy finished; a thread queues those
  copies while the training step runs (_prefetch.py), so next() only hands a batch out;
* with num_workers=0 and a device, the main thread makes each batch as torch does but writes it
  straight into a small page-locked ring of its own, and the copies run on the side stream as
  above: the copy of one batch overlaps the making of the next;
* without a device (and without pin_memory) a batch's tensors are views of its slot, not copies: the
  slot goes back to the workers once the last tensor, view or numpy array made from them is gone
  (a consumer that keeps many batches gets copies past a few, so the workers never starve);
* `gpu_transform=hotloop.Normalize(mean, std)` turns uint8 or float, NHWC or NCHW image batches
  into normalised float16/bfloat16/float32 NCHW or channels_last on the copy stream (uint8 in one
  kernel).

Extras: `stats` (batches, samples, seconds waited in `__next__`, stall fraction, host-to-device bytes
and seconds, worker busy seconds, ring bytes; `stats.gather()` brings every rank's to rank 0 under
torch.distributed), `state_dict()`/`load_state_dict()` for mid-epoch
resume (the same batches from then on, random transforms in workers included), and a worker that
dies is replaced and its batches redone (`max_worker_restarts`), for an IterableDataset too.
"""
import collections
import contextlib
import functools
import itertools
import os
import threading
import time
import typing
import warnings
import weakref

import torch
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.dataloader import (_BaseDataLoaderIter, _DatasetKind, _sharding_worker_init_fn,
                                         _SingleProcessDataLoaderIter)
from torch.utils.data.datapipes.datapipe import IterDataPipe, MapDataPipe

from .. import _C, input_wait
from .._arguments import expect_count, expect_int
from ._batch import (FastPathDeclined, SlotWriter, first_dim, flatten, leaf_bytes, unflatten, write_fast,
                     write_general)
from ._config import CopySettings, PoolSettings
from ._device import LocalRing, Pending
from ._messages import Ended, Failed, WholeBatch
from ._pool import POLL_S, Pool, Task
from ._prefetch import Prefetcher
from ._resume import (EpochLog, Plan, check_loadable, dataset_state, load_dataset_state, load_sampler_state,
                      sampler_state)
from ._worker import WorkerSpec
from .normalize import Normalize
from .stage import gpu_decode_stage
from .stats import LoaderStats

__all__ = ["DataLoader", "LoaderStats"]

_T_co = typing.TypeVar("_T_co", covariant=True)  # what a batch is, as in torch's Generic DataLoader

PREFETCH_THREAD = True  # with a device, queue the next copies in a thread (tests turn it off to cover both ways)
PACED_TOP_UPS = True  # gpu_decode's top-ups start later in the consumer's step (_prefetch.TopUpPace)


def _forked_copy(obj) -> bool:
    """True in a process forked from the one that made `obj` (another loader's worker, a multiprocessing
    child) when its copy of obj is collected there: that copy owns none of obj's threads, workers or
    CUDA state, and its locks may stay held by a thread that the fork did not copy (the prefetch
    thread's), so a finaliser that took one would wait forever."""
    return getattr(obj, "_hl_pid", None) not in (None, os.getpid())


def _cuda_device(device):
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"DataLoader: expected device=None, 'cpu' or a CUDA device, got {device}")
    reason = _C.cuda_unavailable_reason()
    if reason is not None or not torch.cuda.is_available():
        raise RuntimeError(f"DataLoader: device={device} needs CUDA: {reason or 'torch cannot see a CUDA device'}")
    return device  # "cuda" without an index: the current device, settled by the first epoch (DataLoader.device)


def _expected_device(device):
    """The device the first epoch will run on, where that is known now: an index given, or "cuda"
    with CUDA already set up in this process (the current device, unless the script changes it
    before iter(): then gpu_decode's early decoder is closed and one opened on the right device).
    None otherwise: reading the current device would set CUDA up, which a loader made before
    torch.cuda.set_device(local_rank) must not do on device 0."""
    if device is None:
        return None
    if device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else None


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """torch.utils.data.DataLoader with the same arguments, defaults, attributes and batches, fed by
    a shared ring. Extra keyword arguments:

    device: a CUDA device: batches arrive there as tensors usable on the current stream. "cuda"
        without an index is the current device when the first epoch starts (each rank's own under
        torch.distributed, once it called torch.cuda.set_device), as .to("cuda") would pick.
    prefetch_batches: batches copied to the device ahead of the one being consumed (default 2); with
        num_workers=0, batches made and queued ahead of the one returned (0: one at a time).
    gpu_transform: e.g. hotloop.Normalize(mean, std): applied to the batch's image leaves on the way
        (on the CPU too when device is None): every uint8 or float leaf of 4 dimensions or more is one
        (see hotloop.Normalize for what it takes); a batch with none, or with one it cannot take,
        raises ValueError. Not with gpu_decode, whose kernel normalises.
    max_worker_restarts: dead workers replaced (their batches redone) before a RuntimeError.
    gpu_decode: True, a backend name or a hotloop.GpuDecode: for a torchvision ImageFolder /
        DatasetFolder (default loader) or a hotloop.EncodedImageDataset whose transform is made of
        RandomResizedCrop, Resize, CenterCrop, RandomHorizontalFlip, ToTensor / PILToTensor /
        ToImage + ToDtype and Normalize (v1 or v2), workers only read the files and draw the random
        crops and flips (the transform's own draws: the same as the CPU pipeline's for the same
        seed); JPEGs are decoded by the GPU's hardware decoders (nvjpeg) and one kernel crops,
        resizes, flips and normalises the batch. Anything else warns and runs as torch would; see
        hotloop.GpuDecode for backends, dtype and layout, and loader.stats.decoder for what ran.
        The decoder (~0.65 s to open) starts opening in the background when the loader is made, if
        its device is known by then (an index, or CUDA already in use); else at the first iter().

    Like torch's, these arguments are attributes under their own names, holding what was given (a
    GpuDecode for gpu_decode=True; loader.device answers with the device resolved), so a tool that
    makes the loader again from its attributes (Lightning injecting a DistributedSampler) keeps them.

    A replacement starts from its predecessor's RNG states after the last batch the main process
    has from it (map-style), so redone batches equal those it would have made. An IterableDataset
    worker has a position besides: its replacement gets the same worker id, seed and worker_info,
    makes the iterator anew and replays it, dropping the batches its predecessor had delivered. So
    every sample arrives exactly once, and state_dict() resumes an IterableDataset exactly, provided
    its iteration in a worker is a function of the worker's seed and get_worker_info() (no other
    randomness, no state kept outside the worker); a replay that ends early raises a RuntimeError
    that says so. A dataset (or its iterator) with state_dict()/load_state_dict() (torchdata's
    Stateful protocol, which streaming datasets implement) is not replayed: its state after the
    worker's last batch handed out is loaded instead.
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None, num_workers=0,
                 collate_fn=None, pin_memory=False, drop_last=False, timeout=0, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, *, prefetch_factor=None, persistent_workers=False,
                 pin_memory_device="", in_order=True, device=None, prefetch_batches=2, gpu_transform=None,
                 max_worker_restarts=3, gpu_decode=None):
        # torch checks num_workers < 0 (in its words, below); a float passed it and failed at iter() in range()
        expect_int("DataLoader", "num_workers", num_workers)
        expect_count("DataLoader", "prefetch_batches", prefetch_batches)
        if gpu_transform is not None and not isinstance(gpu_transform, Normalize):
            raise TypeError(f"DataLoader: expected gpu_transform=None or a hotloop.Normalize, got "
                            f"{type(gpu_transform).__name__}")
        expect_count("DataLoader", "max_worker_restarts", max_worker_restarts)
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory,
                         drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        self._hl_device = _cuda_device(device)
        # the argument in vars(loader) (see the class docstring); the `device` property, a data
        # descriptor, still answers loader.device with the device resolved
        self.__dict__["device"] = device
        self.prefetch_batches = prefetch_batches
        self.gpu_transform = gpu_transform
        self.max_worker_restarts = max_worker_restarts
        self._hl_stats = LoaderStats()
        self._hl_pid = os.getpid()  # a forked copy's finaliser leaves it alone (_forked_copy)
        self._hl_pool = None  # persistent workers keep theirs here
        self._hl_local_ring = None  # num_workers=0 with a device: the ring batches go through
        self._hl_resume = None  # a loaded state, applied by the next iterator
        self._hl_epoch = None  # the current epoch's (generator state, base seed)
        self._hl_epoch_done = False  # its last batch was handed out
        self._hl_yielded = 0  # batches handed out in it
        self._hl_iter = None  # weak reference to the live iterator
        self._hl_plan = None  # the loaded state, as the next multi-worker iterator applies it
        self._hl_log = None  # the current epoch's EpochLog (num_workers > 0)
        # num_workers=0: the Stateful sampler's and dataset's states after the last batch handed out
        self._hl_single = {"sampler_state": None, "dataset_state": None}
        kind = "map" if self._dataset_kind == _DatasetKind.Map and self._auto_collation else "other"
        # self.gpu_decode: the argument resolved, for a loader made again from vars()
        self.gpu_decode, images = gpu_decode_stage(gpu_decode, dataset, collate_fn, self.batch_size, kind,
                                                   self._hl_device, self._hl_stats)
        if images is not None and gpu_transform is not None:  # its images never reach the transform
            raise ValueError("DataLoader: gpu_transform does not apply to gpu_decode's images, which its kernel "
                             "normalises already: put the Normalize in the dataset's transform (v1 or v2) instead")
        self._hl_images = images
        expected = _expected_device(self._hl_device) if self.batch_stage is not None else None
        if expected is not None:
            self.batch_stage.expect_device(expected)
        self._hl_sampler_epoch = None  # the epoch sampler's epoch (DistributedSampler.set_epoch) in the current epoch
        self._hl_epoch_at_load = None  # the epoch sampler's epoch when a state was loaded (_resume_sampler_epoch)

    @property
    def device(self):
        """Where batches go: None (they stay on the CPU) or a torch.device("cuda", index). device="cuda"
        without an index means the current CUDA device (torch.cuda.current_device()), as .to("cuda")
        does, read when the first epoch starts (iter()) and kept from then on, as the ring is
        page-locked and the copy stream made for it: under torch.distributed, each rank's own
        device once it called torch.cuda.set_device(local_rank), whether before or after making
        the loader."""
        device = self._hl_device
        if device is not None and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    @device.setter
    def device(self, device):
        self._hl_device = self.__dict__["device"] = device

    @property
    def _is_accelerate_prepared(self):
        """Accelerate's first question to a loader in accelerator.prepare(): False, as for any loader it
        has not prepared, with a warning, since what it does next is build a torch DataLoader from the
        16 arguments torch knows and hand that back in place of this one: the ring, the workers, stats,
        state_dict, device=, gpu_decode and gpu_transform would be gone in silence (batches as the
        dataset makes them: uint8 images where gpu_transform gave normalised floats).
        hotloop.integrations.accelerate.prepare_data_loader keeps this loader, sharded as Accelerate
        shards it."""
        warnings.warn("accelerator.prepare() replaces a hotloop.DataLoader with a torch DataLoader made from torch's "
                      "arguments alone: hotloop's ring, workers, stats, state_dict, device=, gpu_decode and "
                      "gpu_transform are dropped. Keep it with `loader = hotloop.integrations.accelerate."
                      "prepare_data_loader(accelerator, loader)` before accelerator.prepare(...)", stacklevel=2)
        return False

    @property
    def image_stage(self):
        """gpu_decode's image path for this loader (image.ImageStage: the decoder and the work
        per batch), or None when gpu_decode is off or declined the dataset; what ran is in stats."""
        return self._hl_images

    @property
    def batch_stage(self):
        """What the batches go through beyond the ring's copies (a stage.BatchStage, whose hooks are
        all the loader's machinery calls of it): gpu_decode's image stage, else gpu_transform, else None."""
        return self._hl_images if self._hl_images is not None else self.gpu_transform

    @property
    def stats(self) -> LoaderStats:
        """What this loader did (LoaderStats); `stats.gather()` brings every rank's to rank 0."""
        return self._hl_stats

    def _get_iterator(self):
        if self.num_workers == 0:
            it = _SingleIter(self)
        else:
            self.check_worker_number_rationality()
            it = _MultiIter(self)
        self._hl_iter = weakref.ref(it)
        return it

    def __iter__(self):
        if self._hl_device is not None and self._hl_device.index is None:
            self._hl_device = self.device  # "cuda": the current device from now on
            if self.batch_stage is not None:
                self.batch_stage.use_device(self._hl_device)
        resume = self._hl_resume
        if resume is not None and not resume.get("epoch_done") and resume.get("sampler_epoch") is not None:
            _resume_sampler_epoch(self, resume["sampler_epoch"], self._hl_epoch_at_load)
        if resume is not None and resume.get("epoch_done") and \
                not resume.get("persistent", self.persistent_workers and self.num_workers):
            # the saved epoch had ended: the next one starts from the generator as it was then, and
            # draws its worker seed from it as the saved loader's next epoch did
            self._hl_resume = None
            self._generator().set_state(resume["generator_state"])
        if self.persistent_workers and self.num_workers > 0:
            # torch's __iter__, but the iterator kept by a weak reference where torch's keeps it in
            # self._iterator: it refers to this loader, and that cycle kept the workers alive after
            # the loader was gone, until the cycle collector ran. The pool is the loader's (_hl_pool):
            # an iterator made after the last one was dropped carries on with the same workers.
            it = self._hl_iter() if self._hl_iter is not None else None
            if isinstance(it, _MultiIter):
                it._reset(self)
                return it
            return self._get_iterator()
        it = super().__iter__()
        self._hl_iter = weakref.ref(it)
        return it

    def _generator(self):
        return self.generator if self.generator is not None else torch.default_generator

    def state_dict(self) -> dict:
        """Where the current epoch stands, as a plain dict (ints, bools, bytes, lists and a tensor:
        torch.save stores it). Load it into a loader built the same way (dataset, sampler, batch
        size, collate_fn, worker_init_fn, num_workers) and every batch it yields from then on equals,
        element for element, what this loader would have yielded after the point where the state
        was taken, random transforms in the workers included; after a finished epoch, from the first
        batch of the next one.

        How: the loader's generator (torch's default one when generator=None) is rewound so that
        the sampler draws the same order, and the epoch's worker seed is kept. Each worker reports,
        with every batch, its global RNG states (torch's, `random`'s, numpy's) right after it; the
        state holds, per worker, those after the last batch handed out from it, and which worker the
        next batch comes from. A resumed epoch seeds its workers as usual, sets those states, and
        goes on round robin from there. An IterableDataset's position is not an RNG state: each
        worker instead gets the states it began the epoch with and replays (fetches and drops) the
        batches it had produced, which requires its iteration to be a function of its seed and
        get_worker_info(). With persistent_workers the RNG states carry over to the next epoch, and
        so they do in the state taken at an epoch's end.

        Stateful datasets and samplers (state_dict() and load_state_dict(), torchdata's protocol)
        are saved, not replayed: a worker sends its dataset's state_dict() (and its iterator's) with
        each batch, and the state holds, per worker, the one sent with the last batch handed out
        from it (not those of batches made ahead); with num_workers=0 the dataset's as it stood
        after the last batch handed out. A sampler's (or batch sampler's) state_dict() is taken as
        each index batch is drawn, and the state holds the one after the last batch handed out. A
        resumed epoch loads them (the dataset's, then makes its iterator, then the iterator's) and
        draws or fetches nothing to get there.

        in_order=False: the order of batches depends on timing, in the saved run as in the resumed
        one; what holds is that the resumed loader yields exactly the batches the saved one had not
        yet yielded, each equal to what the saved loader would have made of it.

        Not covered: RNGs other than those three global ones (a numpy Generator made in
        worker_init_fn, say), and batches remade by a restarted worker of an IterableDataset that is
        not a function of its seed. num_workers=0: transforms draw from the main process's RNGs, which
        are the caller's to save and restore (this loader does not touch them beyond the generator).
        Another num_workers: a state taken within an epoch (before its end) of a map-style dataset
        resumes at the same batch, without the RNG states (load_state_dict warns that worker-side
        random draws change); one of an IterableDataset taken after its first batch is refused
        (ValueError): each worker's position is in its share of the stream (get_worker_info()),
        which another number of workers splits otherwise. States taken at an epoch's end load into
        any num_workers.

        torch.distributed: each rank saves and loads its own state. A sampler with set_epoch (a
        DistributedSampler, whose order comes from its seed and epoch) has its epoch in the state
        (sampler_epoch); a state taken mid-epoch sets it back when the resumed epoch starts (a
        warning if set_epoch said otherwise), so each rank goes on with its own shard of that
        epoch. After a finished epoch, the next one's epoch is the caller's set_epoch as usual."""
        n = self.num_workers
        state = {"version": 3, "batches_yielded": 0, "generator_state": None, "base_seed": None, "epoch_done": False,
                 "persistent": bool(self.persistent_workers and n), "num_workers": n,
                 "iterable": self._dataset_kind == _DatasetKind.Iterable, "sampler_batches": 0, "yielded_after": [],
                 "yielded_after_rng": [], "next_worker": 0, "worker_rng": None, "worker_batches": None,
                 "worker_stopped": None, "worker_ahead": None, "sampler_epoch": self._hl_sampler_epoch,
                 "worker_data": None, "sampler_state": None, "dataset_state": None}
        if self._hl_epoch is None:
            return state
        it = self._hl_iter() if self._hl_iter is not None else None
        with getattr(it, "lock", None) or contextlib.nullcontext():  # the prefetch thread adds to the log
            return self._fill_state(state, n)

    def _fill_state(self, state, n):
        log = self._hl_log
        if self._hl_epoch_done:
            state.update(generator_state=self._generator().get_state(), epoch_done=True)
            if state["persistent"] and log is not None:  # the workers carry their states into the next epoch
                state.update(base_seed=self._hl_epoch[1], worker_rng=list(log.rng), worker_batches=[0] * n,
                             worker_stopped=[False] * n, worker_ahead=[[] for _ in range(n)])
            return state
        gen_state, base_seed = self._hl_epoch
        state.update(batches_yielded=self._hl_yielded, generator_state=gen_state.clone(), base_seed=base_seed,
                     sampler_batches=self._hl_yielded)
        if log is not None:
            state.update(log.snapshot())
        elif n == 0:
            state.update(self._hl_single)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` (of this version, or a version-2 one: no Stateful dataset or
        sampler states, or a version-1 one: same batches, random transforms in workers matching only
        from an epoch start) with the next iterator. A state taken mid-epoch with an IterableDataset
        and another num_workers raises a ValueError (its samples would repeat and go missing); a
        map-style one warns (see state_dict)."""
        if not isinstance(state, dict) or state.get("version") not in (1, 2, 3):
            raise ValueError(f"load_state_dict: expected a dict from DataLoader.state_dict(), got {state!r:.80}")
        needed = ["batches_yielded", "generator_state", "base_seed", "epoch_done"]
        if state["version"] >= 2:
            needed += ["num_workers", "iterable", "sampler_batches", "yielded_after", "yielded_after_rng",
                       "next_worker", "worker_rng", "worker_batches", "worker_stopped", "worker_ahead"]
        if state["version"] >= 3:
            needed += ["worker_data", "sampler_state", "dataset_state"]
        missing = [k for k in needed if k not in state]
        if missing:
            raise ValueError(f"load_state_dict: expected the keys {needed} of a version-{state['version']} "
                             f"state, {missing} are missing")
        check_loadable(state, self.num_workers, self._dataset_kind == _DatasetKind.Iterable)
        self._hl_resume = dict(state)
        sampler = _epoch_sampler(self)  # its epoch now: a set_epoch after this one is the caller's word
        self._hl_epoch_at_load = sampler.epoch if sampler is not None else None

    def _hl_begin_epoch(self, it):
        """Called by an iterator once its sampler iterator exists and before it draws from it: rewinds
        the generator for a resumed epoch, remembers where this epoch starts, returns batches to skip.
        A multi-worker iterator finds the rest of a loaded state in _hl_plan."""
        gen = self._generator()
        resume, self._hl_resume = self._hl_resume, None
        self._hl_plan = None
        self._hl_log = None
        self._hl_single = {"sampler_state": None, "dataset_state": None}
        it._hl_sampler_start = None  # a Stateful sampler's loaded state: its batches are not drawn again
        it._hl_dataset_start = None  # num_workers=0: a Stateful dataset's loaded state, likewise
        skip = 0
        if resume is not None and resume.get("generator_state") is not None:
            gen.set_state(resume["generator_state"])  # epoch_done with persistent workers: undo the seed draw
            if resume.get("base_seed") is not None:
                it._base_seed = resume["base_seed"]
            skip = int(resume["batches_yielded"])
            if resume.get("sampler_state") is not None:
                it._sampler_iter = load_sampler_state(it._index_sampler, resume["sampler_state"])
                it._hl_sampler_start = resume["sampler_state"]
            if resume.get("dataset_state") is not None and self.num_workers == 0:
                it._hl_dataset_start = resume["dataset_state"]
            if resume["version"] >= 2 and self.num_workers > 0:
                self._hl_plan = Plan.of(resume, self.num_workers, it._dataset_kind == _DatasetKind.Iterable)
        self._hl_single = {"sampler_state": it._hl_sampler_start, "dataset_state": it._hl_dataset_start}
        self._hl_epoch = (gen.get_state(), it._base_seed)
        sampler = _epoch_sampler(self)
        self._hl_sampler_epoch = sampler.epoch if sampler is not None else None
        self._hl_epoch_done = False
        self._hl_yielded = skip
        return skip

    def __del__(self):
        if _forked_copy(self):
            return
        pool = getattr(self, "_hl_pool", None)
        if pool is not None:
            pool.close()
        ring = getattr(self, "_hl_local_ring", None)
        if ring is not None:
            ring.close()


def _epoch_sampler(loader):
    """The sampler whose set_epoch(e) orders each epoch, DistributedSampler's way (its own, a batch
    sampler's, or the batch sampler itself), or None."""
    batch_sampler = loader.batch_sampler
    for sampler in (batch_sampler, getattr(batch_sampler, "sampler", None), loader.sampler):
        epoch = getattr(sampler, "epoch", None)
        if callable(getattr(sampler, "set_epoch", None)) and isinstance(epoch, int) and not isinstance(epoch, bool):
            return sampler
    return None


def _resume_sampler_epoch(loader, epoch, epoch_at_load):
    """A state taken mid-epoch resumes that epoch's order: its sampler is set back to the epoch it
    had (a DistributedSampler draws its permutation from seed + epoch), whatever set_epoch said since.
    The warning is for a set_epoch(other) called after load_state_dict: a sampler still at the epoch
    it had then was told nothing since (Lightning loads the state into a fresh sampler, at epoch 0,
    and calls iter() before its set_epoch(the saved epoch)), so the state's epoch is taken silently."""
    sampler = _epoch_sampler(loader)
    if sampler is None:
        warnings.warn(f"DataLoader: the state was taken with a sampler at epoch {epoch} (set_epoch), this "
                      "loader's sampler has no set_epoch: the resumed epoch may draw another order", stacklevel=3)
        return
    if sampler.epoch != epoch:
        if sampler.epoch != epoch_at_load:
            warnings.warn(f"DataLoader: the state was taken in the sampler's epoch {epoch}, the sampler is at epoch "
                          f"{sampler.epoch}: the resumed epoch runs as epoch {epoch} (set_epoch({epoch}))", stacklevel=3)
        sampler.set_epoch(epoch)


def _record(loader, t0, samples):
    dt = time.perf_counter() - t0
    loader._hl_yielded += 1
    st = loader._hl_stats
    st.wait_seconds += dt
    st.batches += 1
    st.samples += samples
    input_wait.add(dt, samples)


def _count_elapsed(it, loader, t0):
    """Epoch wall time as the consumer sees it: from entering the first __next__ to the last return."""
    now = time.perf_counter()
    last = getattr(it, "_last_return", None)
    loader._hl_stats.elapsed_seconds += now - (t0 if last is None else last)
    it._last_return = now


def _pool_settings(loader):
    """What a worker pool is given of the loader (its settings as they stand at the pool's start)."""
    return PoolSettings(mp_context=loader.multiprocessing_context or torch.multiprocessing,
                        num_workers=loader.num_workers, device=loader.device, stage=loader.batch_stage,
                        batch_size=loader.batch_size, prefetch_factor=loader.prefetch_factor,
                        prefetch_batches=loader.prefetch_batches, max_worker_restarts=loader.max_worker_restarts)


def _batch_samples(batch, default):
    tensors = []
    flatten(batch, tensors)
    for t in tensors:
        if t.dim() > 0:
            return int(t.shape[0])
    return default


def _host_batch_out(device, stage, batch, pin):
    """A batch that came whole (num_workers=0, or through a worker's pipe): to the device and/or
    through the stage (the loader's batch_stage), as the ring path would deliver it."""
    if stage is not None:
        batch = stage.whole_batch(batch, device)  # gpu_decode's packed batch, decoded
    if device is None and stage is None:
        return _pinned(batch) if pin else batch
    tensors = []
    spec = flatten(batch, tensors)
    # which leaves the stage transforms (gpu_transform's images): ValueError for one it cannot take, or for none
    images = stage.leaf_outputs((t.dtype, t.shape) for t in tensors) if stage is not None else [False] * len(tensors)
    if device is None and not any(images):
        return _pinned(batch) if pin else batch
    outs = []
    for t, image in zip(tensors, images):
        if device is not None:
            t = t.to(device)
        if image:
            t = stage.transform(t)
        elif pin and device is None:
            t = t.pin_memory()
        outs.append(t)
    return unflatten(spec, outs)


def _pinned(batch):
    from torch.utils.data._utils.pin_memory import pin_memory

    return pin_memory(batch)


def _swap_in_worker_side(it, loader) -> bool:
    """What the iterator's workers (or its own thread) index and how they collate it, as the loader's
    stage has them (gpu_decode: the image path's samples, packed batches). False when that is the
    dataset and collate_fn as given."""
    stage = loader.batch_stage
    if stage is None:
        return False
    dataset, collate_fn = stage.worker_side(it._dataset, it._collate_fn)
    if dataset is it._dataset and collate_fn is it._collate_fn:
        return False
    it._dataset, it._collate_fn = dataset, collate_fn
    return True


class _SingleIter(_SingleProcessDataLoaderIter):
    """num_workers=0: torch's own single-process iterator, plus device, transform, stats and resume.

    With a device, batches are made in the main thread as torch makes them (the dataset need not be
    thread-safe), but written straight into a slot of a small page-locked ring (LocalRing) and copied
    to the device asynchronously on a side stream: the copy of batch k overlaps the making of batch
    k+1. `prefetch_batches` batches are made and queued ahead of the one returned."""

    def __init__(self, loader):
        self._hl_pid = os.getpid()
        super().__init__(loader)
        if _swap_in_worker_side(self, loader):
            self._dataset_fetcher = _DatasetKind.create_fetcher(self._dataset_kind, self._dataset, self._auto_collation,
                                                                self._collate_fn, self._drop_last)
        self._loader = loader
        self._last_return = None
        self._prepared = collections.deque()  # (Pending or batch or _Raise, samples), oldest first
        self._exhausted = False
        self._fast = (self._dataset_kind == _DatasetKind.Map and self._auto_collation
                      and self._collate_fn is default_collate and not getattr(self._dataset, "__getitems__", None))
        skip = loader._hl_begin_epoch(self)
        self._skip(skip)
        # the Stateful sampler and dataset (if any) whose states go with each batch, for state_dict()
        self._stateful = (sampler_state(self._index_sampler, self._sampler_iter) is not None
                          or dataset_state(self._dataset, self._dataset_fetcher) is not None)

    def _skip(self, n):
        if self._hl_dataset_start is not None:  # a Stateful dataset: set where it stood, not walked
            self._dataset_fetcher = load_dataset_state(self._dataset, self._hl_dataset_start, functools.partial(
                _DatasetKind.create_fetcher, self._dataset_kind, self._dataset, self._auto_collation,
                self._collate_fn, self._drop_last))
        for _ in range(n):
            if self._dataset_kind == _DatasetKind.Map:
                if self._hl_sampler_start is None:  # a Stateful sampler resumed where it stood
                    next(self._sampler_iter)
            elif self._hl_dataset_start is None:
                super()._next_data()  # an iterable's position is only known by walking it
            self._num_yielded += 1

    def _states_now(self):
        """The Stateful sampler's and dataset's states as they stand (after the batches made so far)."""
        if not self._stateful:
            return None
        return {"sampler_state": sampler_state(self._index_sampler, self._sampler_iter),
                "dataset_state": dataset_state(self._dataset, self._dataset_fetcher)}

    def _handed(self, states):
        if states is not None:
            self._loader._hl_single = states

    def _next_data(self):
        t0 = time.perf_counter()
        loader = self._loader
        if loader.device is None:
            try:
                batch = super()._next_data()  # torch pins it there when pin_memory
            except StopIteration:
                loader._hl_epoch_done = True
                raise
            finally:
                self._handed(self._states_now())  # a batch that raised was handed out too
            batch = _host_batch_out(loader.device, loader.batch_stage, batch, False)
            _record(loader, t0, _batch_samples(batch, 1))
        else:
            try:
                if not self._prepared:
                    if self._exhausted:
                        raise StopIteration
                    self._prepared.append(self._produce_noted())
            except StopIteration:
                self._exhausted = True
                loader._hl_epoch_done = True
                raise
            batch, samples, states = self._prepared.popleft()
            self._handed(states)
            if isinstance(batch, _Raise):
                raise batch.exc
            if isinstance(batch, Pending):
                ring = loader._hl_local_ring
                batch = ring.deliver(batch)
            # the next batches are made while the copy of this one runs
            while not self._exhausted and len(self._prepared) < loader.prefetch_batches:
                try:
                    self._prepared.append(self._produce_noted())
                except StopIteration:
                    self._exhausted = True
                except Exception as exc:  # raised when its batch's turn comes, as torch would
                    self._prepared.append((_Raise(exc), 0, self._states_now()))
                    break
            _record(loader, t0, samples)
        _count_elapsed(self, loader, t0)
        return batch

    def _produce_noted(self):
        """_produce's batch and samples, and the states after it: made ahead, they count once handed out."""
        batch, samples = self._produce()
        return batch, samples, self._states_now()

    def _produce(self):
        """The next batch: made as torch makes it, written into a slot of the local ring and its copy
        to the device queued (a Pending), or, when it does not fit the ring, sent to the device as
        the plain path does. Returns (batch, samples)."""
        loader = self._loader
        index = self._next_index()
        ring = loader._hl_local_ring
        if ring is not None and ring.ring is None:
            ring = loader._hl_local_ring = None  # closed (interpreter exit)
        if self._fast:
            samples = [self._dataset[i] for i in index]
            if ring is not None:
                slot = ring.take_slot()
                if slot is not None:
                    writer = SlotWriter(ring.slot(slot), ring.layout)
                    try:
                        spec = write_fast(samples, writer)
                    except FastPathDeclined:
                        ring.release_slot(slot)
                    except BaseException:
                        ring.release_slot(slot)
                        raise
                    else:
                        return ring.copies.copy_to_device(ring.ring, slot, spec, writer.leaves), len(index)
            batch = self._collate_fn(samples)
        else:
            batch = self._dataset_fetcher.fetch(index)
        tensors = []
        flatten(batch, tensors)
        if not self._auto_collation:
            n = 1
        else:  # an iterable's last batch may be short
            n = len(index) if self._dataset_kind == _DatasetKind.Map else _batch_samples(batch, 1)
        if tensors and ring is None:
            ring = loader._hl_local_ring = LocalRing(CopySettings(loader.device, loader.batch_stage), loader.stats,
                                                     loader.prefetch_batches, [leaf_bytes(t) for t in tensors])
        if tensors and ring.fits(tensors):
            slot = ring.take_slot()
            if slot is not None:
                writer = SlotWriter(ring.slot(slot), ring.layout)
                spec = write_general(batch, writer)  # every tensor fits: none stays in the spec
                return ring.copies.copy_to_device(ring.ring, slot, spec, writer.leaves), n
        return _host_batch_out(loader.device, loader.batch_stage, batch, False), n

    def __del__(self):
        if _forked_copy(self):
            return
        # copies queued for batches never handed out: their slots are freed once those end
        ring = getattr(self._loader, "_hl_local_ring", None) if hasattr(self, "_loader") else None
        for batch, _, _ in getattr(self, "_prepared", ()):
            if isinstance(batch, Pending) and ring is not None and ring.ring is not None:
                ring.copies.abandon(batch)
        self._prepared = collections.deque()


class _Raise:
    """An exception of a batch made ahead, raised when that batch is due."""

    def __init__(self, exc):
        self.exc = exc


class _MultiIter(_BaseDataLoaderIter):
    """num_workers > 0: torch's iterator (its samplers, seeds and attributes), whose epochs a _Feed
    runs: tasks go round robin to the workers as torch sends them, results come back through the
    ring (the first batch of each worker too: it gets its slot when the ring is made), or through the
    worker's pipe when there is no ring (batches without tensors) or the outcome of a first batch came
    before its worker sent a layout (an error or a stop at its first sample).

    The feed is apart so that the prefetch thread holds the feed, never this object: the consumer's
    last reference to the iterator is then always the one that drops it, and its workers are shut
    down in the consumer's thread before `del it` returns. (When the thread held the iterator for a
    top-up at that moment, the shutdown ran later, in the thread.)"""

    def __init__(self, loader):
        self._hl_pid = os.getpid()
        if loader.prefetch_factor <= 0:  # torch's check, in torch's words (its DataLoader accepts the argument)
            raise AssertionError("prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter")
        pool = loader._hl_pool if loader.persistent_workers else None
        carry_on = pool is not None and not pool.closed
        if carry_on:
            # the loader's persistent workers outlived the iterator that started them: this one
            # stands in for torch's reset of that iterator, which draws no new worker seed
            generator_state = loader._generator().get_state()
        super().__init__(loader)
        _swap_in_worker_side(self, loader)
        # torch starts its workers here, before _reset draws another: a DataPipe's first epoch is seeded with this one
        self._first_shared_seed = self._shared_seed
        if carry_on:
            loader._generator().set_state(generator_state)
            self._base_seed = pool.spec.base_seed
        self._loader = loader
        self._prefetch_factor = loader.prefetch_factor
        self._feed = None
        self._prefetcher = None  # the thread that tops the feed up with a device (_prefetch.py)
        self._reset(loader, first_iter=True)

    @property
    def lock(self):
        """The current epoch's lock (state_dict takes it: the prefetch thread adds to the epoch's log)."""
        return self._feed.lock

    @property
    def _pool(self):
        return self._feed.pool if self._feed is not None else None

    def _reset(self, loader, first_iter=False):
        old = self._feed
        if old is not None:
            self._stop_prefetcher()
        super()._reset(loader, first_iter)
        skip = loader._hl_begin_epoch(self)
        plan = loader._hl_plan
        pool = loader._hl_pool if self._persistent_workers else None
        if pool is not None and not pool.closed and plan is not None and plan.setups is not None:
            # saved RNG states and replays start from freshly seeded workers: these are not
            if old is not None:
                old.abandon_prepared()
            pool.close()
        if pool is None or pool.closed:
            init_fn = loader.worker_init_fn
            if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):  # as torch: shard a DataPipe per worker
                init_fn = functools.partial(_sharding_worker_init_fn, init_fn, self._world_size, self._rank)
            spec = WorkerSpec(self._num_workers, self._dataset_kind, self._dataset, self._auto_collation,
                              self._collate_fn, self._drop_last, self._base_seed, init_fn,
                              self._first_shared_seed if first_iter else self._shared_seed)
            pool = Pool(_pool_settings(loader), loader.stats, spec)
            if self._persistent_workers:
                loader._hl_pool = pool
        elif not first_iter or old is None:
            pool.resume(self._shared_seed)
        if old is not None:
            old.abandon_prepared()  # copies of an abandoned epoch: their slots are freed later
        self._num_yielded = skip
        self._last_return = None
        stage = loader.batch_stage
        feed = _Feed(self, pool, plan, skip, loader.stats, in_order=loader.in_order,
                     prefetch_batches=loader.prefetch_batches, stage=stage)
        loader._hl_log = feed.log  # the epoch's log, which state_dict reads
        feed.fill()
        self._feed = feed
        pool.start_all()  # workers that got no task yet: torch starts every worker at iter() too
        self._workers = pool.workers()  # torch's name, which tools read
        if pool.device is not None and loader.prefetch_batches > 0 and PREFETCH_THREAD:
            self._prefetcher = Prefetcher(feed, paced=PACED_TOP_UPS and stage is not None and stage.paced_top_ups)

    def _stop_prefetcher(self):
        """No more top-ups by the thread (waited for unless this thread holds the feed's lock)."""
        prefetcher, self._prefetcher = getattr(self, "_prefetcher", None), None
        if prefetcher is not None:
            prefetcher.close()

    def _next_data(self):
        t0 = time.perf_counter()
        feed = self._feed
        with feed.lock:
            try:
                out, samples = feed.take_next()
            except StopIteration:
                if feed.epoch_done:
                    self._loader._hl_epoch_done = True
                if feed.exhausted:  # the epoch's end, found now: the workers go (unless persistent)
                    self._stop_prefetcher()
                    if not self._persistent_workers:
                        feed.shutdown()
                raise
            finally:
                if feed.top_up_due:  # a device batch went out (or raised): the next batches' copies
                    feed.top_up_due = False
                    if self._prefetcher is not None:
                        self._prefetcher.kick(t0)  # queued while the step runs
                    else:
                        feed.top_up()
        _record(self._loader, t0, samples)
        _count_elapsed(self, self._loader, t0)
        return out

    def _shutdown(self):
        feed = getattr(self, "_feed", None)
        if feed is not None:
            self._stop_prefetcher()
            feed.shutdown()

    def __del__(self):
        feed = getattr(self, "_feed", None)
        if feed is None or _forked_copy(self):
            return
        self._stop_prefetcher()  # waits for a top-up in progress: this thread does not hold the lock
        if not self._persistent_workers:
            feed.shutdown()
        else:
            feed.abandon_prepared()  # the loader's workers live on: free these copies' slots


class _Feed:
    """One epoch of a _MultiIter: its tasks, the batches prepared ahead and the pool they come from.
    It refers to the iterator's sampler iterator and settings, never to the iterator itself; next()
    and the prefetch thread both drive it, one at a time, under `lock` (reentrant: next() may shut
    the epoch down while holding it)."""

    def __init__(self, it, pool, plan, skip, stats, *, in_order, prefetch_batches, stage):
        """it: the iterator whose sampler iterator and settings the epoch uses (not kept); stats: the
        loader's LoaderStats; stage: its stage.BatchStage (or None) for batches that come whole."""
        self.lock = threading.RLock()
        self.pool = pool
        self._stats = stats
        self._prefetch_batches = prefetch_batches
        self._stage = stage
        self.epoch_done = False  # the last batch was handed out (or the epoch was shut down)
        self.exhausted = False  # take_next found the epoch's end: its caller ends the epoch
        self.top_up_due = False  # a device batch went out: its caller tops up (or kicks the thread that does)
        self._sampler_iter = it._sampler_iter
        # a Stateful sampler: its state after each index batch drawn goes into the epoch's log
        self._sampler_stateful = sampler_state(it._index_sampler, it._sampler_iter) is not None
        self._index_sampler = it._index_sampler
        self._dataset_kind = it._dataset_kind
        self._auto_collation = it._auto_collation
        self._num_workers = it._num_workers
        self._prefetch_factor = it._prefetch_factor
        self._persistent_workers = it._persistent_workers
        self._in_order = in_order
        self._timeout = it._timeout
        self._pin_memory = it._pin_memory
        self._handed = skip  # batches of the epoch handed out (torch's _num_yielded), for messages
        self._order = []  # tasks of this epoch in the order torch would return them
        self._rcvd_idx = 0
        self._outstanding = 0
        n = self._num_workers
        self._workers_status = [True] * n if plan is None else [not s for s in plan.stopped]
        self._stop_ids = [-1 if not active else 1 << 62 for active in self._workers_status]
        self._worker_cycle = itertools.cycle(range(n))
        for _ in range(plan.next_worker if plan is not None else 0):
            next(self._worker_cycle)
        self._prepared = collections.deque()
        self._skip_batches = 0
        self._indices_done = False  # the sampler is exhausted: every index batch of the epoch went out
        self._skip_positions = {}  # position -> None or the RNG states after it (in_order=False)
        self._ahead = [list(a) for a in plan.ahead] if plan is not None else [[] for _ in range(n)]
        self._fetches = [0] * n  # an IterableDataset's batches per worker in this resumed epoch
        pool.begin_epoch(plan.setups if plan is not None else None)
        iterable = self._dataset_kind == _DatasetKind.Iterable
        pos0 = 0
        if not iterable:
            pos0 = plan.positions if plan is not None else skip
            for _ in range(pos0 if it._hl_sampler_start is None else 0):  # a Stateful sampler resumed where it stood
                next(self._sampler_iter)
            if plan is not None:
                self._skip_positions = dict(zip(plan.yielded_after, plan.yielded_after_rng))
        elif plan is None or plan.setups is None:
            self._skip_batches = skip  # no worker positions: walk the iterable through the workers
        self._next_pos = pos0
        self.log = self._log = EpochLog(n, iterable, self._order, pos0, plan.next_worker if plan is not None else 0,
                                        pool.track, it._hl_sampler_start)

    def fill(self):
        """Hand out tasks up to prefetch_factor per worker (the epoch's first ones, at its start)."""
        self._fill()

    def ahead(self) -> int:
        """Batches prepared for the consumer's next next() calls (read without the lock: a length)."""
        return len(self._prepared)

    def abandon_prepared(self):
        """Copies queued for batches never handed out: their slots are freed once those end."""
        pool = self.pool
        if pool is not None and not pool.closed:
            for old in self._prepared:
                if isinstance(old[0], Pending):
                    pool.abandon(old[0])
        self._prepared = collections.deque()

    def shutdown(self):
        """The epoch's end without persistent workers, or the iterator's: the workers go (its caller
        stopped the prefetch thread first)."""
        self.abandon_prepared()  # their copies must end before the ring is unregistered
        pool, self.pool = self.pool, None
        if pool is not None and not self._persistent_workers:
            pool.close()

    def _fill(self):
        while self._try_put_index():
            pass

    def _try_put_index(self):
        pool = self.pool
        ring_known = pool.ring is not None or pool.ring_unused
        max_tasks = self._prefetch_factor * self._num_workers if ring_known else self._num_workers
        if self._outstanding >= max_tasks:
            return False
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            self._indices_done = True
            return False
        for _ in range(self._num_workers):  # the next active worker, round robin as torch does
            wid = next(self._worker_cycle)
            if self._workers_status[wid]:
                break
        else:
            return False
        pos = self._next_pos
        self._next_pos += 1
        if self._sampler_stateful:
            self._log.drew(self._next_pos - self._log.pos0, sampler_state(self._index_sampler, self._sampler_iter))
        if pos in self._skip_positions:  # a resumed epoch: handed out before the state was taken
            rng = self._skip_positions.pop(pos)
            if rng is None:  # its worker's saved states already cover it
                self._order.append(Task(-1, wid, None, -1, consumed=True, kind="batch", handed=True))
            else:
                ghost = pool.ghost(wid, index, rng)
                self._order.append(ghost)
                self._log.add(ghost)
            return True
        ahead = self._ahead[wid]
        while ahead and ahead[0] == self._fetches[wid]:  # a resumed IterableDataset: skip what was handed out
            ahead.pop(0)
            self._log.add(pool.ghost(wid, index, None))
            self._fetches[wid] += 1
        self._fetches[wid] += 1
        task = pool.new_task(wid, index)
        self._order.append(task)
        self._log.add(task)
        self._outstanding += 1
        return True

    def _next_task(self):
        """The next task to return (in order, or any finished one when in_order=False)."""
        while self._rcvd_idx < len(self._order):
            task = self._order[self._rcvd_idx]
            if task.consumed:
                self._rcvd_idx += 1
                continue
            if self._live(task) or self.pool.is_done(task):
                break
            self.pool.drop(task)
            self._log.settle(task)
            self._outstanding -= 1
            self._rcvd_idx += 1
        else:
            return None
        if not self._in_order:
            for task in self._order[self._rcvd_idx:]:
                if not task.consumed and self.pool.is_done(task):
                    return task
        return self._order[self._rcvd_idx]

    def _live(self, task):
        """Its worker may still deliver it: it is active, or the task came before its stop (with
        in_order=False a stop can be taken before an earlier batch of the same worker)."""
        return self._workers_status[task.wid] or task.id < self._stop_ids[task.wid]

    def _first_done(self, head):
        """in_order=False: sleep until any outstanding task is done and return it (the head once
        `timeout` passed: pool.wait then raises)."""
        pool = self.pool
        deadline = time.monotonic() + self._timeout if self._timeout and self._timeout > 0 else None
        while deadline is None or time.monotonic() < deadline:
            candidates = [t for t in self._order[self._rcvd_idx:] if not t.consumed and self._live(t)]
            for task in candidates:
                if pool.is_done(task):
                    return task
            pool.check_workers()
            if pool.layouts:
                pool.place_layouts()
            self._fill()
            waiting = [t for t in candidates if t.slot >= 0 and pool.ring.state(t.slot) == _C.RING_ASSIGNED]
            # a slot's change wakes it, a pipe message does not: candidates that take the pipe
            # (side path, layouts) are looked at again after 20 ms
            pool.doze(waiting[0].slot if waiting else -1, 0.02 if waiting else POLL_S)
        return head

    def _wait(self, task):
        """Block until the task is done; a dead worker is replaced meanwhile (or raises), more
        tasks are handed out as the ring allows (it may be made meanwhile), and every sleep is bounded."""
        pool, timeout, batch_number = self.pool, self._timeout, self._handed + len(self._prepared)
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        while True:
            outcome = pool.poll_or_tend(task)
            if outcome is not None:
                return outcome
            self._fill()
            pool.doze_for(task, deadline, timeout, batch_number)

    def _next_result(self, block=True, defer=False):
        """(the next batch, assembled (CPU) or with its copy queued (Pending, CUDA), its samples, its
        task). None when the next one is not ready and block is False. defer: gpu_decode's decode is
        left to the Pending's ImageLaunch (the prefetch thread runs it outside the lock)."""
        pool = self.pool
        while True:
            task = self._next_task()
            if task is None:
                if self._dataset_kind == _DatasetKind.Map and not self._indices_done:
                    # every task handed out, yet the sampler has more: a bug here, never a short epoch in silence
                    raise RuntimeError(f"hotloop.DataLoader: the epoch ran out of tasks after {self._next_pos} index "
                                       "batches while the sampler had more (a bug in hotloop: please report it)")
                raise StopIteration  # the caller shuts the workers down once nothing is left to hand out
            if not block and (not pool.is_done(task) or pool.copy_can_wait(task)):
                return None
            if not self._in_order and not pool.is_done(task):
                task = self._first_done(task)
            outcome = self._wait(task)
            pool.finish(task)
            pool.took(task, outcome)
            if isinstance(outcome, Ended):
                self._outstanding -= 1
                self._log.settle(task)
                self._workers_status[task.wid] = False
                self._stop_ids[task.wid] = task.id
                if task.slot >= 0:
                    pool.release_slot(task.slot)
                self._fill()
                continue
            if isinstance(outcome, Failed):
                if task.slot >= 0:
                    pool.release_slot(task.slot)
                self._fill()
                try:
                    outcome.error.reraise()
                except Exception as exc:  # raised when its batch is due (a device prefetch takes it early)
                    return _Raise(exc), 0, task
            self._stats.worker_busy_seconds += outcome.busy
            if isinstance(outcome, WholeBatch):
                batch = outcome.batch
                self._fill()
                samples = self._samples_of(task, lambda: _batch_samples(batch, 1))
                out = _host_batch_out(pool.device, self._stage, batch, self._pin_memory)
                return out, samples, task
            spec, leaves = outcome.spec, outcome.leaves  # a SlotBatch
            samples = self._samples_of(task, lambda: first_dim(spec, leaves, 1))
            if pool.device is None:
                out = pool.copy_out(task.slot, spec, leaves, self._pin_memory)
            else:
                out = pool.copy_to_device(task.slot, spec, leaves, defer)
            self._fill()
            return out, samples, task

    def _samples_of(self, task, from_batch):
        if not self._auto_collation:
            return 1
        if self._dataset_kind == _DatasetKind.Map:
            return len(task.index)
        return from_batch()  # an iterable's last batch may be short

    def take_next(self):
        """(the next batch, its samples), with the lock held. Its caller reads what happened besides:
        epoch_done, exhausted (the epoch's end found now: stop the prefetch thread, shut down) and
        top_up_due (a device batch went out, or raised: top up, or kick the thread that does)."""
        if self.pool is None:
            self.epoch_done = True
            raise StopIteration
        self.exhausted = False
        if self.pool.closed:
            raise RuntimeError("DataLoader: this epoch ended with an error in a worker (see above); start a new "
                               "one with iter(loader)")
        while self._skip_batches:
            self._skip_batches -= 1
            out, _, task = self._next_result()
            self._hand_out(out, task)
            if isinstance(out, Pending):
                self.pool.deliver(out)
        pool = self.pool
        try:
            if pool.device is None:
                out, samples, task = self._next_result()
            else:
                if not self._prepared:
                    self._prepared.append(self._next_result())
                head = self._prepared[0][0]
                if isinstance(head, Pending) and head.launch is not None:
                    # its decode, if the prefetch thread is queueing it, is waited for before the batch
                    # leaves _prepared: a Ctrl-C meanwhile loses nothing
                    head.launch.run()
                out, samples, task = self._prepared.popleft()
        except StopIteration:
            self.epoch_done = self.exhausted = True
            raise
        self._handed += 1
        if pool.device is None:
            self._hand_out(out, task)
            return out, samples
        self.top_up_due = True
        self._hand_out(out, task)
        if isinstance(out, Pending):
            out = pool.deliver(out)
        return out, samples

    def top_up(self, defer=False, limit=None):
        """With a device, lock held (the prefetch thread, or next() without it): take the batches
        after the one handed out from the workers and queue their copies, up to prefetch_batches
        (and at most `limit` of them), as far as they are done and their slots page-locked (it never
        waits: next() takes a batch that was not, and page-locks its slot if need be). True when
        it is worth looking again soon: the next batch is done but its slot not yet page-locked, or
        `limit` batches were prepared with room for more. An exception here is raised by next()
        at the turn of the batch it was preparing. defer: gpu_decode's decodes are left for the
        caller to run once it let go of the lock (waiting_launches)."""
        pool = self.pool
        if pool is None or pool.closed:
            return False
        room = self._prefetch_batches
        try:
            for _ in range(room if limit is None else limit):
                if len(self._prepared) >= room:
                    return False
                task = self._next_task()
                if task is None:
                    return False  # the epoch's end, or every task sent is prepared: the next come with hand-outs
                nxt = self._next_result(block=False, defer=defer)
                if nxt is None:
                    return pool.is_done(task)
                self._prepared.append(nxt)
            return len(self._prepared) < room
        except StopIteration:
            pass  # the epoch's last batches are prepared; they are handed out by the next calls
        except Exception as exc:
            self._prepared.append((_Raise(exc), 0, None))
        return False

    def waiting_launches(self):
        """With the lock held: the ImageLaunch of each prepared batch whose decode is not queued yet."""
        return [out.launch for out, _, _ in self._prepared
                if isinstance(out, Pending) and out.launch is not None and out.launch.waiting]

    def _hand_out(self, out, task):
        """The task's batch goes to the consumer now: log it (state_dict), or raise its error (task
        None: an error of the prefetch itself, no batch of its own)."""
        if task is not None:
            task.handed = True
            self._log.settle(task)
            # a batch counts among the prefetch_factor * workers until handed out, as torch counts it, and
            # its hand-out sends the next index (torch's _try_put_index): batches copied to the device
            # ahead do not let the sampler be read further, which a sampler read past its end would show
            # in the loader's generator (test_sampler_reads.py)
            self._outstanding -= 1
            self._fill()
        if isinstance(out, _Raise):
            raise out.exc

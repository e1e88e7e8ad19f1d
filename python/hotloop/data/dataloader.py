"""hotloop.DataLoader: torch's DataLoader, with workers that write batches into a shared pinned ring.

Swap `torch.utils.data.DataLoader` for `hotloop.DataLoader` and nothing changes in what the loop
receives: the same arguments and defaults, torch's own samplers (so the same batches in the same
order for the same generator), workers seeded as torch seeds them. What changes is how batches move:

* workers write each sample's leaves straight into a slot of a ring of shared memory (memfd, no
  /dev/shm file, nothing pickled for tensor data), the main process never unpickles batch data;
* with `device="cuda"` the ring is page-locked once (`cuMemHostRegister`) and each batch goes to the
  GPU with one `cuMemcpyHtoDAsync` per leaf on a side stream, `prefetch_batches` ahead; the consumer's
  stream waits on an event, and a slot is reused only once its copy finished; a thread queues those
  copies while the training step runs (prefetch/thread.py), so next() only hands a batch out;
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
import contextlib
import os
import typing
import warnings
import weakref

import torch

from .. import _C
from .._arguments import expect_count, expect_int
from .._torch_compat import DatasetKind
from .at_exit import forked_copy
from .consumer.iterators import LoaderEpochs, MultiProcessIter, SingleProcessIter, generator_of
from .consumer.resume import check_loadable, epoch_sampler, resume_sampler_epoch
from .image import make_maker
from .normalize import Normalize
from .stats import LoaderStats

__all__ = ["DataLoader", "LoaderStats"]

_T_co = typing.TypeVar("_T_co", covariant=True)  # what a batch is, as in torch's Generic DataLoader


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


# hotloop's own settings that persistent workers' pool and the num_workers=0 device ring take when the
# first epoch makes them (settings.py's frozen settings): set later, they could not reach them
_KEPT_BY_A_LIVE_POOL = frozenset({"device", "prefetch_batches", "gpu_transform", "max_worker_restarts"})


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
        The decoder, slow to open, starts opening in the background when the loader is made, if
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
        self._hl_pid = os.getpid()  # a forked copy's finaliser leaves it alone (at_exit.forked_copy)
        # the epochs' state, which the iterators keep up to date and state_dict() reads (LoaderEpochs);
        # each iterator is handed it when made
        self._epochs = LoaderEpochs()
        kind = "map" if self._dataset_kind == DatasetKind.Map and self._auto_collation else "other"
        # self.gpu_decode: the argument resolved, for a loader made again from vars()
        # image/'s maker is made here, the one place above the core that knows it (the core calls it
        # through BatchMaker's hooks alone)
        self.gpu_decode, images = make_maker(gpu_decode, dataset, collate_fn, self.batch_size, kind,
                                             self._hl_device, self._hl_stats)
        if images is not None and gpu_transform is not None:  # its images never reach the transform
            raise ValueError("DataLoader: gpu_transform does not apply to gpu_decode's images, which its kernel "
                             "normalises already: put the Normalize in the dataset's transform (v1 or v2) instead")
        self._hl_images = images
        expected = _expected_device(self._hl_device) if images is not None else None
        if expected is not None:
            images.expect_device(expected)

    def __setattr__(self, name, value):
        """torch's, which refuses its own structural attributes once the loader is made; hotloop's
        settings are refused once a live pool or device ring took them (ValueError), never ignored."""
        if name in _KEPT_BY_A_LIVE_POOL:
            epochs = self.__dict__.get("_epochs")
            if epochs is not None and (epochs.pool is not None or epochs.local_ring is not None):
                raise ValueError(f"DataLoader: {name} cannot be set once the first epoch has started the persistent "
                                 f"workers or the device ring, which took its value then; make a new DataLoader")
        super().__setattr__(name, value)

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
    def batch_maker(self):
        """gpu_decode's image path for this loader (image.ImageMaker, a batch_maker.BatchMaker: the
        decoder and the work per batch), or None when gpu_decode is off or declined the dataset;
        what ran is in stats."""
        return self._hl_images

    @property
    def _hl_pool(self):
        """The persistent workers' pool (None without them, or before the first epoch)."""
        return self._epochs.pool

    @property
    def _hl_local_ring(self):
        """num_workers=0 with a device: the ring batches go through (None before the first batch)."""
        return self._epochs.local_ring

    @property
    def stats(self) -> LoaderStats:
        """What this loader did (LoaderStats); `stats.gather()` brings every rank's to rank 0."""
        return self._hl_stats

    def _get_iterator(self):
        if self.num_workers == 0:
            it = SingleProcessIter(self, self._epochs)
        else:
            self.check_worker_number_rationality()
            it = MultiProcessIter(self, self._epochs)
        self._epochs.iter = weakref.ref(it)
        return it

    def __iter__(self):
        if self._hl_device is not None and self._hl_device.index is None:
            self._hl_device = self.device  # "cuda": the current device from now on
            if self._hl_images is not None:
                self._hl_images.use_device(self._hl_device)
        resume = self._epochs.resume
        if resume is not None and not resume.get("epoch_done") and resume.get("sampler_epoch") is not None:
            resume_sampler_epoch(epoch_sampler(self.batch_sampler, self.sampler), resume["sampler_epoch"],
                                 self._epochs.epoch_at_load)
        if resume is not None and resume.get("epoch_done") and \
                not resume.get("persistent", self.persistent_workers and self.num_workers):
            # the saved epoch had ended: the next one starts from the generator as it was then, and
            # draws its worker seed from it as the saved loader's next epoch did
            self._epochs.resume = None
            generator_of(self).set_state(resume["generator_state"])
        if self.persistent_workers and self.num_workers > 0:
            # torch's __iter__, but the iterator kept by a weak reference where torch's keeps it in
            # self._iterator: it refers to this loader, and that cycle kept the workers alive after
            # the loader was gone, until the cycle collector ran. The pool is the loader's (_epochs.pool):
            # an iterator made after the last one was dropped carries on with the same workers.
            it = self._epochs.iter() if self._epochs.iter is not None else None
            if isinstance(it, MultiProcessIter):
                it.restart(self)
                return it
            return self._get_iterator()
        it = super().__iter__()
        self._epochs.iter = weakref.ref(it)
        return it

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
                 "iterable": self._dataset_kind == DatasetKind.Iterable, "sampler_batches": 0, "yielded_after": [],
                 "yielded_after_rng": [], "next_worker": 0, "worker_rng": None, "worker_batches": None,
                 "worker_stopped": None, "worker_ahead": None, "sampler_epoch": self._epochs.sampler_epoch,
                 "worker_data": None, "sampler_state": None, "dataset_state": None}
        if self._epochs.epoch is None:
            return state
        it = self._epochs.iter() if self._epochs.iter is not None else None
        with getattr(it, "lock", None) or contextlib.nullcontext():  # the prefetch thread adds to the log
            return self._fill_state(state, n)

    def _fill_state(self, state, n):
        log = self._epochs.log
        if self._epochs.epoch_done:
            state.update(generator_state=generator_of(self).get_state(), epoch_done=True)
            if state["persistent"] and log is not None:  # the workers carry their states into the next epoch
                state.update(base_seed=self._epochs.epoch[1], worker_rng=list(log.rng), worker_batches=[0] * n,
                             worker_stopped=[False] * n, worker_ahead=[[] for _ in range(n)])
            return state
        gen_state, base_seed = self._epochs.epoch
        state.update(batches_yielded=self._epochs.yielded, generator_state=gen_state.clone(), base_seed=base_seed,
                     sampler_batches=self._epochs.yielded)
        if log is not None:
            state.update(log.snapshot())
        elif n == 0:
            state.update(self._epochs.single)
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
        check_loadable(state, self.num_workers, self._dataset_kind == DatasetKind.Iterable)
        self._epochs.resume = dict(state)
        # its epoch now: a set_epoch after this one is the caller's word
        sampler = epoch_sampler(self.batch_sampler, self.sampler)
        self._epochs.epoch_at_load = sampler.epoch if sampler is not None else None

    def __del__(self):
        if forked_copy(self):
            return
        epochs = getattr(self, "_epochs", None)
        pool = epochs.pool if epochs is not None else None
        if pool is not None:
            pool.close()
        ring = epochs.local_ring if epochs is not None else None
        if ring is not None:
            ring.close()

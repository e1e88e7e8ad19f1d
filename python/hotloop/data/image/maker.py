"""The main process's half of gpu_decode, a BatchMaker: a packed batch (source.py) to one image tensor.

Per batch: nvjpeg decodes the JPEG bytes, read from the ring slot where they lie, in one batched
call into one device buffer; the crop boxes that workers decoded themselves are copied into the same
buffer (the decode and those copies on a stream of their own: _DecodeStream); then one kernel, on
the loader's side stream, crops, resizes, flips and normalises every image into the batch
(resize.py). An image nvjpeg refused is decoded here by the dataset's own loader (PIL, whose error
is the CPU pipeline's) and joins the rest. Without a device the same steps run on the CPU, the
kernel's C reference resizing: what the CPU tests check.
"""
import array
import dataclasses
import os
import time
import warnings

import numpy as np
import torch

from ... import _C, cuda_queues
from ..batch_maker import BatchMaker, spec_dict, spec_list
from . import resize as image_resize
from .decoder_opening import DecoderOpening, open_first
from .gpu_decode import GPU_BACKENDS, auto_backends
from .source import COLUMNS, DONE, ENCODED, MARKER, PIXELS, column
from .split import SplitBalance

_K = {name: column(name) for name in COLUMNS}
# the columns read per image, as plain indices (the loops over a batch's rows run per batch)
_KIND, _OFFSET, _LENGTH, _SRC_H, _SRC_W = (_K[n] for n in ("kind", "offset", "length", "src_h", "src_w"))
_BOX_TOP, _BOX_LEFT, _BOX_H, _BOX_W = (_K[n] for n in ("box_top", "box_left", "box_h", "box_w"))
_RESIZED_H, _RESIZED_W, _OUT_TOP, _OUT_LEFT, _FLIP = (
    _K[n] for n in ("resized_h", "resized_w", "out_top", "out_left", "flip"))
_WORKER_US, _SPLIT = _K["worker_us"], _K["split"]


def encoded_parts(spec):
    """(table, data, done) spec leaves of a packed batch's spec, or None for any other batch. A
    packed batch is [{MARKER: table, "data": ..., "done": ...}, targets] (collate_encoded)."""
    children = spec_list(spec)
    items = spec_dict(children[0]) if children is not None and len(children) == 2 else None
    if items is None or MARKER not in items:
        return None
    return items[MARKER], items["data"], items["done"]


def is_encoded_batch(batch) -> bool:
    return type(batch) is list and len(batch) == 2 and type(batch[0]) is dict and MARKER in batch[0]


@dataclasses.dataclass
class _Prepared:
    rows: list  # the table, as lists of ints
    places: list  # each row's offset in buf
    out: torch.Tensor  # the images, NCHW-shaped
    mem: torch.Tensor  # their memory, in the kernel's order
    buf: torch.Tensor  # decoded pixels of every image
    table_dev: torch.Tensor  # the kernel's entry table on the device (None on the CPU)
    host: torch.Tensor = None  # page-locked: the kernel's entry table (GPU), made by tables()


@dataclasses.dataclass
class _Tables:
    """What the decode and the kernel take of a batch, built on the host before anything is queued;
    and what the workers spent on its JPEGs, for the split (split.SplitBalance.observe)."""

    encoded: list  # the rows nvjpeg decodes, in the order of sources and dests
    sources: bytes  # (host pointer, length) per encoded row
    dests: bytes  # (device pointer, pitch) per encoded row
    entries: bytes  # the kernel's table (pack_entries)
    count: int
    split: list  # the rows of JPEGs the GPU decoder takes that a worker decoded (split.py)
    read_seconds: float  # the workers' time on the encoded rows
    split_seconds: float  # ... and on the split rows


class _DecodeStream:
    """Where a batch is decoded: a stream that waits for nothing of the consumer's, into memory of its
    own pool of the caching allocator.
    - It has the default priority: nvjpeg runs its per-image work on streams of its own, which a
      priority of this one does not reach (NOTE [ RGB out of nvjpeg ] in nvjpeg_engine.c), and a
      high-priority decode and side stream did not feed a training step faster.
    - The decode used to run on the side stream, behind a wait for the consumer's stream. There, with
      training steps running in another thread, the loader's thread could hang inside nvjpeg's
      hardware decode (in the bench and in tests/data/test_gpu_decode_beside_step.py); on a stream
      of its own it has not.
    - nvjpeg's hardware backend was reported to write its outputs while the call runs, ignoring the
      work queued on the stream before it (torchcodec #1634, nvjpeg 12.3 to 13.2). nvjpeg_engine.c waits
      for that work on the host, which on the side stream would wait for the training step, and
      memory of the consumer's pool may still be in use by the step's queued kernels. The decode
      buffers here are held until the batch's event was seen done (queue's `held`), so the
      allocator hands one out again only once the kernel that read it is over; nvjpeg_engine.c's wait
      covers the rest, the earlier decodes.

    Its event is a raw handle, destroyed by the process that made it: a loader's worker is forked,
    and garbage it inherits (an earlier loader in a reference cycle) is collected there, where a
    torch.cuda.Event's finalizer called CUDA and aborted the worker."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)
        self.handle = self.stream.cuda_stream
        self.device = device
        self._pid = os.getpid()
        self._decoded = _C.cuda_event_create(device.index, False)

    def __del__(self):
        if self._pid == os.getpid():
            try:
                _C.cuda_event_destroy(self._decoded)
            except Exception:  # at interpreter exit CUDA may already be torn down
                pass

    def empty(self, nbytes):
        with torch.cuda.stream(self.stream):
            return torch.empty((nbytes,), dtype=torch.uint8, device=self.device)

    def hand_over(self, side):
        """The side stream's later work (the kernel) comes after what was queued here."""
        _C.cuda_event_record(self._decoded, self.handle)
        _C.cuda_stream_wait_event(side, self._decoded)


class ImageMaker(BatchMaker):
    """The decoder (opened by open(), before the workers start: they must know whether to send JPEG
    bytes; started earlier by open_early() where the loader knows its device when it is made) and
    the per-batch work, make(): the batch's tables built on the host, then its decode and kernel
    queued, in batch order, one batch at a time, where the batch becomes ready (the prefetch
    thread, or next(): NOTE [ One way down for a batch ] in ../prefetch/making.py). The loader calls it
    through BatchMaker's hooks (../batch_maker.py), below close()."""

    paced_top_ups = True  # nvjpeg's decode slows the training step's launches beside it: prefetch.thread.TopUpPace
    # gpu_decode's batches need no page-locked slot: nvjpeg copies the JPEG bytes itself, images that
    # workers decoded are a few per batch, and the targets are a few kB. Page-locking the ring
    # (hundreds of MB with 4 workers and batches of 256) would run in the background through the
    # first steps, holding the driver lock while the first decodes and launches run, and nvjpeg's
    # reads by DMA from a page-locked slot were measured no faster (docs/gpu-decode.md)
    pins_ring = False  # (ring.copies.DeviceCopies.pin_slots)

    def __init__(self, pipeline, device, stats):
        self.pipeline = pipeline
        self.stats = stats  # the loader's LoaderStats: the images_* counts and decoder
        self.device = device  # torch.device("cuda", n) or None
        self.decoder = None
        self.backend = None  # "hardware", "cuda", "hybrid" or "cpu" once opened
        self.reason = None  # why auto did not take the hardware decoder (and the next one, if refused too)
        self._opening = None  # the decoder opening in the background (open_early), until open()
        self._decoding = None  # the _DecodeStream, made with the first batch on the device
        self.balance = None  # split.SplitBalance: the workers' share of the JPEGs, while both pools decode
        self.decoder_failure = None  # what the GPU decoder's failure said: the workers decode since (backend "cpu")
        self.lanes_failure = None  # the host threads beside the engines failed for good: the call that said so

    def open_early(self, device):
        """Start opening the GPU decoder on `device` (where the first iter() is expected to run) in
        the background: nvjpeg's hardware decoder is slow to open (decoder_opening.py). Nothing
        for the CPU backend or once open() ran."""
        if self.backend is not None or self._opening is not None or self.pipeline.config.backend == "cpu":
            return
        self._opening = DecoderOpening(device, self._gpu_backends(), self.pipeline.batch_size)

    def _gpu_backends(self):
        """The GPU decoders to try, in order: the one asked for; for auto the engines, then the next
        (NOTE [ Decoding beside the training step ] in gpu_decode.py)."""
        wanted = self.pipeline.config.backend
        return (wanted,) if wanted != "auto" else auto_backends()

    def open(self):
        if self.backend is not None:
            return self.backend
        opening, self._opening = self._opening, None
        wanted = self.pipeline.config.backend
        if self.device is None or wanted == "cpu":
            self.backend = "cpu"
            if self.device is None and wanted in GPU_BACKENDS:
                raise ValueError(f"DataLoader: gpu_decode backend {wanted!r} needs device='cuda'")
            self.stats.decoder = self.description
            return self.backend
        if opening is not None and opening.device == self.device:
            self.decoder, backend, refusals = opening.result()
        else:
            if opening is not None:
                opening.close()  # made for the device that was current then; the epoch runs on another
            self.decoder, backend, refusals = open_first(self.device, self._gpu_backends(), self.pipeline.batch_size)
        if self.decoder is None and wanted != "auto":
            raise refusals[0][1]
        if refusals:  # auto without JPEG engines: NOTE [ Decoding beside the training step ] (gpu_decode.py)
            self.reason = "; ".join(str(refusal) if k == 0 else f"nvjpeg {name}: {refusal}"
                                    for k, (name, refusal) in enumerate(refusals))
        self.backend = backend if self.decoder is not None else "cpu"
        if self.decoder is not None and self.pipeline.config.threads is not None and backend != "cuda":
            self.decoder.threads = self.pipeline.config.threads
        if self.backend != "cpu":
            cuda_queues.warn_if_narrow("gpu_decode")  # NOTE [ Hardware queues ] in cuda_queues.py
        self.stats.decoder = self.description
        return self.backend

    def close(self):
        opening, self._opening = self._opening, None
        if opening is not None:
            opening.close()
        if self.decoder is not None:
            self.decoder.close()
            self.decoder = None

    # BatchMaker's hooks

    def expect_device(self, device):
        self.open_early(device)

    def use_device(self, device):
        self.device = device

    def worker_side(self, dataset, collate_fn, workers):
        """The workers index the image path's samples and collate them into packed batches; the
        decoder opens first, since what a sample holds (JPEG bytes or pixels) depends on it."""
        backend = self.open()
        samples = self.pipeline.worker_dataset(backend, workers)
        # a share for the workers (the split's, or held at 0 for a failing decoder): one balance for the loader's life
        if samples.taker is not None:
            if self.balance is None:
                self.balance = SplitBalance(self.pipeline.share, workers, self.pipeline.config.worker_decode)
            self.balance.workers = workers
        return samples, self.pipeline.collate_fn()

    def slot_parts(self, spec):
        return encoded_parts(spec)

    def make(self, parts, stream, empty):
        table, data, done = parts
        return self.run(table, data, done, stream, empty)

    def place(self, batch, out):
        batch[0] = out

    def whole_batch(self, batch, device):
        """A packed batch that came whole: decoded and resized on the current stream (the CPU
        without a device), waiting for it (a batch too big for the ring, or one that came through a pipe)."""
        if not is_encoded_batch(batch):
            return batch
        parts = [batch[0][k] for k in (MARKER, "data", "done")]
        if device is None:
            batch[0] = self.run(*parts, 0, lambda shape, dtype: torch.empty(shape, dtype=dtype))[0]
            return batch
        stream = torch.cuda.current_stream(device)
        images, *buffers = self.run(*parts, stream.cuda_stream,
                                    lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))
        stream.synchronize()  # the host bytes are the batch's own, and the buffers are freed when this returns
        del buffers
        batch[0] = images
        return batch

    @property
    def description(self):
        if self.backend is None:
            return None
        if self.backend == "cpu":
            since = f" since {self.decoder_failure}" if self.decoder_failure else ""
            reason = f"; no hardware decoder: {self.reason}" if self.reason else ""
            return f"cpu (workers decode with PIL){since}{reason}"
        library = self.decoder.library if self.decoder is not None else "?"
        threads = ""
        if self.decoder is not None and self.backend == "hybrid":
            threads = f", {self.decoder.threads} threads"
        if self.decoder is not None and self.backend == "hardware" and self.decoder.threads:
            threads = f", {self.decoder.threads} threads beside the engines"
            if self.lanes_failure is not None:
                threads += f" until {self.lanes_failure}"
        reason = f"; no hardware decoder: {self.reason}" if self.reason else ""
        return f"nvjpeg {self.backend} ({library}{threads}){reason}"

    def prepare(self, table, empty):
        """Read the batch's table and allocate what it needs (output, decode buffer, entry table) on
        the output device. `empty(shape, dtype)` allocates the entry table, last: on the device it
        orders the stream the kernel goes on after the consumer's work so far, which covers the
        output, allocated before it on the current stream (BatchMaker.make)."""
        rows = table.tolist()
        c = self.pipeline
        out, mem = image_resize.empty_batch(len(rows), c.plan.out_size, c.out_dtype, self.device or "cpu",
                                            c.config.channels_last)
        places, total = [], 0  # where each row's decoded pixels go in the buffer
        for r in rows:
            size = r[_SRC_H] * r[_SRC_W] * 3 if r[_KIND] != DONE else 0
            places.append(total)
            total += (size + 255) // 256 * 256  # images start aligned for the kernel's loads
        total = max(total, 256)  # never empty: a stand-in entry reads its first pixel
        if self.device is None:
            buf = empty((total,), torch.uint8)
        else:
            if self._decoding is None or self._decoding.device != self.device:
                self._decoding = _DecodeStream(self.device)
            buf = self._decoding.empty(total)
        table_dev = empty((len(rows) * _C.IMAGE_ENTRY_BYTES,), torch.uint8) if self.device is not None else None
        return _Prepared(rows, places, out, mem, buf, table_dev)

    def tables(self, p, data):
        """The batch's host work, nothing queued on a device: the decode's and the kernel's tables.
        data's memory (a ring slot) must stay put until the kernel's stream has passed the batch's
        work (released after the batch's event): nvjpeg reads it in queue()."""
        started = time.perf_counter()
        if self.device is not None:
            # nvjpeg reads the JPEG bytes where they lie, in the slot, and copies them into page-locked
            # buffers of its own inside its call: a page-locked copy made here first would cost this
            # thread a copy of every byte and spare nvjpeg's call little (docs/gpu-decode.md).
            # The kernel's entry table is page-locked: uploaded from pageable memory, the driver may
            # wait for the stream first, and there that is the decode (image_resize's table_host).
            p.host = torch.empty(len(p.rows) * _C.IMAGE_ENTRY_BYTES, dtype=torch.uint8, pin_memory=True)
        base, data_addr = p.buf.data_ptr(), data.data_ptr()
        encoded, sources, dests, entries, split = [], array.array("q"), array.array("q"), [], []
        read_us = split_us = 0
        h, w = self.pipeline.plan.out_size
        for k, r in enumerate(p.rows):
            kind = r[_KIND]
            if kind == ENCODED:
                encoded.append(k)
                read_us += r[_WORKER_US]
                sources += array.array("q", (data_addr + r[_OFFSET], r[_LENGTH]))
                dests += array.array("q", (base + p.places[k], r[_SRC_W] * 3))
            elif kind == PIXELS:
                self.stats.images_cpu_decoded += 1
                if r[_SPLIT]:
                    self.stats.images_split += 1
                    split.append(k)
                    split_us += r[_WORKER_US]
            else:  # DONE: a stand-in that reads one pixel; _place_done overwrites its output after the kernel
                self.stats.images_cpu_pipeline += 1
                entries.append((base, 3, 1, 1, 0, 0, 1, 1, h, w, 0, 0, 0, 3))
                continue
            entries.append((base + p.places[k], r[_SRC_W] * 3, r[_SRC_H], r[_SRC_W], r[_BOX_TOP], r[_BOX_LEFT],
                            r[_BOX_H], r[_BOX_W], r[_RESIZED_H], r[_RESIZED_W], r[_OUT_TOP], r[_OUT_LEFT],
                            r[_FLIP], 3))
        self.stats.image_staging_seconds += time.perf_counter() - started
        return _Tables(encoded, sources.tobytes(), dests.tobytes(), image_resize.pack_entries(entries), len(entries),
                       split, read_us / 1e6, split_us / 1e6)

    def queue(self, p, t, data, done, stream):
        """Queue the batch: its decode and uploads (on the _DecodeStream), then its kernel on
        `stream`. Returns (images NCHW-shaped, device buffers of the consumer's pool, held): the
        caller keeps the buffers until the stream passed them, and `held` (the page-locked entry
        table and the decode buffer; None on the CPU) until it has seen the stream pass them (the
        batch's event done)."""
        decoding = self._decoding.handle if self.device is not None else stream
        decode_seconds = self._decode(p, t, data, decoding)
        started, uploads = time.perf_counter(), 0
        for k, r in enumerate(p.rows):
            if r[_KIND] == PIXELS:
                self._upload(p.buf, p.places[k], data[r[_OFFSET]:r[_OFFSET] + r[_LENGTH]], decoding)
                uploads += 1
        if self.balance is not None and decode_seconds is not None:
            # the split rows' share of the uploads' time (the rest are files the decoder cannot take)
            upload = (time.perf_counter() - started) * len(t.split) / uploads if uploads else 0.0
            self.balance.observe(len(t.encoded), decode_seconds, len(t.split), upload, t.read_seconds,
                                 t.split_seconds)
            self.stats.image_worker_share = self.balance.share.get()
        if self.device is not None:
            self._decoding.hand_over(stream)
        c = self.pipeline
        image_resize.resize_batch(t.entries, t.count, p.mem, c.config.channels_last, c.plan.mean, c.plan.std,
                                  c.plan.scale, stream, p.table_dev, p.host)
        for k, r in enumerate(p.rows):
            if r[_KIND] == DONE:
                self._place_done(p.out, k, done[r[_OFFSET]], stream)
        if self.device is None:
            return p.out, [p.buf], None
        return p.out, [p.table_dev], (p.host, p.buf)

    def run(self, table, data, done, stream, empty):
        """A packed batch's parts to its images: prepare, tables and queue; queue's result."""
        p = self.prepare(table, empty)
        return self.queue(p, self.tables(p, data), data, done, stream)

    def _decode(self, p, t, data, stream):
        """nvjpeg decodes the batch's JPEGs in one call; those it refuses, PIL decodes here. The
        call's seconds; None where nvjpeg did not decode (no JPEGs, or the decoder failed: then PIL
        decodes them all here, and the workers decode from the next batches on)."""
        if not t.encoded:
            return None
        started = time.perf_counter()
        statuses = self._decoder_call(t, stream)
        seconds = time.perf_counter() - started
        self.stats.image_decode_seconds += seconds
        if self.decoder_failure is None and self.decoder.lane_share is not None:
            self._lanes_seen()
        for k, status in zip(t.encoded, statuses, strict=True):
            if status == 0:
                self.stats.images_gpu_decoded += 1
                continue
            self.stats.images_refused += 1
            r = p.rows[k]
            raw = data[r[_OFFSET]:r[_OFFSET] + r[_LENGTH]].numpy().tobytes()
            image = self.pipeline.source.load(raw, r[_K["index"]])  # PIL's error, if it has one
            pixels = np.array(image, dtype=np.uint8)  # a writable copy: torch.from_numpy wants one
            if pixels.shape != (r[_SRC_H], r[_SRC_W], 3):
                raise RuntimeError(f"gpu_decode: image {r[_K['index']]} decodes to {pixels.shape[:2]}, but its "
                                   f"JPEG header says {(r[_SRC_H], r[_SRC_W])}")
            self._upload(p.buf, p.places[k], torch.from_numpy(pixels).view(-1), stream)
        return seconds if self.decoder_failure is None else None

    def _lanes_seen(self):
        """The host threads beside the engines (GpuDecode(threads=)): their share and images into the
        stats; should they have failed for good, one warning (the engines decode alone from then on, and
        the images they failed were decoded here as refused ones)."""
        self.stats.image_lane_share = self.decoder.lane_share
        self.stats.images_on_lanes = self.decoder.lane_images
        failure = self.decoder.lane_failure
        if failure is not None and self.lanes_failure is None:
            self.lanes_failure = failure
            warnings.warn(f"hotloop.DataLoader: gpu_decode's host threads beside the JPEG engines failed ({failure}); "
                          "the engines decode alone from now on", RuntimeWarning, stacklevel=3)
            self.stats.decoder = self.description

    def _decoder_call(self, t, stream):
        """The GPU decoder's statuses for the batch's JPEGs; all refused (decoded by PIL here) once it
        has failed. Where the workers share the decode, its first failure hands them every image,
        with one warning: the epoch goes on (NOTE [ Two pools for one batch ] in split.py)."""
        if self.decoder_failure is None:
            try:
                return self.decoder.decode(t.sources, t.dests, len(t.encoded), stream)
            except RuntimeError as exc:
                if self.balance is None:
                    raise
                self.decoder_failure = f"nvjpeg {self.backend} failed: {exc}"
                self.balance.fail()
                warnings.warn(f"hotloop.DataLoader: gpu_decode's {self.backend} decoder failed ({exc}); the workers "
                              "decode every image from now on (the CPU backend's way)", RuntimeWarning, stacklevel=2)
                self.backend = "cpu"  # later epochs: the CPU backend's workers and ring reservation
                self.stats.image_worker_share = 1.0
                self.stats.decoder = self.description
        return bytes([_C.JPEG_UNSUPPORTED]) * len(t.encoded)

    def _upload(self, buf, place, src, stream):
        """Host bytes into the decode buffer at `place`, on the stream: they are pageable (the slot,
        or PIL's pixels), and cuMemcpyHtoDAsync stages them before it returns."""
        nbytes = src.numel()
        if self.device is None:
            buf[place:place + nbytes].copy_(src)
            return
        _C.cuda_memcpy_htod_async(buf.data_ptr() + place, src.data_ptr(), nbytes, stream)

    def _place_done(self, out, k, image, stream):
        """A finished CPU-pipeline image (C, H, W) into output k, in the output's dtype."""
        if self.device is None:
            out[k].copy_(image)
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
            out[k].copy_(image.to(self.device, non_blocking=False))

"""hotloop.GpuDecode: the DataLoader's gpu_decode= option, and what it resolves to for one loader."""
import functools
import math
import os
import random
import statistics
import warnings

import torch

from ... import _C
from ..._torch_compat import default_collate
from .plan import ImagePlan
from .source import EncodedSamples, ImageSource, collate_encoded, shipped_pixel_bytes
from . import split

BACKENDS = ("auto", "hardware", "cuda", "hybrid", "cpu")
GPU_BACKENDS = ("hardware", "cuda", "hybrid")  # nvjpeg's: JpegDecoder's backend names

# NOTE [ Decoding beside the training step ]
# nvjpeg's CUDA backend decodes everything on the SMs, the Huffman codes included, in kernels that run
# beside the training step's own and take SMs and memory bandwidth from them: a step slows while a
# batch decodes next to it. The hardware backend uses the GPU's JPEG engines, which the step does not
# use. The hybrid backend decodes the Huffman codes, most of a decode's work, on the main process's
# threads (NOTE [ Hybrid lanes ] in csrc/nvjpeg_hybrid.c) and leaves the SMs only the IDCT and the
# colour conversion. So "auto" takes the engines where the GPU has them, else the hybrid backend, else
# (no nvjpeg) the workers' PIL decode. With the engines switched off, the photo bench
# (bench/photo_backends.py, docs/gpu-decode.md) measured the hybrid backend ahead of the workers' decode
# and of torch's loader alone and feeding ResNet-18 and ResNet-50, and the cuda backend behind both fed:
# the step lost less to the hybrid's kernels than it gained from batches that came sooner. "cuda" is
# there for whoever asks for it. Cited by GpuDecode's docstring and maker.ImageMaker.open.
AUTO_WITHOUT_ENGINES = "hybrid"  # what "auto" takes where nvjpeg's hardware decoder does not open


def auto_backends():
    """The GPU decoders "auto" tries, in order; the workers decode where none opens."""
    return ("hardware",) if AUTO_WITHOUT_ENGINES == "cpu" else ("hardware", AUTO_WITHOUT_ENGINES)
_SIZE_SAMPLE = 64  # files whose sizes estimate a batch's bytes
_SIZE_MARGIN = 1.5  # the first batch reserves at least this many times a mean batch's JPEG bytes in the ring
_SIZE_SPREADS = 4.0  # ... and at least this many standard deviations of a batch's bytes above their mean


class GpuDecode:
    """How hotloop.DataLoader(..., gpu_decode=GpuDecode(...)) decodes images (gpu_decode=True is
    GpuDecode()).

    backend: "auto" (default): nvjpeg's hardware JPEG decoders where the GPU has them (A100, H100,
        H200, ...), else "hybrid" (GeForce cards such as the RTX 4090, and others without engines),
        else, without nvjpeg, decoding in the workers with PIL (NOTE [ Decoding beside the training
        step ]). "hardware", "cuda" (nvjpeg on the SMs),
        "hybrid" (nvjpeg's Huffman decoding on the main process's threads, the rest on the SMs) or
        "cpu" (the workers decode) force one; a forced GPU backend that cannot run raises.
        Whatever the backend, the crop, resize, flip and normalisation run as one GPU kernel.
    dtype: the images' dtype: None (the default) is what the transform makes (float32 after
        ToTensor); float16 or bfloat16 halve the bytes (autocast takes them as they are).
    channels_last: images in channels_last memory format (what a convolutional net under AMP
        runs fastest on), else contiguous NCHW as torch's pipeline makes them.
    worker_decode: with a GPU decoder and worker processes, whether the workers also decode a share
        of the JPEGs, sized to what each pool delivered on the batches before (NOTE [ Two pools for
        one batch ] in split.py). Off by default: on the GPU machine's photo bench the share the
        balance chose lowered the loader's rate against the decoder alone (docs/gpu-decode.md). Off,
        the GPU decoder takes every JPEG it can; should it fail mid-epoch, the workers still take
        over, as with the split.
    threads: host threads (1 to 64) that decode Huffman codes with nvjpeg's hybrid decoder. For
        "hybrid", how many (None: one per CPU available). For "hardware" (and "auto" where it takes the
        engines), threads beside the engines: a share of each batch's pixels, learnt from what both
        pools delivered on the batches before, and the JPEGs the engines refuse (progressive ones);
        None: the engines alone (NOTE [ Lanes beside the engines ] in csrc/nvjpeg_beside.c).
    """

    def __init__(self, backend="auto", dtype=None, channels_last=False, worker_decode=False, threads=None):
        if backend not in BACKENDS:
            raise ValueError(f"GpuDecode: expected backend in {BACKENDS}, got {backend!r}")
        if dtype not in (None, torch.float32, torch.float16, torch.bfloat16, torch.uint8):
            raise TypeError(f"GpuDecode: expected dtype None, float32, float16, bfloat16 or uint8, got {dtype}")
        if not isinstance(channels_last, bool):
            raise TypeError(f"GpuDecode: expected channels_last to be a bool, got {type(channels_last).__name__}")
        if not isinstance(worker_decode, bool):
            raise TypeError(f"GpuDecode: expected worker_decode to be a bool, got {type(worker_decode).__name__}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
            raise TypeError(f"GpuDecode: expected threads to be None or an int, got {type(threads).__name__}")
        if threads is not None and not 1 <= threads <= _C.JPEG_MAX_THREADS:
            raise ValueError(f"GpuDecode: expected threads None or 1 to {_C.JPEG_MAX_THREADS}, got {threads}")
        if threads is not None and backend in ("cuda", "cpu"):
            raise ValueError(f"GpuDecode: threads is for the backends that decode on host threads (\"auto\", "
                             f"\"hardware\", \"hybrid\"); backend {backend!r} has none")
        self.backend, self.dtype, self.channels_last = backend, dtype, channels_last
        self.worker_decode, self.threads = worker_decode, threads

    def __repr__(self):
        return (f"GpuDecode(backend={self.backend!r}, dtype={self.dtype}, channels_last={self.channels_last}, "
                f"worker_decode={self.worker_decode}, threads={self.threads})")

    @classmethod
    def from_argument(cls, value):
        """gpu_decode= as given: None/False (off), True, a backend name, or a GpuDecode."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, str):
            return cls(backend=value)
        if isinstance(value, cls):
            return value
        raise TypeError(f"DataLoader: expected gpu_decode=True/False, a backend name {BACKENDS} or a "
                        f"hotloop.GpuDecode, got {type(value).__name__}")


class ImagePipeline:
    """One loader's image path: the source, the plan and the options. Made by the DataLoader when
    gpu_decode is on and the dataset and transform are recognised; None (with a warning that says
    why) otherwise, and the loader runs the dataset's own pipeline as torch would."""

    def __init__(self, config, source, plan, batch_size):
        self.config, self.source, self.plan = config, source, plan
        self.batch_size = batch_size or 1
        self.out_dtype = config.dtype if config.dtype is not None else plan.dtype
        if self.out_dtype != torch.uint8 and plan.dtype == torch.uint8:
            raise TypeError(f"DataLoader: gpu_decode with dtype={config.dtype}, but the transform makes uint8 "
                            "images (no ToTensor / ToDtype): ask for dtype=None or torch.uint8, or convert "
                            "in the transform")
        self.capacity = None  # bytes the first batch reserves in the ring, once the backend is known
        self.share = None  # split.DecodeShare: the share of the GPU's JPEGs the workers decode, once they run
        self._sized_for = None  # (backend, whether workers share the decode) that capacity was sampled for

    @classmethod
    def make(cls, value, dataset, collate_fn, batch_size, loader_kind):
        config = GpuDecode.from_argument(value)
        if config is None:
            return None
        source, why = ImageSource.of(dataset)
        plan = ImagePlan.of(source.transform) if source is not None else None
        if source is not None and plan is None:
            why = f"its transform {source.transform!r} holds a step hotloop does not run on the GPU"
        # torch's own default_collate counts as none given: a loader made again from its attributes passes it
        if source is not None and collate_fn not in (None, default_collate):
            why = "a collate_fn was given (gpu_decode makes the batch itself, as default_collate would)"
        if loader_kind != "map":
            why = "gpu_decode needs a map-style dataset with automatic batching (batch_size not None)"
        if why is not None:
            # the user's line: here <- make_maker <- DataLoader.__init__ <- the user
            warnings.warn(f"hotloop.DataLoader: gpu_decode is off: {why}; the dataset's own pipeline runs "
                          "in the workers, as with torch", stacklevel=4)
            return None
        return cls(config, source, plan, batch_size)

    def worker_dataset(self, backend, workers):
        """What the `workers` processes index: JPEG bytes travel when the decoder is on the GPU, crop
        boxes' pixels when the workers decode (the CPU backend). With a GPU decoder, worker processes
        and worker_decode, the workers decode a share of the JPEGs too (NOTE [ Two pools for one
        batch ] in split.py), and a slot holds that share's pixels besides the JPEG bytes; without
        worker_decode the share is there at 0, for the workers to take over should the decoder fail."""
        gpu = backend in GPU_BACKENDS
        shared = gpu and workers > 0  # with worker_decode=False the share stays 0 until the decoder fails
        splits = shared and self.config.worker_decode
        if shared and self.share is None:
            self.share = split.DecodeShare()  # the loader's for good: its balance (maker.py) sets it
        share = self.share if shared else None
        if self._sized_for != (backend, splits):  # a sample of the files, once, not at every epoch
            self.capacity = _batch_bytes_estimate(self.source, self.batch_size, self.plan if not gpu else None)
            if splits:
                self.capacity += int(split.SPLIT_CAP * _batch_bytes_estimate(self.source, self.batch_size, self.plan))
            self._sized_for = (backend, splits)
        beside_engines = backend == "hardware" and self.config.threads is not None  # they take progressive JPEGs
        return EncodedSamples(self.source, self.plan, gpu,
                              progressive=backend in ("cuda", "hybrid") or beside_engines,
                              capacity=self.capacity, share=share)

    def collate_fn(self):
        return functools.partial(collate_encoded, capacity=self.capacity or 0)


def _batch_bytes_estimate(source, batch_size, plan):
    """Bytes a batch's data tensor reserves in the ring, from a sample of an ImageFolder's files:
    their sizes (os.stat) where JPEG bytes travel (plan None), or where pixels travel the bytes a
    worker ships for each under `plan` (source.shipped_pixel_bytes); a batch's mean with a margin, and
    room for how much a sum of that many sizes spreads. 0 (sized from the first batch) for other sources. A batch that does not fit travels
    outside the ring, a slow way: the CPU backend's crops, sized as JPEG bytes, all did, which made
    that backend slower than torch's own pipeline."""
    samples = getattr(source.dataset, "samples", None)
    if not samples:
        return 0
    rng = random.Random(0)
    picks = [samples[rng.randrange(len(samples))][0] for _ in range(min(_SIZE_SAMPLE, len(samples)))]
    sizes = []
    # one fork of torch's generator for the whole sample: the caller's draws stay untouched, and each
    # file's box is a draw of its own (a fork per file would give every file the same draw)
    with torch.random.fork_rng(devices=[]):
        for path in picks:
            try:
                sizes.append(shipped_pixel_bytes(path, plan) if plan is not None else os.stat(path).st_size)
            except OSError:  # PIL's UnidentifiedImageError is one
                pass
    if len(sizes) < 2:
        return int(sum(sizes) * batch_size * _SIZE_MARGIN)
    # a batch's bytes are a sum of batch_size draws: their mean times the batch with the margin, or, for
    # small batches (whose sums spread the most), the mean plus _SIZE_SPREADS standard deviations of the sum
    mean = statistics.fmean(sizes)
    spread = statistics.stdev(sizes) * math.sqrt(batch_size)
    return int(max(mean * batch_size * _SIZE_MARGIN, mean * batch_size + _SIZE_SPREADS * spread))

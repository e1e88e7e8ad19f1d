"""PIL standing in for nvjpeg on the CPU, its calls gated and made to fail on cue, and the pair of
loaders (torch's, and hotloop's gpu_decode on the device path under fake_cuda) the tests built on it."""
import array
import ctypes
import io
import threading

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader as TorchDataLoader

import hotloop

from .conftest import fake_device


class GatedDecoder:
    """nvjpeg's part played by PIL on the CPU, as test_gpu_decode's PilDecoder; its calls from the `gate_from`-th on say that they
    started and wait for `release`; the `fail_at`-th raises `error`. It records the thread of each call."""

    library = "PIL, standing in for nvjpeg"
    threads, lane_share, lane_images = 0, None, 0  # JpegDecoder's: no host threads beside the decoder

    def __init__(self):
        self.gate_from = None
        self.fail_at = None
        self.error = RuntimeError("stand-in decoder failed")  # what nvjpeg's failures raise
        self.calls = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def decode(self, sources, dests, count, stream):
        self.calls.append(threading.current_thread().name)
        if self.gate_from is not None and len(self.calls) >= self.gate_from:
            self.entered.set()
            self.release.wait(30)
        if len(self.calls) == self.fail_at:
            raise self.error
        src, dst = array.array("q", sources), array.array("q", dests)
        statuses = bytearray()
        for k in range(count):
            image = Image.open(io.BytesIO(ctypes.string_at(src[2 * k], src[2 * k + 1]))).convert("RGB")
            pixels = np.ascontiguousarray(np.asarray(image))
            for r in range(pixels.shape[0]):
                ctypes.memmove(dst[2 * k] + r * dst[2 * k + 1], pixels[r].ctypes.data, pixels.shape[1] * 3)
            statuses.append(0)
        return bytes(statuses)

    def close(self):
        pass


def gpu_decode_loaders(ds, seed, **kw):
    """torch's loader and hotloop's (gpu_decode, the device path under fake_cuda), same seed."""
    theirs = TorchDataLoader(ds, generator=torch.Generator().manual_seed(seed), **kw)
    ours = fake_device(hotloop.DataLoader(ds, generator=torch.Generator().manual_seed(seed), gpu_decode=True,
                                          prefetch_batches=2, **kw))
    return theirs, ours


def take_batch(it):
    x, y = next(it)
    return x.clone(), y.clone()

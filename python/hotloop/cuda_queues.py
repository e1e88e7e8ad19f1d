"""CUDA's hardware work queues widened before CUDA starts in this process (NOTE [ Hardware queues ]).

NOTE [ Hardware queues ]
A CUDA context feeds the GPU through a fixed number of hardware work queues,
CUDA_DEVICE_MAX_CONNECTIONS of them (8 unless set, 32 at most), read when the context is made. Streams
share them, and work on one queue starts in the order it was queued, whichever stream it came from.
nvjpeg's hardware decode runs its per-image work on streams of its own; sharing a queue with the
training stream, that work waits behind the step's queued kernels, so a decode call holds its
thread (and next(), waiting for the batch) for about as long as the step. With the widest setting
its streams rarely share a queue with the training stream. docs/gpu-decode.md has what was measured.

So `import hotloop` asks for 32 queues, but only where the user has not set the variable and torch has
not started CUDA yet (later it would change nothing). Setting CUDA_DEVICE_MAX_CONNECTIONS yourself, to
8 for CUDA's default, keeps your choice; `python -m hotloop doctor` shows the value in effect, and a
gpu_decode loader on nvjpeg (either backend) warns where hotloop came too late to set it.
"""
import os
import sys
import warnings

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
WIDEST = "32"  # CUDA's most

set_by_hotloop = False  # whether widen() set the variable in this process
_warned = False  # whether warn_if_narrow() has warned in this process


def widen():
    """Ask for WIDEST queues where the user chose none and no torch CUDA context exists yet."""
    global set_by_hotloop
    if VARIABLE in os.environ or _torch_cuda_started():
        return
    os.environ[VARIABLE] = WIDEST
    set_by_hotloop = True


def _torch_cuda_started():
    torch = sys.modules.get("torch")  # `import hotloop` does not import torch
    cuda = getattr(torch, "cuda", None)  # None too while torch itself is still being imported
    return cuda is not None and cuda.is_initialized()


def warn_if_narrow(what):
    """Once per process, a warning that `what` may wait behind the training step: hotloop was imported
    after torch started CUDA, and CUDA's default of 8 queues is in effect. A value the user set is
    their choice and is left unremarked."""
    global _warned
    if _warned or VARIABLE in os.environ:
        return
    _warned = True
    warnings.warn(f"{what}: CUDA started before `import hotloop`, with CUDA's default of 8 hardware queues, "
                  "where the decoder's work can wait behind the training step's and slow it (NOTE [ Hardware "
                  f"queues ] in hotloop/cuda_queues.py). Import hotloop before CUDA starts, or set "
                  f"{VARIABLE}=32 in the environment", RuntimeWarning, stacklevel=2)

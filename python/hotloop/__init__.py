"""hotloop keeps a PyTorch GPU busy: C and CUDA C under thin wrappers that slot into a training loop.

`import hotloop` needs neither a GPU nor torch; the parts that work on tensors import torch when used.
It sets CUDA_DEVICE_MAX_CONNECTIONS=32 where the variable is unset and torch has not started CUDA yet
(NOTE [ Hardware queues ] in cuda_queues.py).
"""
import importlib

from . import cuda_queues

cuda_queues.widen()  # before any CUDA context exists: NOTE [ Hardware queues ] in cuda_queues.py

from . import _C  # noqa: E402
from ._C import CudaError, NvjpegError, NvmlError  # noqa: E402
from ._version import __version__  # noqa: E402

if hasattr(_C, "set_kernel_loader"):  # C's kernels are compiled at first use, by NVRTC: see hotloop.rtc
    _C.set_kernel_loader(importlib.import_module(f"{__name__}.rtc.loader").load_kernel_image)

__all__ = ["BatchSizeResult", "CudaError", "DataLoader", "EncodedImageDataset", "GatheredStats", "GpuDecode", "GradScaler", "MemoryMonitor", "MemoryReport", "Normalize", "NvjpegError", "NvmlError",
           "__version__", "build_info", "cuda_available", "find_max_batch_size", "memory_monitor", "ops", "optim"]


# names offered at the top level, defined in a submodule that loads on first use (the components
# import torch; `import hotloop` does not)
_LAZY_ATTRIBUTES = {"DataLoader": "data", "GatheredStats": "data", "Normalize": "data", "GpuDecode": "data", "EncodedImageDataset": "data", "GradScaler": "amp", "memory_monitor": "memory",
                    "find_max_batch_size": "memory.batch_size", "BatchSizeResult": "memory.batch_size",
                    "MemoryMonitor": "memory", "MemoryReport": "memory"}
_LAZY_MODULES = {"ops": "amp.ops", "optim": "optim"}


def build_info() -> dict:
    """What hotloop._C was built with: version, CUDA runtime (or None), architectures, abi3, sanitizers."""
    return _C.build_info()


def cuda_available() -> bool:
    """True when hotloop was built with CUDA and a driver and a device are present."""
    return _C.cuda_unavailable_reason() is None


def __getattr__(name):
    # submodules that need torch load on first use, so that `import hotloop` stays light
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{_LAZY_MODULES[name]}")
    if name in _LAZY_ATTRIBUTES:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY_ATTRIBUTES[name]}"), name)
    raise AttributeError(f"module 'hotloop' has no attribute {name!r}")

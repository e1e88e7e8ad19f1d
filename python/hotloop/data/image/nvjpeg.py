"""Where nvjpeg may be, in the order hotloop tries it: the image pipeline's GPU decoder (_C.JpegDecoder)
opens libnvjpeg at run time, so neither building nor importing hotloop needs it.

    decoder = _C.JpegDecoder(nvjpeg_library_candidates(), device, "hardware", 256)

_C.nvjpeg_load(nvjpeg_library_candidates()) says which library loads and its version (no GPU needed),
or raises RuntimeError listing each path tried and why it failed.
"""
import glob
import importlib.util
import logging
import os

_logger = logging.getLogger(__name__)

SONAME = "libnvjpeg.so.13"  # the CUDA 13 library: hotloop's CUDA runtime is 13


def _package_dirs(name):
    """The folders a (namespace) package would be imported from, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return list(spec.submodule_search_locations or [])


def nvjpeg_library_candidates() -> list:
    """Paths (or sonames) of libnvjpeg to try, first to last: $HOTLOOP_NVJPEG; libnvjpeg.so.13 by the
    dynamic linker's search; the nvidia-nvjpeg wheel's copy (site-packages/nvidia/cu13/lib); the copy
    torchvision bundles (torchvision.libs/libnvjpeg*); $CUDA_HOME/lib64; /usr/local/cuda/lib64.
    Wheel and torchvision copies are listed only where the file exists; duplicates are dropped."""
    candidates = []
    override = os.environ.get("HOTLOOP_NVJPEG", "").strip()
    if override:
        candidates.append(override)
    candidates.append(SONAME)
    for folder in _package_dirs("nvidia"):
        path = os.path.join(folder, "cu13", "lib", SONAME)
        if os.path.exists(path):
            candidates.append(path)
    for folder in _package_dirs("torchvision"):
        # auditwheel renames bundled libraries with a hash: libnvjpeg.36e11081.so.13
        candidates += sorted(glob.glob(os.path.join(os.path.dirname(folder), "torchvision.libs", "libnvjpeg*.so*")))
    cuda_home = os.environ.get("CUDA_HOME", "").strip()
    if cuda_home:
        candidates.append(os.path.join(cuda_home, "lib64", SONAME))
    candidates.append(os.path.join("/usr/local/cuda", "lib64", SONAME))
    unique = list(dict.fromkeys(candidates))
    _logger.debug("nvjpeg candidates: %s", unique)
    return unique

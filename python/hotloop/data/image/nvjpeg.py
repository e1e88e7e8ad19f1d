"""Where nvjpeg may be, in the order hotloop tries it: the image pipeline's GPU decoder (_C.JpegDecoder)
opens libnvjpeg at run time, so neither building nor importing hotloop needs it.

    decoder = _C.JpegDecoder(nvjpeg_library_candidates(), device, "hardware", 256)

_C.nvjpeg_load(nvjpeg_library_candidates()) says which library loads and its version (no GPU needed),
or raises RuntimeError listing each path tried and why it failed.
"""
import logging

from ...rtc import library_search

_logger = logging.getLogger(__name__)

SONAME = library_search.NVJPEG_SONAME


def nvjpeg_library_candidates() -> list:
    """Paths of libnvjpeg to try, first to last, from installed places only (NOTE [ Library search ]):
    $HOTLOOP_NVJPEG; the nvidia-nvjpeg wheel's copy (site-packages/nvidia/cu13/lib); the copies
    torchvision and torch bundle; a conda environment's lib folder; $CUDA_HOME/lib64; /usr/local/cuda/lib64.
    A file others could have written is left out (library_search.nvjpeg_search says why); RuntimeError
    when HOTLOOP_NVJPEG names one."""
    candidates = [c.path for c in library_search.nvjpeg_search() if not c.skipped]
    _logger.debug("nvjpeg candidates: %s", candidates)
    return candidates

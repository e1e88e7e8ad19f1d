"""Kernels compiled at run time: NVRTC, found where the user has it, compiles kernels/*.cu for the GPU at
hand the first time C needs them, and the images are cached on disk (`python -m hotloop compile` fills
the cache ahead of time).

    loader         load_kernel_image: what C calls (registered at `import hotloop`)
    images         an image from the cache or NVRTC; compile_all, cached_sources
    nvrtc_finder   where NVRTC is, and the one this process uses
    library_search where NVRTC and nvjpeg may be looked for: installed places only
    kernel_sources the kernels folder, the sources C launches from, their compile options
    targets        CUBIN for the GPU's own architecture, or PTX for an older one that the driver JITs
    kernel_cache   the cache's folder, keys and files
    cache_files    the cache's files opened, read and written so that only trusted ones are read
    file_trust     whose files are loaded: owner and mode checks (NOTE [ Trusted files ])

Names load on first use: `import hotloop` imports the loader alone.
"""
import importlib

_LAZY_ATTRIBUTES = {"load_kernel_image": "loader", "KernelImage": "images", "cached_sources": "images",
                    "compile_all": "images", "NvrtcCandidate": "nvrtc_finder", "find_nvrtc": "nvrtc_finder",
                    "nvrtc_candidates": "nvrtc_finder", "open_nvrtc": "nvrtc_finder", "cache_folder": "kernel_cache"}

__all__ = sorted(_LAZY_ATTRIBUTES)


def __getattr__(name):
    if name in _LAZY_ATTRIBUTES:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY_ATTRIBUTES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

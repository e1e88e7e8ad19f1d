"""Kernel images: the CUBIN or PTX of one kernel source for one target, from the cache or compiled by NVRTC;
compile_all() fills the cache ahead of time (`hotloop compile`), cached_sources() says what is there.
"""
import logging
import threading
import time
import typing

from .. import _C
from . import kernel_cache, kernel_sources, nvrtc_finder, targets

_logger = logging.getLogger(__name__)


class KernelImage(typing.NamedTuple):
    source: str
    target: targets.Target
    image: bytes
    cached: bool  # True: read from the cache; False: compiled now
    seconds: float  # the look-up, and the compile when there was one
    entry: str  # the cache file's name


_caches = {}  # cache folder -> KernelCache: the folder follows HOTLOOP_CACHE_DIR when it changes
_caches_lock = threading.Lock()


def kernel_cache_for_now() -> kernel_cache.KernelCache:
    """The cache of the folder the environment names now."""
    folder = kernel_cache.cache_folder()
    with _caches_lock:
        if folder not in _caches:
            _caches[folder] = kernel_cache.KernelCache(folder)
        return _caches[folder]


_supported = {}  # NVRTC path -> its supported architectures, asked once


def supported_archs(nvrtc) -> list:
    if nvrtc.path not in _supported:
        _supported[nvrtc.path] = nvrtc.supported_archs()
    return _supported[nvrtc.path]


def entry_for(nvrtc, source: str, target: targets.Target, folder=None):
    """(cache file name, key, options, source bytes) of one source compiled for `target` by `nvrtc`."""
    folder = folder or kernel_sources.kernels_dir()
    code = kernel_sources.source_path(source, folder).read_bytes()
    options = kernel_sources.compile_options(target.arch, target.cubin, folder)
    key = kernel_cache.cache_key(source, code, kernel_sources.headers_digest(folder), nvrtc.version, target.arch,
                                 target.cubin, kernel_sources.options_for_key(options))
    return kernel_cache.entry_name(source, target.arch, target.cubin, key), key, options, code


def kernel_image(nvrtc, source: str, target: targets.Target, cache=None, folder=None) -> KernelImage:
    """The image of kernels/<source>.cu for `target`, from `cache` (by default the environment's) or
    compiled by `nvrtc` and stored there."""
    start = time.perf_counter()
    cache = cache or kernel_cache_for_now()
    name, key, options, code = entry_for(nvrtc, source, target, folder)

    def compile_now():
        _logger.info("compiling %s.cu for %s with NVRTC %d.%d", source, target, *nvrtc.version)
        return nvrtc.compile(code, f"{source}.cu", options, target.cubin)

    image, cached = cache.get_or_make(name, key, compile_now)
    return KernelImage(source, target, image, cached, time.perf_counter() - start, name)


def target_for_device(nvrtc, device: int) -> targets.Target:
    arch = targets.arch_of(_C.cuda_device_capability(device))
    return targets.target_for(arch, supported_archs(nvrtc), nvrtc.version)


def check_driver_loads(nvrtc, target: targets.Target, driver_version) -> None:
    """PTX needs a driver of at least the NVRTC's CUDA minor version to be JIT-compiled; say so
    before the driver fails with an opaque CUDA_ERROR_UNSUPPORTED_PTX_VERSION."""
    if target.cubin or driver_version is None:
        return
    major, minor = nvrtc.version
    if major * 1000 + minor * 10 > driver_version:
        raise RuntimeError(f"this GPU is newer than NVRTC {major}.{minor} ({nvrtc.path}) knows, so its kernels are "
                           f"{target}, which needs a driver for CUDA {major}.{minor} or newer; the driver "
                           f"supports CUDA {driver_version // 1000}.{driver_version % 1000 // 10}: update the driver, "
                           "or use an NVRTC that knows this GPU (HOTLOOP_NVRTC=/path/libnvrtc.so)")


def image_for_device(device: int, source: str) -> bytes:
    """The CUBIN (or PTX) of kernels/<source>.cu for GPU `device`: from the cache, else compiled now
    by NVRTC and stored."""
    nvrtc = nvrtc_finder.find_nvrtc()
    target = target_for_device(nvrtc, device)
    check_driver_loads(nvrtc, target, nvrtc_finder.driver_cuda_version())
    return kernel_image(nvrtc, source, target).image


def target_for_arch(nvrtc, arch: int, ptx: bool = False) -> targets.Target:
    """What fills the cache for GPUs of `arch`: as image_for_device picks (a CUBIN, or PTX where this
    NVRTC does not know the arch); ptx=True: PTX for compute_<arch>, which a GPU newer than the
    NVRTC knows is given."""
    return targets.Target(arch, False) if ptx else targets.target_for(arch, supported_archs(nvrtc), nvrtc.version)


def compile_all(archs, ptx: bool = False, nvrtc=None, sources=None) -> list:
    """Fill the cache for GPUs of architectures `archs` (90 for sm_90), for every source (or
    `sources`), with the targets target_for_arch picks. A KernelImage per (arch, source), in that
    order; the first failure raises."""
    nvrtc = nvrtc or nvrtc_finder.find_nvrtc()
    folder = kernel_sources.kernels_dir()
    cache = kernel_cache_for_now()
    return [kernel_image(nvrtc, source, target_for_arch(nvrtc, arch, ptx), cache, folder)
            for arch in archs for source in (sources or kernel_sources.source_names())]


def cached_sources(device: int, nvrtc=None) -> dict:
    """{source: whether its image for GPU `device` is in the cache now}; reads, never compiles."""
    nvrtc = nvrtc or nvrtc_finder.find_nvrtc()
    target = target_for_device(nvrtc, device)
    cache = kernel_cache_for_now()
    found = {}
    for source in kernel_sources.source_names():
        name, key, _, _ = entry_for(nvrtc, source, target)
        found[source] = cache.lookup(name, key) is not None
    return found


"""hotloop's own kernels compile with both NVRTC wheels (CUDA 12 and 13), with no CUDA toolkit headers,
for sm_75, 80, 86, 89, 90 and 120 and as PTX for the newest arch each knows; each image holds every
extern "C" entry point C looks up in its source."""
import pytest

from hotloop import _C
from hotloop.rtc import images, kernel_cache, kernel_sources, targets

ARCHS = (75, 80, 86, 89, 90, 120)
PTX = "ptx"  # PTX for the newest arch the NVRTC knows: what a GPU newer than it is given


@pytest.fixture(scope="module")
def compiled(nvrtc_wheels, tmp_path_factory):
    """compiled(major, arch or PTX) -> {source: image or the exception}: each (NVRTC, target) pair compiled
    once for the module, into a cache of its own."""
    cache = kernel_cache.KernelCache(tmp_path_factory.mktemp("kernel-cache"))
    done = {}

    def compile_for(major, arch):
        if (major, arch) not in done:
            if major not in nvrtc_wheels:
                package = "nvidia-cuda-nvrtc-cu12" if major == 12 else "nvidia-cuda-nvrtc"
                pytest.skip(f"no CUDA {major} NVRTC wheel in site-packages (pip install {package})")
            nvrtc = nvrtc_wheels[major]
            target = targets.Target(max(nvrtc.supported_archs()), False) if arch == PTX else targets.Target(arch, True)
            results = {}
            for source in kernel_sources.source_names():
                try:
                    results[source] = images.kernel_image(nvrtc, source, target, cache).image
                except RuntimeError as exc:
                    results[source] = exc
            done[major, arch] = results
        return done[major, arch]

    return compile_for


def entry_names(source):
    return [name for s, name in getattr(_C, "KERNEL_NAMES", ()) if s == source]


@pytest.mark.parametrize("arch", ARCHS + (PTX,))
@pytest.mark.parametrize("major", [12, 13], ids=["nvrtc12", "nvrtc13"])
@pytest.mark.parametrize("source", kernel_sources.source_names())
def test_every_kernel_source_compiles(compiled, major, arch, source):
    image = compiled(major, arch)[source]
    if isinstance(image, Exception):
        raise image
    if arch == PTX:
        assert b".entry " in image and image.startswith(b"//")
        for name in entry_names(source):
            assert f".entry {name}(".encode() in image, f"{name} is not an entry point of {source}.cu"
    else:
        assert image[:4] == b"\x7fELF" and len(image) > 1000
        for name in entry_names(source):
            assert name.encode() + b"\0" in image, f"{name} is not in the cubin of {source}.cu"


def test_c_names_entry_points_of_every_source():
    if not hasattr(_C, "KERNEL_NAMES"):
        pytest.skip("this _C exports no KERNEL_NAMES yet")
    assert {source for source, _ in _C.KERNEL_NAMES} == set(kernel_sources.source_names())

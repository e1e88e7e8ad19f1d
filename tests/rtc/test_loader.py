"""What C asks for: the image for a device (CUBIN for its own architecture, else PTX for an older one),
compile_all for the CLI, what is in the cache per device, and `import hotloop` doing none of it."""
import ast
import subprocess
import sys

import pytest

from hotloop import _C
from hotloop.rtc import images, kernel_sources, loader, nvrtc_finder, targets


@pytest.mark.parametrize("arch,supported,expected", [
    (90, [75, 80, 86, 89, 90, 120], targets.Target(90, True)),
    (87, [75, 80, 86, 87, 89, 90], targets.Target(87, True)),
    (100, [75, 80, 86, 89, 90], targets.Target(90, False)),  # a GPU newer than this NVRTC: PTX the driver JITs
    (88, [75, 80, 86, 89, 90], targets.Target(86, False)),
])
def test_a_cubin_for_a_known_arch_else_ptx_for_the_newest_older_one(arch, supported, expected):
    assert targets.target_for(arch, supported) == expected


def test_a_gpu_older_than_every_arch_nvrtc_knows_is_an_error():
    with pytest.raises(RuntimeError, match="NVRTC 13.0 compiles for sm_75 and newer only; this GPU is sm_70"):
        targets.target_for(70, [75, 80, 90], (13, 0))


@pytest.fixture
def tiny_sources(monkeypatch, tiny_kernels, cache_dir, nvrtc):
    """The kernels folder and its source list are the tiny one's; NVRTC is `nvrtc`; one GPU of sm_86."""
    monkeypatch.setattr(kernel_sources, "kernels_dir", lambda: tiny_kernels)
    monkeypatch.setattr(kernel_sources, "source_names", lambda: ("tiny",))
    monkeypatch.setattr(nvrtc_finder, "find_nvrtc", lambda driver_version=None: nvrtc)
    monkeypatch.setattr(_C, "cuda_device_capability", lambda device: {0: (8, 6), 1: (9, 9)}[device], raising=False)
    monkeypatch.setattr(_C, "cuda_device_count", lambda: 1)
    return tiny_kernels


def test_load_kernel_image_compiles_for_the_device_then_reads_the_cache(tiny_sources, cache_dir, monkeypatch):
    monkeypatch.setattr(nvrtc_finder, "driver_cuda_version", lambda: 13000)
    image = loader.load_kernel_image(0, "tiny")
    assert image[:4] == b"\x7fELF" and b"tiny_scale" in image
    (entry,) = (cache_dir / "kernels").glob("tiny.sm_86.*.cubin")
    assert images.cached_sources(0) == {"tiny": True}
    assert loader.load_kernel_image(0, "tiny") == image


def test_an_arch_nvrtc_does_not_know_gets_ptx_when_the_driver_can_jit_it(tiny_sources, nvrtc, monkeypatch):
    newest = max(nvrtc.supported_archs())
    monkeypatch.setattr(_C, "cuda_device_capability", lambda device: divmod(newest + 9, 10), raising=False)
    major, minor = nvrtc.version
    monkeypatch.setattr(nvrtc_finder, "driver_cuda_version", lambda: major * 1000 + minor * 10)
    ptx = loader.load_kernel_image(0, "tiny")
    assert f".target sm_{newest}".encode() in ptx and b".entry tiny_scale" in ptx
    # PTX from an NVRTC newer than the driver would not JIT: said before the driver fails
    monkeypatch.setattr(nvrtc_finder, "driver_cuda_version", lambda: major * 1000 + minor * 10 - 10)
    with pytest.raises(RuntimeError, match=f"its kernels are compute_{newest} PTX, which needs a driver for CUDA {major}.{minor}"):
        loader.load_kernel_image(0, "tiny")


def test_compile_all_fills_the_cache_for_each_arch(tiny_sources, nvrtc):
    made = images.compile_all([80, 90], nvrtc=nvrtc)
    assert [(m.source, str(m.target), m.cached) for m in made] == [
        ("tiny", "sm_80 cubin", False), ("tiny", "sm_90 cubin", False)]
    again = images.compile_all([80, 90], nvrtc=nvrtc) + images.compile_all([90], ptx=True, nvrtc=nvrtc)
    assert [m.cached for m in again] == [True, True, False]
    assert b".entry tiny_scale" in again[2].image and all(m.seconds >= 0 for m in again)


def test_a_missing_source_is_named():
    with pytest.raises(ValueError, match="no kernel source 'no_such_kernel'"):
        kernel_sources.source_path("no_such_kernel")


def test_the_kernels_folder_is_found_in_the_source_checkout_or_the_package():
    folder = kernel_sources.kernels_dir()
    assert (folder / f"{kernel_sources.source_names()[0]}.cu").is_file()
    assert set(kernel_sources.source_names()) <= {p.stem for p in folder.glob("*.cu")}


def test_import_hotloop_compiles_nothing_and_loads_no_nvrtc():
    code = ("import sys, hotloop; print(sorted(m for m in sys.modules if m.startswith('hotloop.rtc'))); "
            "print(any('libnvrtc' in line for line in open('/proc/self/maps')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    modules, nvrtc_loaded = out.splitlines()
    assert set(ast.literal_eval(modules)) <= {"hotloop.rtc", "hotloop.rtc.loader"} and nvrtc_loaded == "False"

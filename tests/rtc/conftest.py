"""Fixtures for the run-time compile tests: the two NVRTC wheels (CUDA 12 and 13) found through hotloop's
finder, a tiny kernels folder of our own (the machinery tested apart from hotloop's kernels), and a
cache folder per test."""
import os
import random

import pytest

from hotloop.rtc import kernel_cache, nvrtc_finder

TINY_KERNEL = """// a kernel of the tests: scale, then add the constant of its header
#include "tiny.h"

extern "C" __global__ void tiny_scale(float *x, float a, long long n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (size_t)n)
        x[i] = __fadd_rn(powf(x[i], a), TINY_OFFSET);
}
"""


@pytest.fixture(scope="session")
def nvrtc_wheels():
    """{CUDA major: the opened _C.Nvrtc of its pip wheel}, as the finder sees site-packages."""
    found = {}
    for candidate in nvrtc_finder.nvrtc_candidates(driver_version=None):
        if candidate.origin.startswith("pip ") and candidate.major not in found:
            found[candidate.major] = nvrtc_finder.open_nvrtc(candidate.path)
    return found


# the pip package of each CUDA major's NVRTC
WHEEL_PACKAGES = {12: "nvidia-cuda-nvrtc-cu12", 13: "nvidia-cuda-nvrtc"}


def wheel(nvrtc_wheels, major):
    if major not in nvrtc_wheels:
        pytest.skip(f"no CUDA {major} NVRTC wheel in site-packages (pip install {WHEEL_PACKAGES[major]})")
    return nvrtc_wheels[major]


@pytest.fixture(params=[12, 13], ids=["nvrtc12", "nvrtc13"])
def nvrtc(request, nvrtc_wheels):
    return wheel(nvrtc_wheels, request.param)


@pytest.fixture
def tiny_kernels(tmp_path):
    """A kernels folder holding tiny.cu and its header tiny.h, with a fresh constant each run."""
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "tiny.cu").write_text(TINY_KERNEL)
    (folder / "tiny.h").write_text(f"#define TINY_OFFSET {random.uniform(1, 2):.6f}f\n")
    return folder


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """HOTLOOP_CACHE_DIR for this test alone."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("HOTLOOP_CACHE_DIR", os.fspath(folder))
    return folder


@pytest.fixture
def fresh_cache(cache_dir):
    return kernel_cache.KernelCache(kernel_cache.cache_folder())

"""_C.Nvrtc, one NVRTC opened by dlopen: versions, architectures, CUBIN and PTX out, the log in a compile
error, a library that is not NVRTC, both wheels in one process, and the GIL released while it compiles."""
import importlib.metadata
import re
import threading
import time

import pytest

from hotloop import _C

from .conftest import TINY_KERNEL, WHEEL_PACKAGES


def test_version_and_archs_say_which_nvrtc_it_is(nvrtc):
    major, minor = nvrtc.version
    assert f".so.{major}" in nvrtc.path
    # the wheel is versioned as the CUDA release its NVRTC comes from (12.9.86: NVRTC 12.9)
    release = importlib.metadata.version(WHEEL_PACKAGES[major])
    assert (major, minor) == tuple(int(v) for v in release.split(".")[:2]), release
    archs = nvrtc.supported_archs()
    assert archs == sorted(archs) and {75, 80, 86, 89, 90, 120} <= set(archs)


def test_cubin_and_ptx_of_a_kernel(nvrtc, tiny_kernels):
    source = (tiny_kernels / "tiny.cu").read_bytes()
    options = ["-std=c++17", "--fmad=true", "-I" + str(tiny_kernels)]
    cubin = nvrtc.compile(source, "tiny.cu", options + ["-arch=sm_90"], True)
    ptx = nvrtc.compile(source, "tiny.cu", options + ["-arch=compute_90"], cubin=False)
    assert cubin[:4] == b"\x7fELF" and b"tiny_scale" in cubin
    assert b".target sm_90" in ptx and b".entry tiny_scale" in ptx and not ptx.endswith(b"\0")


def test_a_compile_error_carries_the_whole_log_and_the_source_name(nvrtc):
    broken = b'extern "C" __global__ void k(float *x) { x[0] = undeclared_one; }\n__device__ int also_bad = ;\n'
    with pytest.raises(RuntimeError) as caught:
        nvrtc.compile(broken, "broken_kernel.cu", ["-arch=sm_80"], True)
    message = str(caught.value)
    assert "nvrtcCompileProgram" in message and "broken_kernel.cu" in message and "NVRTC_ERROR_COMPILATION" in message
    assert 'identifier "undeclared_one" is undefined' in message and "2 errors detected" in message


def test_an_unknown_option_and_a_cubin_of_a_virtual_arch_are_errors(nvrtc, tiny_kernels):
    source = (tiny_kernels / "tiny.cu").read_bytes()
    with pytest.raises(RuntimeError, match="unrecognized option -no-such-option"):
        nvrtc.compile(source, "tiny.cu", ["-no-such-option"], True)
    with pytest.raises(RuntimeError, match="a CUBIN needs -arch=sm_XX"):
        nvrtc.compile(source, "tiny.cu", ["-arch=compute_80", "-I" + str(tiny_kernels)], True)
    with pytest.raises(TypeError, match=r"options\[1\]"):
        nvrtc.compile(source, "tiny.cu", ["-arch=sm_80", 80], True)
    with pytest.raises(ValueError, match="NUL"):
        nvrtc.compile(b"__global__ void k() {}\0", "nul.cu", [], True)


def test_a_file_that_is_not_nvrtc_is_refused_by_path(tmp_path):
    not_a_library = tmp_path / "libnvrtc.so.12"
    not_a_library.write_bytes(b"not an ELF file\n" * 256)
    with pytest.raises(RuntimeError, match=f"NVRTC {re.escape(str(not_a_library))} cannot be used: dlopen: .*invalid ELF"):
        _C.Nvrtc(not_a_library)
    with pytest.raises(RuntimeError, match="no such file|No such file"):
        _C.Nvrtc(tmp_path / "missing.so")


def test_both_wheels_compile_in_one_process(nvrtc_wheels, tiny_kernels):
    if len(nvrtc_wheels) < 2:
        pytest.skip(f"needs both NVRTC wheels; found CUDA {sorted(nvrtc_wheels)}")
    source = (tiny_kernels / "tiny.cu").read_bytes()
    options = ["-arch=compute_80", "-I" + str(tiny_kernels)]
    ptx = {major: n.compile(source, "tiny.cu", options, False) for major, n in nvrtc_wheels.items()}
    for major, text in ptx.items():
        assert b".entry tiny_scale" in text
    versions = {text.split(b".version ")[1].split(b"\n")[0] for text in ptx.values()}
    assert len(versions) == 2  # each library's own PTX ISA version: two NVRTCs really ran


def count_until(stop):
    """How many times this thread looped until stop() said so, and for how long."""
    counted, started = 0, time.perf_counter()
    while not stop():
        counted += 1
    return counted, time.perf_counter() - started


def test_the_gil_is_released_while_nvrtc_compiles(nvrtc):
    # enough template instances to keep NVRTC busy for a while
    source = TINY_KERNEL.replace('#include "tiny.h"', "#define TINY_OFFSET 1.0f") + "".join(
        f'template <int N> __device__ float f{i}(float x) {{ return N > 0 ? f{i}<N - 1>(x) * 1.0001f + {i} : x; }}\n'
        f'template <> __device__ float f{i}<0>(float x) {{ return x; }}\n'
        f'extern "C" __global__ void k{i}(float *x) {{ x[{i}] = f{i}<60>(x[0]); }}\n' for i in range(20))
    deadline = time.perf_counter() + 0.05
    alone, alone_seconds = count_until(lambda: time.perf_counter() > deadline)
    done = threading.Event()
    result = []
    worker = threading.Thread(target=lambda: (result.append(nvrtc.compile(source.encode(), "busy.cu",
                                                                           ["-arch=sm_80"], True)), done.set()))
    worker.start()
    beside, beside_seconds = count_until(done.is_set)
    worker.join()
    assert result and result[0][:4] == b"\x7fELF"
    # holding the GIL, the compile would leave this thread a few switch intervals of its whole time
    assert beside_seconds > 0.1 and beside / beside_seconds > 0.3 * alone / alone_seconds

"""The driver API by dlopen, without a GPU: a missing driver, a failing cuInit, and a fake libcuda through which
the kernels are compiled by NVRTC, loaded and found by name, and errors name the driver's call."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import hotloop

FAKE_CUDA_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda", "fake_cuda.c")

needs_cuda_build = pytest.mark.skipif(hotloop.build_info()["cuda"] is None,
                                      reason="a HOTLOOP_CUDA=0 build never opens the driver")


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    path = str(tmp_path_factory.mktemp("fake_cuda") / "libfake_cuda.so")
    subprocess.check_call([cc, "-shared", "-fPIC", "-O1", "-std=c11", "-o", path, FAKE_CUDA_SOURCE])
    return path


def run(script, **env):
    """`script` in a fresh interpreter (the driver is opened once per process) with `env` added;
    the JSON it prints last."""
    full = dict(os.environ, **env)
    full.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         env=full, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


REASON_SCRIPT = """
    import json, hotloop
    from hotloop.amp import tensor_table
    import torch, struct
    fields = list(struct.unpack("4q", tensor_table.pack([torch.ones(4)]))); fields[3] = 0
    try:
        hotloop._C.non_finite_check(struct.pack("4q", *fields), None, None, 0)
        refused = None
    except RuntimeError as err:
        refused = str(err)
    print(json.dumps({"reason": hotloop._C.cuda_unavailable_reason(), "count": hotloop._C.cuda_device_count(),
                      "available": hotloop.cuda_available(), "refused": refused,
                      "version": hotloop._C.cuda_driver_version()}))
"""


@needs_cuda_build
def test_no_driver_library_says_so(tmp_path):
    got = run(REASON_SCRIPT, HOTLOOP_LIBCUDA=str(tmp_path / "libcuda.so.1"))
    assert got["available"] is False and got["count"] == 0 and got["version"] is None
    assert got["reason"].startswith("no CUDA driver found") and "libcuda.so.1" in got["reason"]
    assert got["refused"].startswith("no CUDA driver found"), got


@needs_cuda_build
def test_a_failing_cuinit_is_named(fake_cuda):
    got = run(REASON_SCRIPT, HOTLOOP_LIBCUDA=fake_cuda, FAKE_CUDA_INIT="100", FAKE_CUDA_VERSION="12020")
    assert got["available"] is False and got["count"] == 0
    assert "cuInit failed with CUDA_ERROR_NO_DEVICE (100)" in got["reason"]
    assert "no CUDA driver found" in got["refused"] and "CUDA_ERROR_NO_DEVICE" in got["refused"]
    assert got["version"] == 12020  # a driver whose cuInit failed still says its version


FAKE_SCRIPT = """
    import ctypes, json, os, hotloop
    from hotloop import _C
    fake = ctypes.CDLL(os.environ["HOTLOOP_LIBCUDA"])
    fake.fake_cuda_last_launch.restype = ctypes.c_char_p
    out = {"reason": _C.cuda_unavailable_reason(), "count": _C.cuda_device_count(),
           "capability": list(_C.cuda_device_capability(1)), "version": _C.cuda_driver_version()}
    event = _C.cuda_event_create(0)
    _C.cuda_event_record(event, 0)
    out["query"] = _C.cuda_event_query(event)
    out["events_live"] = fake.fake_cuda_events_live()
    _C.cuda_event_destroy(event)
    out["events_after"] = fake.fake_cuda_events_live()
    buf = ctypes.create_string_buffer(64)
    _C.cuda_host_register(ctypes.addressof(buf), 64)
    out["registered"] = fake.fake_cuda_host_registered()
    src, dst = ctypes.create_string_buffer(b"copied by the driver", 32), ctypes.create_string_buffer(32)
    _C.cuda_memcpy_htod_async(ctypes.addressof(dst), ctypes.addressof(src), 32, 0)
    out["copied"] = dst.value.decode()
    try:
        _C.cuda_device_capability(2)
    except ValueError as err:
        out["no_device"] = str(err)
    loads = []
    real = _C.set_kernel_loader
    from hotloop.rtc import loader
    def counting(device, source):
        loads.append([device, source])
        return loader.load_kernel_image(device, source)
    _C.set_kernel_loader(counting)
    for source in _C.KERNEL_SOURCES:
        _C.kernels_load(1, source)
        _C.kernels_load(1, source)  # loaded once: the loader is not asked again
    out["loads"] = loads
    out["loaded"] = _C.kernels_loaded(1)
    out["loaded_elsewhere"] = _C.kernels_loaded(0)
    out["modules"] = fake.fake_cuda_modules_loaded()
    out["functions"] = fake.fake_cuda_functions_found()
    try:
        _C.kernels_load(0, "no_such_source")
    except ValueError as err:
        out["bad_source"] = str(err)
    print(json.dumps(out))
"""


@needs_cuda_build
def test_fake_driver_events_copies_and_kernels_by_name(fake_cuda, tmp_path):
    pytest.importorskip("hotloop.rtc")
    got = run(FAKE_SCRIPT, HOTLOOP_LIBCUDA=fake_cuda, FAKE_CUDA_DEVICES="2", FAKE_CUDA_CC="86",
              FAKE_CUDA_VERSION="12080", HOTLOOP_CACHE_DIR=str(tmp_path / "cache"))
    assert got["reason"] is None and got["count"] == 2 and got["capability"] == [8, 6]
    assert got["version"] == 12080
    assert got["query"] is True and got["events_live"] == 1 and got["events_after"] == 0
    assert got["registered"] == 1
    assert got["copied"] == "copied by the driver"
    assert got["no_device"] == "no CUDA device 2: this machine has 2"
    sources = list(hotloop._C.KERNEL_SOURCES)
    assert got["loads"] == [[1, s] for s in sources]
    assert sorted(got["loaded"]) == sorted(sources) and got["loaded_elsewhere"] == []
    # every entry point of the table was found by name in the image NVRTC made
    assert got["modules"] == len(sources) and got["functions"] == len(hotloop._C.KERNEL_NAMES)
    assert "no_such_source" in got["bad_source"]


FAIL_SCRIPT = """
    import json, hotloop
    from hotloop import _C
    event = _C.cuda_event_create(0)
    try:
        _C.cuda_event_record(event, 0)
    except hotloop.CudaError as err:
        print(json.dumps({"message": str(err), "name": err.error_name, "call": err.call, "code": err.code,
                          "file": err.file, "line": err.line}))
"""


@needs_cuda_build
def test_a_failed_driver_call_becomes_cuda_error_naming_it(fake_cuda):
    got = run(FAIL_SCRIPT, HOTLOOP_LIBCUDA=fake_cuda, FAKE_CUDA_FAIL="cuEventRecord:700")
    assert got["call"] == "cuEventRecord" and got["code"] == 700
    assert got["name"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert got["message"].startswith("cuEventRecord failed with CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory")
    assert got["file"].endswith("csrc/cuda.c") and got["line"] > 0

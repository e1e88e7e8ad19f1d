"""Test set-up: every test runs under a fresh seed that its failure prints (tests/seeding.py); `gpu`-marked
tests skip unless hotloop and torch can both use a CUDA device; a fake NVML library for the monitor and
the command line (fake_nvml/fake_nvml.c); under AddressSanitizer, torch's reference loaders wait for their
feeder threads at shutdown (see the end)."""
import ctypes
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

import hotloop

from . import seeding


@pytest.fixture(autouse=True)
def hotloop_seed(request):
    """Seeds torch, random and numpy with a fresh seed (or HOTLOOP_TEST_SEED) before the test; the
    report of a failing test says which (pytest_runtest_makereport, below)."""
    seed = seeding.fresh_seed("HOTLOOP_TEST_SEED")
    request.node.hotloop_seed = seed
    seeding.seed_test(seed)
    return seed


@pytest.fixture(scope="module")
def module_seed(request):
    """For a module-scoped fixture that draws random data: seeds torch, random and numpy with a fresh
    seed (or HOTLOOP_MODULE_SEED) before it draws; the report of a failing test that used it says which.
    (The test's own seed is set after it, as function-scoped fixtures come after module-scoped ones.)"""
    seed = seeding.fresh_seed("HOTLOOP_MODULE_SEED")
    seeding.seed_everything(seed)
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report gets a "seed" section: its seed and how to run it again under it."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or not hasattr(item, "hotloop_seed"):
        return
    rerun = f"HOTLOOP_TEST_SEED={item.hotloop_seed}"
    if "module_seed" in getattr(item, "funcargs", {}):
        rerun += f" HOTLOOP_MODULE_SEED={item.funcargs['module_seed']}"
    report.sections.append(("seed", f"seed: {item.hotloop_seed} (rerun with {rerun})"))


def gpu_usable() -> bool:
    return hotloop.cuda_available() and torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if gpu_usable():
        return
    reason = hotloop._C.cuda_unavailable_reason() or "torch cannot see a CUDA device"
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


FAKE_NVML_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_nvml", "fake_nvml.c")


@pytest.fixture(scope="session")
def fake_nvml_library(tmp_path_factory):
    """The path of the fake NVML, compiled for this session: hotloop opens it when HOTLOOP_NVML_LIBRARY
    names it, and FakeNvml scripts what it reports."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the fake NVML")
    path = str(tmp_path_factory.mktemp("fake_nvml") / "libfake_nvml.so")
    subprocess.check_call([cc, "-shared", "-fPIC", "-O1", "-std=c11", "-o", path, FAKE_NVML_SOURCE])
    return path


class FakeNvml:
    """The fake library's control functions (the same loaded copy hotloop._C opens by path)."""

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.fake_nvml_set.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_longlong]
        self.lib.fake_nvml_get.argtypes = [ctypes.c_int, ctypes.c_char_p]
        self.lib.fake_nvml_get.restype = ctypes.c_longlong
        self.lib.fake_nvml_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_longlong]
        self.lib.fake_nvml_set_device_count.argtypes = [ctypes.c_int]

    def reset(self):
        self.lib.fake_nvml_reset()

    def set(self, field, value, device=0):
        assert self.lib.fake_nvml_set(device, field.encode(), int(value)) == 0, field

    def get(self, field, device=0):
        return self.lib.fake_nvml_get(device, field.encode())

    def fail(self, function, code, after=0):
        assert self.lib.fake_nvml_fail(function.encode(), code, after) == 0

    def set_device_count(self, n):
        self.lib.fake_nvml_set_device_count(n)


def _wait_thread_gone(native_id, timeout=5.0):
    """Until the OS thread is gone: past Thread.join it still runs its exit (the sanitizer's part of it)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/self/task/{native_id}") and time.monotonic() < deadline:
        time.sleep(0.001)


def _shutdown_and_join_feeders(shutdown):
    def shutdown_workers(self):
        shutdown(self)
        for queue in getattr(self, "_index_queues", ()):
            thread = getattr(queue, "_thread", None)
            # the garbage collector may run this shutdown in that very thread (it pickles)
            if thread is not None and thread is not threading.current_thread():
                thread.join(5.0)
                _wait_thread_gone(thread.native_id)

    return shutdown_workers


# torch's reference loaders leave their index queues' feeder threads running past shutdown, and a
# test forks hotloop's workers right after. GCC 12's AddressSanitizer has no fork handler for its
# allocator (no lock taken around fork()): a child forked while such a thread is in malloc waits on
# that lock forever (seen in CI: worker 0 stuck in the allocator's mutex, its test timed out).
# glibc's malloc is fork-safe, so only the sanitizer build needs torch's shutdown to wait for those
# threads to be gone.
if "address" in hotloop.build_info()["sanitizers"]:
    _MPIter = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
    _MPIter._shutdown_workers = _shutdown_and_join_feeders(_MPIter._shutdown_workers)

"""The memory tests' fakes: the fake NVML (the only GPU the monitor's tests see, scripted per test), torch's
allocator answering scripted figures, a step with a known memory limit for the batch-size finder."""
import time
import types
import weakref

import pytest
import torch

from ..conftest import FakeNvml

GiB, MiB = 2**30, 2**20


@pytest.fixture
def fake(fake_nvml_library, monkeypatch):
    monkeypatch.setenv("HOTLOOP_NVML_LIBRARY", fake_nvml_library)
    # the fake GPU is the only one: on a machine with a real GPU, torch must not mix its figures in
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    f = FakeNvml(fake_nvml_library)
    f.reset()
    yield f
    f.reset()


CAPACITY, BASELINE = 80 * GiB, 4 * GiB


class FakeMemory:
    """What torch's allocator would say: the step sets the peak, reset() goes back to the baseline."""

    def __init__(self, capacity=CAPACITY, baseline=BASELINE):
        self.cap, self.base, self.current = capacity, baseline, baseline
        self.resets = 0

    def reset(self):
        self.current = self.base
        self.resets += 1

    def in_use(self):
        return self.base

    def peak(self):
        return self.current


FakeMemory.capacity = lambda self: self.cap


class FakeStep:
    """A training step whose peak is peak_of(size); above the capacity it raises as torch does, with
    a tensor of its own in the failing frame (the finder must let it go)."""

    def __init__(self, memory, peak_of, error=None):
        self.memory, self.peak_of, self.error = memory, peak_of, error
        self.sizes, self.lost = [], []

    def __call__(self, size):
        self.sizes.append(size)
        need = self.peak_of(size)
        activations = torch.empty(16)
        if need > self.memory.cap:
            self.lost.append(weakref.ref(activations))
            raise self.error or torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {need / GiB:.2f} GiB")
        self.memory.current = max(self.memory.current, need)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the sampler"
        time.sleep(0.005)


class ScriptedAllocator:
    """torch.cuda's allocator queries answering scripted figures, so the CUDA code path runs on a CPU."""

    def __init__(self, reserved0, peak_allocated, peak_reserved):
        self.reserved0, self.peak_allocated, self.peak_reserved = reserved0, peak_allocated, peak_reserved
        self.synced = 0

    def install(self, monkeypatch):
        cuda = torch.cuda
        props = types.SimpleNamespace(uuid="fake-0")
        for name, fn in {
            "is_available": lambda: True, "current_device": lambda: 0, "get_device_properties": lambda d: props,
            "synchronize": lambda d=None: setattr(self, "synced", self.synced + 1),
            "reset_peak_memory_stats": lambda d=None: None, "memory_reserved": lambda d=None: self.reserved0,
            "memory_allocated": lambda d=None: self.peak_allocated // 2,
            "max_memory_allocated": lambda d=None: self.peak_allocated,
            "max_memory_reserved": lambda d=None: self.peak_reserved, "get_device_name": lambda d=None: "Scripted",
            "memory_stats": lambda d=None: {"num_alloc_retries": 2, "num_ooms": 0,
                                            "inactive_split_bytes.all.peak": 123 * MiB},
        }.items():
            monkeypatch.setattr(cuda, name, fn)

"""The monitor's tests run against the fake NVML: the only GPU they see, scripted per test."""
import pytest
import torch

from ..conftest import FakeNvml


@pytest.fixture
def fake(fake_nvml_library, monkeypatch):
    monkeypatch.setenv("HOTLOOP_NVML_LIBRARY", fake_nvml_library)
    # the fake GPU is the only one: on a machine with a real GPU, torch must not mix its figures in
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    f = FakeNvml(fake_nvml_library)
    f.reset()
    yield f
    f.reset()

"""`import hotloop` widens CUDA's hardware queues only where the user chose none and CUDA has not
started (NOTE [ Hardware queues ] in hotloop/cuda_queues.py)."""
import os
import subprocess
import sys
import types

import pytest

from hotloop import cuda_queues

PROBE = "import os, hotloop; print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'), hotloop.cuda_queues.set_by_hotloop)"


def run_import(env_value):
    env = {k: v for k, v in os.environ.items() if k != cuda_queues.VARIABLE}
    if env_value is not None:
        env[cuda_queues.VARIABLE] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_import_asks_for_the_most_queues_where_unset():
    assert run_import(None) == ["32", "True"]


def test_import_keeps_the_users_choice():
    assert run_import("8") == ["8", "False"]
    assert run_import("1") == ["1", "False"]


@pytest.mark.parametrize("torch_started", [True, False])
def test_set_only_before_torch_starts_cuda(monkeypatch, torch_started):
    monkeypatch.delenv(cuda_queues.VARIABLE, raising=False)
    monkeypatch.setattr(cuda_queues, "set_by_hotloop", False)
    stand_in = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: torch_started))
    monkeypatch.setitem(sys.modules, "torch", stand_in)
    cuda_queues.widen()
    assert os.environ.get(cuda_queues.VARIABLE) == (None if torch_started else cuda_queues.WIDEST)
    assert cuda_queues.set_by_hotloop is not torch_started


def test_a_decoder_warns_once_where_hotloop_came_too_late(monkeypatch, recwarn):
    monkeypatch.delenv(cuda_queues.VARIABLE, raising=False)
    monkeypatch.setattr(cuda_queues, "_warned", False)
    cuda_queues.warn_if_narrow("gpu_decode")
    cuda_queues.warn_if_narrow("gpu_decode")
    caught = [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "gpu_decode" in text and "CUDA_DEVICE_MAX_CONNECTIONS=32" in text


def test_no_warning_for_a_value_someone_set(monkeypatch, recwarn):
    monkeypatch.setenv(cuda_queues.VARIABLE, "8")
    monkeypatch.setattr(cuda_queues, "_warned", False)
    cuda_queues.warn_if_narrow("gpu_decode")
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]

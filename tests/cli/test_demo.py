"""`python -m hotloop demo`, the README's first command: it runs without a GPU, shows both loops and
what hotloop measured, and refuses bad options in one line."""
import re
import subprocess
import sys

import pytest
import torch


def demo(*args, env=None):
    return subprocess.run([sys.executable, "-m", "hotloop", "demo", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_demo_on_the_cpu_trains_both_loops_alike():
    out = demo("--device", "cpu", "--steps", "6", "--batch-size", "16", "--workers", "1")
    assert out.returncode == 0, out.stderr
    for row in ("samples/s", "seconds", "waiting for data, s", "first loss", "last loss"):
        assert re.search(rf"^  {re.escape(row)} +\d+\.\d{{3}} +\d+\.\d{{3}}", out.stdout, re.M), out.stdout
    assert re.search(r"^  loader: 6 batches, waited \d+\.\d\d s", out.stdout, re.M), out.stdout
    # the same seed, the same batches and bit-identical normalisation: the same loss in every step
    assert "losses: the same in every step" in out.stdout
    assert "6/6 steps" in out.stderr  # the progress line's end


@pytest.mark.parametrize("args, words", [
    (("--device", "tpu"), "--device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (("--device", "cpu", "--steps", "0"), "--steps: expected a number >= 1, got 0"),
    (("--device", "cpu", "--workers", "-1"), "--workers: expected a number >= 0, got -1"),
])
def test_demo_refuses_bad_options_in_one_line(args, words):
    out = demo(*args)
    assert out.returncode == 2
    assert out.stderr.strip() == f"hotloop demo: {words}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_demo_asked_for_cuda_without_a_gpu():
    out = demo("--device", "cuda")
    assert out.returncode == 2
    assert out.stderr.startswith("hotloop demo: --device cuda: no usable GPU here (") and "Traceback" not in out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_demo_on_the_gpu_shows_the_monitor_loader_and_scaler():
    out = demo("--steps", "40", "--workers", "4")
    assert out.returncode == 0, out.stderr
    assert "host-to-device" in out.stdout and re.search(r"^  scaler: scale \d+, skipped steps \d+", out.stdout, re.M)
    assert "peak" in out.stderr.lower()  # the memory monitor's report
    assert "losses: within" in out.stdout

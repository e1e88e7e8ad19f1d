"""The command line: --version, info (text and JSON) and the bench harness, run as a user would."""
import json
import os
import subprocess
import sys

import pytest

import hotloop
from hotloop.bench.harness import Row, format_table


def run_cli(*args, timeout=300):
    out = subprocess.run([sys.executable, "-m", "hotloop", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_version():
    assert run_cli("--version").strip() == f"hotloop {hotloop.__version__}"


def test_info_text_says_what_was_built():
    text = run_cli("info")
    assert "stable ABI (abi3)     yes" in text
    assert "hotloop can use CUDA" in text
    assert ("yes" in text.split("hotloop can use CUDA")[1].splitlines()[0]) == hotloop.cuda_available()


def test_info_json_matches_build_info():
    facts = json.loads(run_cli("info", "--json"))
    assert facts["build"] == hotloop.build_info()
    assert facts["hotloop"] == hotloop.__version__
    assert (facts["cuda_unavailable_reason"] is None) == hotloop.cuda_available()


def test_bench_components_quick_on_cpu_prints_ratios():
    text = run_cli("bench", "components", "--quick", "--only", "ops", "--device", "cpu")
    table = text.split("\n\n", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("ops ")]
    assert len(rows) == 2
    for line in rows:
        cells = line.split()
        unit_at = next(i for i, c in enumerate(cells) if c in ("ms", "GB/s"))
        hotloop_value, torch_value, ratio = float(cells[unit_at - 2]), float(cells[unit_at - 1]), float(cells[unit_at + 1])
        assert hotloop_value > 0 and torch_value > 0
        assert ratio == pytest.approx(hotloop_value / torch_value, rel=2e-3, abs=1e-3)


def test_bench_rejects_unknown_component():
    out = subprocess.run([sys.executable, "-m", "hotloop", "bench", "components", "--only", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.mark.parametrize("unit,hotloop_value,torch_value,ratio,better", [
    ("ms", 2.0, 4.0, 0.5, 2.0), ("GB/s", 3000.0, 1500.0, 2.0, 2.0), ("img/s", 100.0, 200.0, 0.5, 0.5)])
def test_row_ratio_and_speedup(unit, hotloop_value, torch_value, ratio, better):
    row = Row("x", "figure", hotloop_value, torch_value, unit)
    assert row.ratio == pytest.approx(ratio) and row.speedup == pytest.approx(better)
    assert f"{ratio:.3f}" in format_table([row]) and f"{better:.2f}x" in format_table([row])


def run_failing(*args, env=None, code=None):
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    if code is not None:
        assert p.returncode == code, p.stderr
    return p


def test_no_command_prints_help_and_exits_2():
    p = run_failing("-m", "hotloop", code=2)
    assert "usage: python -m hotloop" in p.stderr


def test_console_script_names_itself():
    script = os.path.join(os.path.dirname(sys.executable), "hotloop")
    if not os.path.exists(script):
        pytest.skip("the hotloop console script is not installed beside this python")
    p = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("usage: hotloop ")


@pytest.mark.parametrize("device", ["bogus", "cuda:x"])
def test_bench_with_a_device_that_is_not_one(device):
    p = run_failing("-m", "hotloop", "bench", "components", "--quick", "--device", device, code=2)
    assert "--device" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_bench_on_cuda_without_a_gpu():
    if hotloop.cuda_available():
        pytest.skip("this machine has a GPU")
    p = run_failing("-m", "hotloop", "bench", "components", "--quick", "--device", "cuda", code=2)
    assert "GPU" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_bench_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from hotloop.cli import main\n"
            "sys.exit(main(['bench', 'components', '--quick']))")
    p = run_failing("-c", code, code=2)
    assert "torch" in p.stderr and len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("opens", [("hardware", "hybrid"), ("hybrid",), ()])
def test_info_names_the_decoder_auto_takes(monkeypatch, opens):
    """info's per-GPU JPEG decoder is gpu_decode auto's: the engines, else the hybrid backend, else the
    workers, with every refusal said (nvjpeg stood in for: no GPU here)."""
    from hotloop import _C
    from hotloop.cli import info

    class StandIn:
        def __init__(self, paths, device, backend, max_batch):
            if backend not in opens:
                raise _C.NvjpegError(f"nvjpegCreateEx: no {backend} today\nsecond line")

        def close(self):
            pass

    monkeypatch.setattr(_C, "JpegDecoder", StandIn)
    said = info._jpeg_decoder(0)
    if "hardware" in opens:
        assert said == "nvjpeg hardware"
    elif opens:
        assert said == "nvjpeg hybrid (no hardware JPEG decoder: nvjpegCreateEx: no hardware today)"
    else:
        assert said == ("workers (no hardware JPEG decoder: nvjpegCreateEx: no hardware today; nvjpeg hybrid: "
                        "nvjpegCreateEx: no hybrid today)")

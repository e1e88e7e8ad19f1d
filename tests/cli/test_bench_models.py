"""`bench train`, `bench loop` and `bench inference` on the CPU with the tiny models (tables, CSV, JSON,
PNG written), bad input as one line and a non-zero exit, and the GPU runs under the `gpu` marker."""
import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import hotloop


def bench(*args, ok=True, timeout=300):
    p = subprocess.run([sys.executable, "-m", "hotloop", "bench", *args], capture_output=True, text=True,
                       timeout=timeout)
    if ok:
        assert p.returncode == 0, p.stderr
    else:
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    return p


def table_rows(stdout):
    lines = stdout.split("\n\n", 1)[1].strip().splitlines()
    assert lines[1].startswith("---")
    return [line.split() for line in lines[2:]]


def test_train_on_the_cpu_writes_table_csv_json_and_plot(tmp_path):
    out = tmp_path / "t"
    plot = importlib.util.find_spec("matplotlib") is not None
    args = ["train", "--model", "tiny-cnn", "--device", "cpu", "--precision", "fp32,bf16", "--batch-size", "4,8",
            "--steps", "2", "--csv", f"{out}.csv", "--json", f"{out}.json"] + (["--plot", f"{out}.png"] if plot else [])
    p = bench(*args)
    rows = table_rows(p.stdout)
    assert [(r[0], int(r[1])) for r in rows] == [("fp32", 4), ("fp32", 8), ("bf16", 4), ("bf16", 8)]
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0
        assert r[4:8] == ["-"] * 4  # no GPU: no peak, utilisation, power, samples per joule
    assert [r[8] for r in rows[:2]] == ["1.00x", "1.00x"]
    # the speed-up is shown to 2 decimals (0.12x for 0.1172): rounding, then the rates' own rounding
    assert float(rows[2][8][:-1]) == pytest.approx(float(rows[2][3]) / float(rows[0][3]), rel=0.02, abs=0.0051)
    with open(f"{out}.csv") as f:
        written = list(csv.DictReader(f))
    assert [(w["precision"], int(w["batch_size"])) for w in written] == [(r[0], int(r[1])) for r in rows]
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["model"] == "tiny-cnn" and len(data["rows"]) == 4 and data["rows"][0]["steps"] == 2
    # the table rounds ms to 0.1: rates are checked at full precision
    for r, shown in zip(data["rows"], rows, strict=True):
        assert r["ms_per_step"] > 0 and r["samples_per_s"] == pytest.approx(r["batch_size"] * 1e3 / r["ms_per_step"])
        assert float(shown[3]) == pytest.approx(r["samples_per_s"], abs=0.051)
    if plot:
        assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[4/4]" in p.stderr  # the progress lines


def test_train_a_tiny_gpt_on_the_cpu():
    rows = table_rows(bench("train", "--model", "tiny-gpt", "--device", "cpu", "--precision", "fp32",
                            "--batch-size", "2", "--steps", "2").stdout)
    assert len(rows) == 1 and rows[0][:2] == ["fp32", "2"] and float(rows[0][3]) > 0


def test_loop_on_the_cpu(tmp_path):
    p = bench("loop", "--case", "tiny-cnn", "--device", "cpu", "--steps", "2", "--workers", "1",
              "--json", str(tmp_path / "l.json"))
    runs = json.loads((tmp_path / "l.json").read_text())["runs"]
    assert [r["loop"] for r in runs] == ["torch", "hotloop"]
    for r in runs:
        assert r["total_s"] > 0 and r["samples_per_s"] == pytest.approx(r["batch_size"] * 2 / r["total_s"])
        assert 0 <= r["data_wait_s"] <= r["total_s"] and r["optimizer_s"] > 0
    # the same model, data and seed: the same loss after the same steps (bf16 autocast on both)
    assert runs[0]["final_loss"] == pytest.approx(runs[1]["final_loss"], rel=0.05)
    assert runs[1]["loader_stats_wait_s"] > 0
    ratio = runs[1]["samples_per_s"] / runs[0]["samples_per_s"]
    assert f"hotloop ÷ torch: {ratio:.3f}x" in p.stdout


def test_loop_jpeg_case_on_the_cpu(tmp_path):
    """JPEG files through torchvision's transform in torch's workers and through gpu_decode (its CPU
    path here): the same crops for the same seed, so the same loss; the files are removed after."""
    pytest.importorskip("torchvision")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    p = subprocess.run([sys.executable, "-m", "hotloop", "bench", "loop", "--case", "tiny-cnn-jpeg", "--device",
                        "cpu", "--steps", "2", "--workers", "2", "--json", str(tmp_path / "l.json")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(scratch)})
    assert p.returncode == 0, p.stderr
    runs = json.loads((tmp_path / "l.json").read_text())["runs"]
    assert [(r["case"], r["loop"]) for r in runs] == [("tiny-cnn-jpeg", "torch"), ("tiny-cnn-jpeg", "hotloop")]
    assert runs[0]["final_loss"] == pytest.approx(runs[1]["final_loss"], rel=1e-3)  # equal in one run
    assert runs[1]["loader_stats_wait_s"] > 0
    assert not any(scratch.iterdir()), "the generated JPEGs were left behind"


def test_inference_on_the_cpu_skips_gpu_variants_with_a_reason(tmp_path):
    p = bench("inference", "--device", "cpu", "--iterations", "5", "--variants", "eager,fp16,graphs,tensorrt",
              "--json", str(tmp_path / "i.json"))
    rows = json.loads((tmp_path / "i.json").read_text())["rows"]
    assert rows[0]["variant"] == "eager" and 0 < rows[0]["p50_ms"] <= rows[0]["p90_ms"] <= rows[0]["p99_ms"]
    assert [r["variant"] for r in rows[1:]] == ["fp16", "graphs", "tensorrt"] and all("skipped" in r for r in rows[1:])
    assert p.stdout.count("skipped: ") == 3


@pytest.mark.parametrize("args,words", [
    (["train", "--model", "nope", "--device", "cpu"], "unknown model"),
    (["train", "--model", "tiny-cnn", "--precision", "fp8", "--device", "cpu"], "unknown precision"),
    (["train", "--model", "tiny-cnn", "--precision", "fp16", "--device", "cpu"], "needs a GPU"),
    (["train", "--model", "tiny-cnn", "--batch-size", "8,0", "--device", "cpu"], "positive integers"),
    (["train", "--model", "tiny-cnn", "--batch-size", "8,,16", "--device", "cpu"], "comma-separated"),
    (["train", "--model", "tiny-cnn", "--batch-size", "auto", "--device", "cpu"], "needs a GPU"),
    (["loop", "--case", "nope", "--device", "cpu"], "unknown case"),
    (["inference", "--model", "nope", "--device", "cpu"], "unknown model"),
    (["inference", "--variants", "eager,warp", "--device", "cpu"], "unknown variant"),
])
def test_bad_input_is_one_line(args, words):
    assert words in bench(*args, ok=False).stderr


def test_plot_without_matplotlib_says_so(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\nfrom hotloop.cli import main\n"
            f"sys.exit(main(['bench', 'train', '--device', 'cpu', '--steps', '1', '--plot', {str(tmp_path / 'x.png')!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "matplotlib" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("what", ["train", "loop", "inference"])
def test_gpu_benches_without_a_gpu(what):
    if hotloop.cuda_available():
        pytest.skip("this machine has a GPU")
    assert "no usable GPU" in bench(what, "--device", "cuda", ok=False).stderr


@pytest.mark.gpu
def test_train_resnet50_two_precisions_on_the_gpu(tmp_path):
    pytest.importorskip("torchvision")
    p = bench("train", "--model", "resnet50", "--precision", "fp32,bf16", "--batch-size", "64", "--steps", "5",
              "--json", str(tmp_path / "r.json"))
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]
    for r in rows:
        assert r["samples_per_s"] > 0 and r["peak_gib"] > 1 and r["gpu_util_pct"] is not None
    assert rows[1]["speedup_vs_fp32"] > 1.2, p.stdout  # bf16 tensor cores against true fp32


@pytest.mark.gpu
def test_loop_on_the_gpu(tmp_path):
    bench("loop", "--case", "tiny-cnn", "--case", "tiny-gpt", "--case", "tiny-cnn-jpeg", "--steps", "10",
          "--workers", "2", "--json", str(tmp_path / "l.json"))
    runs = json.loads((tmp_path / "l.json").read_text())["runs"]
    assert [r["loop"] for r in runs] == ["torch", "hotloop"] * 3
    assert all(r["peak_gib"] > 0 and r["optimizer_s"] > 0 for r in runs)

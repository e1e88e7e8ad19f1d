"""The demo's JPEG round (hotloop.cli.demo_photos): on the CPU, with a stand-in step and a small folder, what
it times, prints and concludes, and that its files and workers are gone however it ends; the line it prints
instead where torchvision or scikit-image is missing; that a CPU run of the demo has no JPEG round; and, on
a GPU, the whole demo with ResNet-50."""
import importlib.abc
import importlib.machinery
import os
import re
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch

from hotloop.bench import image_loop, procfs
from hotloop.cli import build_parser, demo_photos, rounds

from ..seeding import derived_seed

CPU = torch.device("cpu")
RESIDENT_STEPS = image_loop.WARMUP + image_loop.STEADY
ROUND_LINE = re.compile(r"^  round (\d+)/(\d+) (torch|hotloop): +epoch (\d+\.\d\d) s, fed (\d+\.\d) % of resident, "
                        r"CPU (\d+\.\d\d) ms per image, first batch (\d+\.\d\d) s$", re.M)
ROWS = (("epoch time, s", "epoch_s", "lower"), ("fed share, % of resident", "fed", "higher"),
        ("CPU ms per image", "cpu_ms", "lower"), ("time to first batch, s", "first_s", "lower"))


def leftovers(folder):
    return [name for name in os.listdir(folder) if name.startswith("hotloop")]


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """tempfile's folder for the test: what the round leaves behind shows there."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return tmp_path


@pytest.fixture
def epochs(monkeypatch):
    """Each epoch's figures as plain_loop returned them (the round adds its own to the same dict)."""
    seen, plain_loop = [], image_loop.plain_loop

    def recording(*args, **kwargs):
        seen.append(plain_loop(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(image_loop, "plain_loop", recording)
    return seen


class Steps:
    """A stand-in for the model: checks each batch is what the model would get, and spends a little time on it."""

    def __init__(self, batch, fail_at=None):
        self.batch, self.fail_at, self.calls, self.labels = batch, fail_at, 0, set()

    def __call__(self, x, y):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the step failed")
        assert x.shape == (self.batch, 3, 224, 224) and x.dtype == torch.float16 and x.device == CPU
        assert x.is_contiguous(memory_format=torch.channels_last)
        # normalised with ImageNet's mean and std: every value within (0 - 0.485) / 0.229 and (1 - 0.406) / 0.225
        assert -2.2 <= float(x.min()) < float(x.max()) <= 2.7
        self.labels.update(y.tolist())
        return float(x.float().mean())


pytestmark = [pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create")]


@pytest.mark.parametrize("files, batch, steps", [(4096, 256, 16), (3072, 256, 12), (3071, 248, 12), (1024, 80, 12),
                                                 (128, 8, 16)])
def test_the_batch_is_256_or_what_gives_an_epoch_of_twelve_steps(files, batch, steps):
    assert demo_photos.batch_size(files, 256) == batch and files // batch == steps


def test_every_allowed_number_of_files_gives_batches_of_8_or_more_and_a_window_that_fits_the_epoch():
    import numpy as np

    rng = np.random.default_rng(derived_seed())
    for files in [demo_photos.LEAST_FILES, *rng.integers(demo_photos.LEAST_FILES, 60_000, 200)]:
        batch = demo_photos.batch_size(int(files), 256)
        steps = files // batch
        assert batch % 8 == 0 and 8 <= batch <= 256 and steps >= demo_photos.LEAST_STEPS, files
        warmup, steady = demo_photos.window(steps, image_loop.WARMUP)
        assert 2 <= warmup <= image_loop.WARMUP and warmup + steady == steps and steady > warmup, files
    assert demo_photos.window(16, 15) == (4, 12) and demo_photos.window(400, 15) == (15, 385)


def test_the_round_on_the_cpu_times_both_ways_alternated_and_removes_its_files(own_tmp, epochs, capsys):
    pytest.importorskip("torchvision")
    pytest.importorskip("skimage", reason="scikit-image ships the photographs")
    step = Steps(8)
    assert demo_photos.run(CPU, 128, 3, step=step, model="a stand-in", workers=(1, 1)) == 0
    out = capsys.readouterr().out
    assert leftovers(own_tmp) == []
    assert ("JPEG round: a stand-in learns from 128 photo files in batches of 8 on the CPU: torch's way "
            "(ImageFolder, PIL's decode, RandomResizedCrop(224) + flip + ToTensor + Normalize in 1 worker, pin_memory, "
            ".to(device)) against hotloop's (the same dataset, gpu_decode=True, 1 worker), 3 rounds of one epoch "
            "(16 steps, 12 timed after 4) of each, alternating") in out
    assert re.search(r"^  files: 128 distinct files from real photographs written in \d+ s: mean \d+ x \d+ px", out,
                     re.M), out
    resident = float(re.search(r"^  the model alone, on one batch already on the CPU: (\d+) img/s", out, re.M)[1])
    # the resident steps, then 6 epochs of 16 steps over the 100 classes' files
    assert step.calls == RESIDENT_STEPS + 6 * 16 and step.labels == set(range(100))
    assert [e["way"] for e in epochs] == ["torch", "hotloop", "hotloop", "torch", "torch", "hotloop"]
    assert all(e["images"] == 16 * 8 for e in epochs)
    lines = ROUND_LINE.findall(out)
    assert [(int(r), int(n), way) for r, n, way, *_ in lines] == [(1, 3, "torch"), (1, 3, "hotloop"), (2, 3, "hotloop"),
                                                                 (2, 3, "torch"), (3, 3, "torch"), (3, 3, "hotloop")]
    for line, e in zip(lines, epochs):
        assert 0 < e["first_s"] < e["epoch_s"] and e["cpu_s"] > 0 and e["rate"] > 0
        assert line[3:] == (f"{e['epoch_s']:.2f}", f"{e['fed']:.1f}", f"{1e3 * e['cpu_s'] / e['images']:.2f}",
                            f"{e['first_s']:.2f}")
        # the share of the resident rate printed above, to its rounding
        assert e["fed"] == pytest.approx(100 * e["rate"] / resident, rel=0.6 / resident + 1e-9)
    for name, key, better in ROWS:  # the table's medians are the rounds'
        m = re.search(rf"^  {re.escape(name)} +(\d+\.\d{{3}}) +(\d+\.\d{{3}})  {better} is better +", out, re.M)
        assert m, out
        for way, printed in zip(("hotloop", "torch"), m.groups()):
            assert float(printed) == pytest.approx(statistics.median(e[key] for e in epochs if e["way"] == way),
                                                   abs=6e-4)
    assert re.search(r"^  decoding: hotloop's cpu \(.*\); torch's PIL in its 1 worker$", out, re.M), out
    hot, ref = ([e["epoch_s"] for e in epochs if e["way"] == way] for way in ("hotloop", "torch"))
    assert out.rstrip().endswith("\n  " + rounds.verdict_line(hot, ref, what="epoch"))


def test_an_error_in_a_step_removes_the_files_and_ends_the_workers(own_tmp, epochs):
    pytest.importorskip("torchvision")
    pytest.importorskip("skimage", reason="scikit-image ships the photographs")
    before = set(procfs.descendants(procfs.process_stats(), os.getpid()))
    step = Steps(8, fail_at=RESIDENT_STEPS + 16 + 5)  # in hotloop's first epoch, its workers busy
    with pytest.raises(RuntimeError, match="the step failed"):  # (its traceback still held below)
        demo_photos.run(CPU, 128, 3, step=step, model="a stand-in", workers=(1, 1))
    assert leftovers(own_tmp) == []
    assert set(procfs.descendants(procfs.process_stats(), os.getpid())) <= before
    assert [e["way"] for e in epochs] == ["torch"]


CTRL_C = textwrap.dedent("""
    import os, signal, sys, warnings
    import torch
    from hotloop.bench import procfs
    from hotloop.cli import demo_photos
    warnings.simplefilter("ignore")
    # Python's own Ctrl-C handler, as a terminal's python has it: a test run as a background job inherits
    # SIGINT ignored, and the signal below would then do nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    calls = []
    def step(x, y):
        calls.append(len(y))
        if len(calls) == int(sys.argv[1]):
            os.killpg(os.getpgid(0), signal.SIGINT)  # as a terminal's Ctrl-C: the workers get it too
    code = demo_photos.run(torch.device("cpu"), 128, 3, step=step, model="a stand-in", workers=(1, 1))
    print("children", procfs.descendants(procfs.process_stats(), os.getpid()))
    sys.exit(code)
""")


@pytest.mark.parametrize("at", ["resident", "torch's epoch", "hotloop's epoch"])
def test_ctrl_c_removes_the_files_and_ends_the_workers(tmp_path, at):
    pytest.importorskip("torchvision")
    pytest.importorskip("skimage", reason="scikit-image ships the photographs")
    step = {"resident": 5, "torch's epoch": RESIDENT_STEPS + 6, "hotloop's epoch": RESIDENT_STEPS + 16 + 6}[at]
    out = subprocess.run([sys.executable, "-c", CTRL_C, str(step)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True)
    assert out.returncode == 130, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "hotloop demo: JPEG round interrupted; its files are removed"
    assert "Traceback" not in out.stderr and "children []" in out.stdout, (out.stdout, out.stderr)
    assert len(ROUND_LINE.findall(out.stdout)) == {"resident": 0, "torch's epoch": 0, "hotloop's epoch": 1}[at]
    assert leftovers(tmp_path) == []


class FailingImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A torchvision that fails as it loads, as one built for another torch does."""

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "torchvision" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise RuntimeError("operator torchvision::nms does not exist")


@pytest.mark.parametrize("lacking, words", [
    ("torchvision", "it needs torchvision (pip install torchvision)"),
    ("a torchvision that loads", "it needs torchvision, which failed to import here (operator torchvision::nms does "
                                 "not exist)"),
    ("skimage", "it needs photographs: realistic images are made from photographs that scikit-image ships: "
                "`pip install scikit-image`, or set HOTLOOP_PHOTOS to a folder of pictures"),
])
def test_without_torchvision_or_scikit_image_the_round_says_so_in_one_line(monkeypatch, own_tmp, capsys, lacking,
                                                                           words):
    monkeypatch.delenv("HOTLOOP_PHOTOS", raising=False)
    if lacking == "a torchvision that loads":
        monkeypatch.delitem(sys.modules, "torchvision", raising=False)
        monkeypatch.setattr(sys, "meta_path", [FailingImport(), *sys.meta_path])
    else:
        monkeypatch.setitem(sys.modules, lacking, None)  # import fails, find_spec finds nothing
    step = Steps(8)
    assert demo_photos.run(CPU, 128, 3, step=step, model="a stand-in", workers=(1, 1)) == 0
    assert capsys.readouterr().out == f"hotloop demo: no JPEG round: {words}\n"
    assert step.calls == 0 and leftovers(own_tmp) == []


def test_photos_option():
    parser = build_parser()
    assert parser.parse_args(["demo"]).photos == demo_photos.FILES
    assert parser.parse_args(["demo", "--photos", "1024"]).photos == 1024
    assert parser.parse_args(["demo", "--no-photos"]).photos == 0
    out = subprocess.run([sys.executable, "-m", "hotloop", "demo", "--device", "cpu", "--photos", "100"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip() == "hotloop demo: --photos: expected 0 or a number >= 128, got 100"


def test_a_cpu_run_of_the_demo_has_no_jpeg_round(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hotloop", "demo", "--device", "cpu", "--steps", "2", "--batch-size",
                          "8", "--workers", "0", "--rounds", "1", "--photos", "128"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert re.search(r"^  verdict: none from 1 round", out.stdout, re.M), out.stdout
    assert "JPEG" not in out.stdout + out.stderr and "round 1/1" not in out.stdout
    assert leftovers(tmp_path) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_demo_on_a_gpu_runs_the_jpeg_round(tmp_path):
    pytest.importorskip("torchvision")
    pytest.importorskip("skimage", reason="scikit-image ships the photographs")
    out = subprocess.run([sys.executable, "-m", "hotloop", "demo", "--photos", "1024", "--rounds", "3", "--steps",
                          "20"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("  verdict: ") == 2, out.stdout  # the small CNN's, then the JPEG round's
    jpeg = out.stdout[out.stdout.index("hotloop demo, JPEG round: "):]
    assert jpeg.startswith(f"hotloop demo, JPEG round: {demo_photos.MODEL} learns from 1024 photo files in batches "
                           f"of 80 on {torch.cuda.get_device_name()}: "), jpeg
    assert "3 rounds of one epoch (12 steps, 9 timed after 3) of each, alternating" in jpeg
    assert re.search(r"^  files: 1024 distinct files from real photographs written in \d+ s", jpeg, re.M), jpeg
    resident = float(re.search(r"^  the model alone, on one batch already on the GPU: (\d+) img/s", jpeg, re.M)[1])
    lines = ROUND_LINE.findall(jpeg)
    assert [way for _, _, way, *_ in lines] == ["torch", "hotloop", "hotloop", "torch", "torch", "hotloop"], jpeg
    figures = {way: [] for way in ("hotloop", "torch")}
    for _, _, way, epoch, fed, cpu_ms, first in lines:
        assert 0 < float(first) < float(epoch) and 0 < float(fed) <= 120 and float(cpu_ms) > 0, jpeg
        figures[way].append(float(epoch))
    assert resident > 0
    for name, _, better in ROWS:
        assert re.search(rf"^  {re.escape(name)} +\d+\.\d{{3}} +\d+\.\d{{3}}  {better} is better +"
                         r"(?:\d+\.\d\dx|-) (better|worse|no clear difference)$", jpeg, re.M), jpeg
    assert re.search(r"^  decoding: hotloop's (?!None)\S.*; torch's PIL in its \d+ workers?$", jpeg, re.M), jpeg
    # the verdict is the one the printed epochs give (to their rounding)
    verdict = re.search(r"^  verdict: (hotloop won|torch won|no clear difference in epoch time)", jpeg, re.M)
    assert verdict, jpeg
    expected = rounds.verdict_line(figures["hotloop"], figures["torch"], what="epoch")
    if min(abs(a - b) for a in figures["hotloop"] for b in figures["torch"]) > 0.01:
        assert expected.startswith("verdict: " + verdict[1]), (expected, jpeg)
    assert leftovers(tmp_path) == []

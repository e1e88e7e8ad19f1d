"""`bench distributed`: the CPU smoke run (gloo, 2 ranks, the tiny GPT) prints the DDP rows and writes JSON
that agrees with them; a rank that raises, dies or hangs ends the run with what happened, never a hang;
bad input is one line; the GPU run under the `gpu` marker (two GPUs)."""
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch

import hotloop
from hotloop.bench.rank_launch import RankFailed, launch
from hotloop.cli import main


def bench(*args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "hotloop", "bench", "distributed", *args], capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr
    return p


def table(stdout):
    """{(component, figure): cells} of the final table."""
    lines = stdout.split("\n\n", 1)[1].strip().splitlines()
    assert lines[1].startswith("---")
    rows = {}
    for line in lines[2:]:
        component, rest = line.split(None, 1)
        figure, rest = rest.split("  ", 1)
        rows[(component, figure.strip())] = rest.split()
    return rows


LABELS = {("cpu", 1): "1 rank", ("cpu", 2): "2 ranks", ("cuda", 1): "1 GPU", ("cuda", 2): "2 GPUs"}


def check_run(data, rows, device, world_size, steps, batch):
    assert [r["world_size"] for r in data["runs"]] == [1, world_size]
    for run in data["runs"]:
        n = run["world_size"]
        for mode in ("ddp", "fsdp2"):
            sides = run["modes"][mode]
            if mode == "ddp" or device == "cpu":  # hotloop.GradScaler takes FSDP2's DTensor gradients on gloo
                assert sides["hotloop"]["status"] == sides["torch"]["status"] == "ok"
            assert sides["torch"]["status"] == "ok"  # torch's FSDP2 runs on gloo and NCCL alike
            if sides["hotloop"]["status"] != "ok":  # not yet run with NCCL on two GPUs: an error shows, n/a
                assert mode == "fsdp2" and sides["hotloop"]["error"].startswith("rank ")
                shown = " ".join(rows[(mode, f"ms/step, {LABELS[device, n]}")])
                assert f"hotloop n/a: {sides['hotloop']['error']}" in shown
                continue
            for f in sides.values():
                assert f["seconds"] > 0 and len(f["rank_seconds"]) == n
                assert f["samples_per_s"] == pytest.approx(batch * n * steps / f["seconds"])
                assert f["ms_per_step"] == pytest.approx(f["seconds"] * 1e3 / steps)
                # a block lasts as long as its slowest rank
                assert f["seconds"] >= max(f["rank_seconds"]) * (1 - 1e-9)
            # the same seed, model, batches and steps: both sides end at the same loss (on a GPU, fp16 and
            # the embedding's atomic adds in backward let the two models drift apart a little)
            assert sides["hotloop"]["final_loss"] == pytest.approx(sides["torch"]["final_loss"],
                                                                   rel=1e-4 if device == "cpu" else 1e-2)
            shown = rows[(mode, f"ms/step, {LABELS[device, n]}")]
            assert float(shown[0]) == pytest.approx(sides["hotloop"]["ms_per_step"], rel=1e-3)
            assert float(shown[1]) == pytest.approx(sides["torch"]["ms_per_step"], rel=1e-3)
            assert float(shown[3]) == pytest.approx(sides["hotloop"]["ms_per_step"] / sides["torch"]["ms_per_step"],
                                                    abs=1e-3)
    first, last = (run["modes"]["ddp"] for run in data["runs"])
    scaling = [r for r in data["rows"] if r["component"] == "ddp" and r["figure"].startswith("scaling")]
    assert len(scaling) == 1
    for side in ("hotloop", "torch"):
        assert scaling[0][side] == pytest.approx(last[side]["samples_per_s"] / first[side]["samples_per_s"])


def test_distributed_on_the_cpu_prints_the_table_and_writes_json(tmp_path):
    p = bench("--device", "cpu", "--world-size", "2", "--steps", "2", "--batch-size", "4",
              "--json", str(tmp_path / "d.json"))
    data = json.loads((tmp_path / "d.json").read_text())
    rows = table(p.stdout)
    assert {("ddp", f) for f in ("ms/step, 1 rank", "samples/s, 1 rank", "ms/step, 2 ranks", "samples/s, 2 ranks",
                                 "scaling 1 rank → 2")} <= set(rows)
    assert data["model"] == "tiny-gpt" and data["backend"] == "gloo" and data["world_sizes"] == [1, 2]
    check_run(data, rows, "cpu", 2, 2, 4)
    assert p.stdout.count("hotloop bench distributed:") == 1  # rank 0 prints, once


def _raises_on_rank_1(rank, world_size, say, note):
    import torch.distributed as dist

    say("before the barrier")
    if rank == 1:
        raise ValueError("rank one broke")
    dist.barrier()  # rank 0 would wait here for ever


def _dies_on_rank_1(rank, world_size, say, note):
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.barrier()


def _hangs_on_rank_1(rank, world_size, say, note):
    import torch.distributed as dist

    if rank == 1:
        note("about to sleep")
        say("asleep")
        time.sleep(120)
    say("in the barrier")
    dist.barrier()


@pytest.mark.parametrize("body, words", [
    (_raises_on_rank_1, ["rank 1 failed in phase 'before the barrier'", "ValueError: rank one broke",
                         "rank 0 was in 'before the barrier'"]),
    (_dies_on_rank_1, ["rank 1 failed in phase 'init_process_group'", "exited with code 3 without a result"]),
    (_hangs_on_rank_1, ["no progress in 3 s", "'asleep'", "'in the barrier'", "rank 1 noted: about to sleep"]),
])
def test_a_failing_rank_ends_every_rank_with_its_error(body, words):
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as caught:
        launch(body, 2, timeout=3)
    err = caught.value
    text = "\n".join([str(err), err.detail, *err.then])
    for w in words:
        assert w in text, text
    if body is _raises_on_rank_1:
        assert "Traceback" in err.detail and "_raises_on_rank_1" in err.detail
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("hotloop-bench-rank")]
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("args, words", [
    (["--model", "nope"], "--model: unknown model 'nope'"),
    (["--timeout", "0"], "--timeout: expected a number of seconds > 0"),
    (["--workers", "-1"], "--workers: expected 0 or more"),
    (["--device", "cpu:0"], "expected cuda or cpu (rank r runs on cuda:r)"),
])
def test_bad_input_is_one_line(args, words, capsys):
    assert main(["bench", "distributed", "--device", "cpu", *args]) == 2  # refused before any rank starts
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_distributed_on_two_gpus(tmp_path):
    p = bench("--device", "cuda", "--world-size", "2", "--model", "tiny-gpt", "--steps", "6", "--batch-size", "8",
              "--json", str(tmp_path / "d.json"))
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["backend"] == "nccl" and data["amp_dtype"] == "float16"
    check_run(data, table(p.stdout), "cuda", 2, 6, 8)
    for run in data["runs"]:  # the monitor ran across hotloop's blocks (utilisation where NVML answers)
        util = run["modes"]["ddp"]["hotloop"]["gpu_util_pct"]
        assert util is None or 0 <= util <= 100


def test_cuda_without_a_gpu_says_so(capsys):
    if hotloop.cuda_available() and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "distributed", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no usable GPU" in err, err

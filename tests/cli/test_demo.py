"""`python -m hotloop demo`, the README's first command: it runs without a GPU, times both ways in alternated
rounds, says which direction of each figure is better and gives a verdict only where the rounds agree, and
refuses bad options in one line."""
import re
import subprocess
import sys

import pytest
import torch


def demo(*args, env=None):
    return subprocess.run([sys.executable, "-m", "hotloop", "demo", *args], capture_output=True, text=True,
                          timeout=600, env=env)


ROUNDS_ORDER = [("torch", "hotloop"), ("hotloop", "torch"), ("torch", "hotloop")]


def test_demo_on_the_cpu_alternates_rounds_and_says_which_way_is_better():
    out = demo("--device", "cpu", "--steps", "6", "--batch-size", "16", "--workers", "1")
    assert out.returncode == 0, out.stderr
    rows = {}
    for row, direction in (("samples/s", "higher"), ("seconds", "lower"), ("waiting for data, s", "lower")):
        m = re.search(rf"^  {re.escape(row)} +(\d+\.\d{{3}}) +(\d+\.\d{{3}})  {direction} is better +"
                      r"(?:(\d+\.\d\d)x|-) (better|worse|no clear difference)$", out.stdout, re.M)
        assert m, out.stdout
        rows[row] = m.groups()
    # each round times both ways, the order flipped each round
    m = re.search(r"^  rounds, loop seconds in the order run: (.*)$", out.stdout, re.M)
    assert m, out.stdout
    rounds = [[tuple(run.split()) for run in r.split(", ")] for r in m.group(1).split(" | ")]
    assert [tuple(way for way, _ in r) for r in rounds] == ROUNDS_ORDER, m.group(1)
    seconds = {way: sorted(float(s) for r in rounds for w, s in r if w == way) for way in ("hotloop", "torch")}
    # the table's seconds are the medians of the rounds (printed to 2 decimals there)
    assert abs(float(rows["seconds"][0]) - seconds["hotloop"][1]) <= 0.006, (rows, seconds)
    assert abs(float(rows["seconds"][1]) - seconds["torch"][1]) <= 0.006, (rows, seconds)
    # the ratio is torch's median over hotloop's, so > 1 means hotloop was faster
    ratio = float(rows["seconds"][1]) / float(rows["seconds"][0])
    assert abs(float(rows["seconds"][2]) - ratio) <= 0.02 * ratio + 0.006, rows
    # the verdict agrees with the rounds: a winner only where every round of one way beat every round of the other
    (h_lo, h_hi), (t_lo, t_hi) = (seconds["hotloop"][0::2], seconds["torch"][0::2])
    verdict = re.search(r"^  verdict: (.*)$", out.stdout, re.M)
    assert verdict, out.stdout
    if h_hi + 0.01 < t_lo:
        assert verdict.group(1).startswith("hotloop won: its loop ran "), verdict.group(1)
    elif t_hi + 0.01 < h_lo:
        assert verdict.group(1).startswith("torch won: "), verdict.group(1)
    elif min(h_hi, t_hi) > max(h_lo, t_lo) + 0.01:
        assert verdict.group(1).startswith("no clear difference in loop time: the rounds' ranges overlap"), out.stdout
    # the same data and weights: the first loss is the same bits (before any step), the others within AdamW's roundings
    first = re.search(r"^  first loss +(\d+\.\d{3}) +(\d+\.\d{3})", out.stdout, re.M)
    assert first and first.group(1) == first.group(2), out.stdout
    losses = re.search(r"^  losses: (the same in every step|within (\S+) of each other)", out.stdout, re.M)
    assert losses and (losses.group(2) is None or float(losses.group(2)) < 1e-3), out.stdout
    assert re.search(r"^  loader \(the monitored loop\): 6 batches, waited \d+\.\d\d s", out.stdout, re.M), out.stdout
    assert "  on the CPU: no host-to-device copies" in out.stdout
    # one monitored loop (its report), then 3 rounds of two timed loops
    assert out.stderr.count("hotloop memory report") == 1, out.stderr
    assert out.stderr.count("6/6 steps") == 7, out.stderr


@pytest.mark.parametrize("hot, ref, higher, ratio, word", [
    ([1.0, 1.2, 1.1], [1.6, 1.5, 1.7], False, 1.6 / 1.1, "better"),   # seconds: every hotloop round faster
    ([1.0, 1.6, 1.1], [1.5, 1.55, 1.7], False, 1.55 / 1.1, "no clear difference"),  # one slow round: overlap
    ([2.0, 2.2, 2.1], [1.0, 1.1, 1.2], False, 1.1 / 2.1, "worse"),
    ([3.0, 4.0, 5.0], [1.0, 2.0, 2.5], True, 2.0, "better"),           # samples/s: higher is better
    ([3.0, 4.0, 5.0], [1.0, 2.0, 3.5], True, 2.0, "no clear difference"),
    ([0.0, 0.0, 0.1], [0.2, 0.3, 0.2], False, None, "better"),          # no wait at all: no ratio, still better
    ([1.0, 1.1], [2.0, 2.1], False, 2.05 / 1.05, "too few rounds to say"),
])
def test_compare_rounds_calls_a_difference_only_where_the_rounds_do_not_overlap(hot, ref, higher, ratio, word):
    from hotloop.cli.rounds import compare_rounds

    got_ratio, got_word = compare_rounds(hot, ref, higher)
    assert got_word == word
    assert got_ratio == pytest.approx(ratio) if ratio is not None else got_ratio is None


def test_verdict_line_says_who_won_and_by_how_much_or_that_the_rounds_overlap():
    from hotloop.cli.rounds import verdict_line

    assert verdict_line([1.0, 1.2, 1.1], [1.6, 1.5, 1.7]) == ("verdict: hotloop won: its loop ran 1.45x as fast as "
                                                             "torch's (medians of 3 rounds; every hotloop round faster)")
    assert verdict_line([2.0, 2.2, 2.1], [1.0, 1.1, 1.2]).startswith("verdict: torch won: hotloop's loop ran 0.52x")
    assert verdict_line([1.0, 1.6, 1.1], [1.5, 1.55, 1.7]) == (
        "verdict: no clear difference in loop time: the rounds' ranges overlap (hotloop 1.00-1.60 s, torch 1.50-1.70 s)")
    assert verdict_line([1.0], [2.0]) == "verdict: none from 1 round (--rounds 3 or more for one)"


@pytest.mark.parametrize("args, words", [
    (("--device", "tpu"), "--device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (("--device", "cpu", "--steps", "0"), "--steps: expected a number >= 1, got 0"),
    (("--device", "cpu", "--workers", "-1"), "--workers: expected a number >= 0, got -1"),
    (("--device", "cpu", "--rounds", "0"), "--rounds: expected a number >= 1, got 0"),
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
    out = demo("--steps", "40", "--workers", "4", "--no-photos")  # the JPEG round: test_demo_photos.py
    assert out.returncode == 0, out.stderr
    assert "host-to-device" in out.stdout
    assert re.search(r"^  scaler \(the monitored loop\): scale \d+, skipped steps \d+", out.stdout, re.M), out.stdout
    assert "peak" in out.stderr.lower() and out.stderr.count("hotloop memory report") == 1  # the monitored loop's
    assert "losses: within" in out.stdout and "on the CPU" not in out.stdout
    assert re.search(r"^  verdict: (hotloop won|torch won|no clear difference)", out.stdout, re.M), out.stdout

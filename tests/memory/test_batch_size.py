"""find_max_batch_size against a fake step with a known memory limit (it raises torch.OutOfMemoryError
above it): the answer is exact or safe, and takes far fewer trials than doubling then bisecting."""
import math
import random

import pytest
import torch

import hotloop
from hotloop.memory.batch_size import is_out_of_memory

from .conftest import BASELINE, CAPACITY, FakeMemory, FakeStep, GiB, MiB


def doubling_then_bisection(fits, start=1):
    """Lightning's way, for the count: double until a size fails, then bisect to 1."""
    trials, size, lo = 0, start, None
    while True:
        trials += 1
        if not fits(size):
            hi = size
            break
        lo, size = size, size * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        trials += 1
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, trials


def report(curve, result, reference):
    """Print what the test compares (pytest -s shows it)."""
    print(f"\n{curve}: {len(result.trials)} trials, doubling + bisection {reference}, "
          f"sizes {[t.batch_size for t in result.trials]}")


def run(peak_of, **kwargs):
    memory = FakeMemory()
    step = FakeStep(memory, peak_of)
    result = hotloop.find_max_batch_size(step, memory=memory, **kwargs)
    assert [t.batch_size for t in result.trials] == step.sizes
    assert memory.resets == len(step.sizes) + 1  # before each trial, and once for the real run
    assert all(ref() is None for ref in step.lost), "a failed step's tensors outlived the search"
    return result, step


@pytest.mark.parametrize("a,b", [(2 * GiB, 50 * MiB), (6 * GiB, 700 * MiB), (100 * MiB, 1 * MiB)])
@pytest.mark.parametrize("start", [1, 8])
def test_linear_peaks_give_the_exact_size_in_half_the_trials(a, b, start):
    a += random.randint(0, GiB)  # fresh figures each run

    def peak(s):
        return BASELINE + a + b * s

    result, _ = run(peak, start=start)
    usable = CAPACITY - result.margin_bytes
    assert result.margin_bytes == int(0.03 * CAPACITY)  # a line fits exactly: the fixed headroom is the margin
    exact = (usable - BASELINE - a) // b
    tolerance = max(1, exact // 64)
    assert exact - tolerance < int(result) <= exact
    assert peak(int(result)) <= usable
    assert result.bytes_per_sample == pytest.approx(b) and result.intercept_bytes == pytest.approx(BASELINE + a)
    _, reference = doubling_then_bisection(lambda s: peak(s) <= CAPACITY, start)
    report(f"linear, {b // MiB} MiB a sample, start {start}", result, reference)
    assert len(result.trials) <= reference / 2, (len(result.trials), reference)
    assert not any(t.oom for t in result.trials)
    assert [result.status(t) for t in result.trials][-1] == "over margin"  # the confirming trial


def test_noisy_peaks_give_a_safe_size_in_half_the_trials():
    sigma = 0.002 * CAPACITY

    def mean_peak(s):
        return BASELINE + 2 * GiB + 50 * MiB * s

    result, _ = run(lambda s: mean_peak(s) + random.gauss(0, sigma))
    limit, reference = doubling_then_bisection(lambda s: mean_peak(s) <= CAPACITY)
    report("noisy", result, reference)
    assert mean_peak(int(result)) + 3 * sigma <= CAPACITY  # a real run at that size does not run out
    assert int(result) >= 0.9 * limit
    assert len(result.trials) <= reference / 2, (len(result.trials), reference)


def test_non_linear_peaks_give_a_safe_size_in_half_the_trials():
    # allocator blocks of 20 MiB, cuDNN picking a 3 GiB larger workspace above 700, and a slow curve
    step_at = random.randint(500, 900)

    def peak(s):
        raw = BASELINE + 2 * GiB + 40 * MiB * s + (3 * GiB if s > step_at else 0) + 0.004 * MiB * s * s
        return math.ceil(raw / (20 * MiB)) * 20 * MiB

    result, _ = run(peak)
    limit, reference = doubling_then_bisection(lambda s: peak(s) <= CAPACITY)
    report(f"non-linear, step at {step_at}", result, reference)
    assert peak(int(result)) <= CAPACITY - result.margin_bytes
    assert 0.9 * limit <= int(result) < limit
    assert len(result.trials) <= reference / 2, (len(result.trials), reference)


def test_strongly_convex_peaks_give_a_safe_size_in_half_the_trials():
    # about 1 GiB + 10 MiB·s + 0.05 MiB·s²: inside the bracket a parabola follows the peaks
    a, b, c = random.uniform(0.5, 2) * GiB, random.uniform(5, 15) * MiB, random.uniform(0.03, 0.08) * MiB

    def peak(s):
        return BASELINE + a + b * s + c * s * s

    result, _ = run(peak)
    limit, reference = doubling_then_bisection(lambda s: peak(s) <= CAPACITY)
    report("strongly convex", result, reference)
    assert peak(int(result)) <= CAPACITY - result.margin_bytes
    assert int(result) >= 0.8 * limit
    # peaks far from a line widen the margin beyond the fixed share
    assert result.margin_bytes > 0.03 * CAPACITY
    assert len(result.trials) <= reference / 2, (len(result.trials), reference)


def cliff_reference(start, last):
    """Doubling + bisection's trial count for each first size S in (start + 1, last] that runs out of
    memory (every size below S runs): what the finder is held to where memory runs out below the line."""
    return {S: doubling_then_bisection(lambda s: s < S, start)[1] for S in range(start + 2, last + 1)}


def least_promise(start, last, allowance):
    """Kraft's sum for a search that would promise reference / 2 + allowance trials for every S in
    (start + 1, last]: above 1, no search can keep that promise.

    Where the peaks are a line up to S and everything from S on runs out of memory, a trial below S
    shows the line's peak and one at or above S runs out: one bit per trial, and nothing else. So any
    search is a binary tree of trials (the first, at start, is forced and says nothing), and it stops
    at a leaf: a bracket (lo, hi] of S values narrower than the answer's precision, max(1, lo // 64)
    sizes (the finder's; the reference's is 1). Kraft's inequality for the tree: the sum over leaves of
    2^-(trials - 1) is at most 1. A leaf whose trials are at most reference(S) / 2 + allowance for
    each of its S weighs at least the mean of 2^(1 - floor(reference(S) / 2 + allowance)) over them,
    so the sum over S of that, each divided by max(1, S // 64), is at most 1 as well. Doubling +
    bisection spends about 2·log2(S / start) trials on a limit at S, so each small S weighs about
    start / S and the octaves just above start outweigh the promise."""
    return sum(2.0 ** (1 - math.floor(n / 2 + allowance)) / max(1, S // 64)
               for S, n in cliff_reference(start, last).items())


@pytest.mark.parametrize("draw", range(8))
def test_memory_that_runs_out_far_below_the_line_gives_a_safe_size(draw):
    # a line up to S, and from S on out of memory (a workspace or an allocator block that the sizes
    # below do not show), S anywhere from just above start to half the line's limit
    start = random.randint(1, 16)
    a, b = random.uniform(0.1, 6) * GiB, math.exp(random.uniform(0, math.log(700))) * MiB
    line_limit = int((CAPACITY - int(0.03 * CAPACITY) - BASELINE - a) // b)
    cliff = round(math.exp(random.uniform(math.log(start + 2), math.log(line_limit // 2))))

    def peak(s):
        return BASELINE + a + b * s if s < cliff else 2 * CAPACITY

    result, _ = run(peak, start=start)
    limit, reference = doubling_then_bisection(lambda s: peak(s) <= CAPACITY, start)
    report(f"runs out from {cliff} (line's limit {line_limit}), start {start}", result, reference)
    assert limit == cliff - 1
    assert int(result) < cliff and peak(int(result)) <= CAPACITY - result.margin_bytes
    assert int(result) >= limit - max(1, limit // 64)  # the finder's precision
    # with S drawn as above, no search can promise half of doubling + bisection for every S, nor half
    # plus 2.5 trials; this one keeps within half plus 6.5 (the most seen over starts 1-16, 48 lines
    # and every S below 600, 2 % apart above)
    last = min(line_limit // 2, 400)
    assert least_promise(start, last, 0) > 1 and least_promise(start, last, 2.5) > 1
    assert len(result.trials) <= reference / 2 + 6.5, (len(result.trials), reference)


def test_max_batch_size_bounds_the_answer():
    result, step = run(lambda s: BASELINE + MiB * s, max_batch_size=300)
    assert int(result) == 300 and max(step.sizes) == 300 and len(step.sizes) <= 4


@pytest.mark.parametrize("message", ["CUDA error: out of memory", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when "
                                     "calling `cublasCreate(handle)`", "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
                                     "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"])
def test_library_allocation_failures_count_as_out_of_memory(message):
    memory = FakeMemory()
    step = FakeStep(memory, lambda s: BASELINE + GiB + 50 * MiB * s, error=RuntimeError(message))
    step.peak_of = lambda s: BASELINE + GiB + 50 * MiB * s if s < 40 else 2 * CAPACITY  # fails from 40 on
    result = hotloop.find_max_batch_size(step, memory=memory)
    assert 38 <= int(result) < 40 and any(t.oom and t.error == message[:300] for t in result.trials)
    assert is_out_of_memory(RuntimeError(message)) and not is_out_of_memory(RuntimeError("shape mismatch"))


def test_other_errors_propagate():
    def step(size):
        raise ValueError("a bug in the step")

    with pytest.raises(ValueError, match="a bug in the step"):
        hotloop.find_max_batch_size(step, memory=FakeMemory())


def test_when_even_start_does_not_fit_it_says_so():
    with pytest.raises(RuntimeError, match="even batch size 4 does not fit"):
        run(lambda s: 2 * CAPACITY, start=4)


def test_result_lists_every_trial():
    result, _ = run(lambda s: BASELINE + GiB + 30 * MiB * s)
    table = str(result)
    assert f"batch size {int(result)}" in table and len(table.splitlines()) == len(result.trials) + 1
    d = result.to_dict()
    assert [t["batch_size"] for t in d["trials"]] == [t.batch_size for t in result.trials]
    assert all(t.seconds >= 0 and (t.peak_bytes is None) == t.oom for t in result.trials)
    assert list(range(10))[result] == int(result) if int(result) < 10 else True


@pytest.mark.parametrize("kwargs,error", [({"start": 0}, ValueError), ({"start": 1.5}, TypeError),
                                          ({"max_batch_size": 0, "start": 2}, ValueError),
                                          ({"headroom": 1.0}, ValueError), ({"headroom": -0.1}, ValueError)])
def test_bad_arguments(kwargs, error):
    with pytest.raises(error):
        hotloop.find_max_batch_size(lambda s: None, memory=FakeMemory(), **kwargs)


def test_without_a_gpu_it_asks_for_a_memory_source():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="memory="):
        hotloop.find_max_batch_size(lambda s: None)


@pytest.mark.gpu
def test_a_real_model_on_the_gpu():
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    free, _ = torch.cuda.mem_get_info()
    # a block that keeps all but ~6 GiB busy, so the search stays short on a large GPU
    hog = torch.empty(max(0, free - 6 * GiB), dtype=torch.uint8, device="cuda")

    def step(size):
        for _ in range(2):
            x = torch.randn(size, 4096, device="cuda")
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    try:
        result = hotloop.find_max_batch_size(step)
        size = int(result)
        assert size > 1000 and result.status(result.trials[-1]) != "OOM"
        _, reference = doubling_then_bisection(lambda s: s <= size)
        print(result, f"\ndoubling + bisection to the same size: {reference} trials")
        assert len(result.trials) <= reference / 2
        torch.cuda.reset_peak_memory_stats()
        for _ in range(5):  # the real run at the answer does not run out
            step(size)
        assert torch.cuda.max_memory_reserved() <= result.capacity_bytes
    finally:
        del hog
        torch.cuda.empty_cache()  # the next test's subprocess needs this memory back

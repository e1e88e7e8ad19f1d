"""The monitor and the batch-size finder under torch.distributed: 2 processes on gloo (CPU, a fake NVML
and simulated memory as in test_monitor.py and test_batch_size.py, a different one per rank), and on
two GPUs with NCCL (gpu marker)."""
import io
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

import hotloop
from hotloop import input_wait
from hotloop.memory.advice import compute_rank_advice
from hotloop.memory.ranks import RankMemory
from hotloop.memory.text import format_ranks, format_size

from ..conftest import FakeNvml
from ..distributed import run_ranks
from .conftest import BASELINE, CAPACITY, FakeMemory, FakeStep, GiB, MiB, ScriptedAllocator, wait_for


# ---- find_max_batch_size ----

def line(a, b, cliff=None):
    """peaks a + b·size (simulated), running out of memory from `cliff` on"""
    return lambda s: (BASELINE + a + b * s) if cliff is None or s < cliff else 2 * CAPACITY


def search(peak_of, capacity, **kwargs):
    memory = FakeMemory(capacity=capacity)
    step = FakeStep(memory, peak_of)
    return hotloop.find_max_batch_size(step, memory=memory, **kwargs), step


def summary(result, step):
    return {"size": int(result), "sizes": step.sizes, "trials": result.trials, "capacity": result.capacity_bytes,
            "margin": result.margin_bytes, "world_size": result.world_size, "text": str(result)}


def finder_body(rank, world_size, scenarios, fail_at):
    """The searches of `scenarios`, then those that fail (failing_body), in one pair of processes."""
    out = {"failing": failing_body(rank, world_size, fail_at)}
    for name, per_rank in scenarios.items():
        kind, kwargs = per_rank[rank][0], per_rank[rank][1]
        if kind == "collective":  # a step with its own collective, as DDP's backward has
            memory = FakeMemory(capacity=kwargs.pop("capacity"))
            fake = FakeStep(memory, line(*kwargs.pop("line")))

            def step(size):
                fake(size)
                t = torch.full((4,), float(size))
                dist.all_reduce(t)
                assert torch.equal(t, torch.full((4,), float(size * world_size)))  # the ranks ran the same size

            out[name] = summary(hotloop.find_max_batch_size(step, memory=memory), fake)
        else:
            if kwargs.pop("group", False):
                kwargs["process_group"] = dist.new_group(list(range(world_size)))
            capacity = kwargs.pop("capacity")
            out[name] = summary(*search(line(*kwargs.pop("line")), capacity, **kwargs))
    return out


@pytest.fixture(scope="module")
def searches(module_seed):
    """Searches on 2 ranks (spawned once for the tests that read them): what each rank returned, and
    the figures they ran with."""
    a, b = random.uniform(1, 6) * GiB, random.uniform(20, 400) * MiB
    small = int(random.uniform(0.4, 0.7) * CAPACITY)
    exact_small = int((small - 0.03 * small - BASELINE - a) // b)
    cliff = random.randint(max(4, exact_small // 8), exact_small // 2)  # a workspace that only rank 1 needs
    b0, b1 = b, b * random.uniform(0.3, 0.6)  # rank 0: more room, more memory a sample
    scenarios = {
        "room": [("search", dict(capacity=CAPACITY, line=(a, b))), ("search", dict(capacity=small, line=(a, b)))],
        "group": [("search", dict(capacity=CAPACITY, line=(a, b), group=True)),
                  ("search", dict(capacity=small, line=(a, b), group=True))],
        "one_rank_runs_out": [("search", dict(capacity=CAPACITY, line=(a, b))),
                              ("search", dict(capacity=CAPACITY, line=(a, b, cliff)))],
        "opposite": [("search", dict(capacity=CAPACITY, line=(a, b0))), ("search", dict(capacity=small, line=(a, b1)))],
        "alone": [("search", dict(capacity=CAPACITY, line=(a, b), all_ranks=False)),
                  ("search", dict(capacity=small, line=(a, b), all_ranks=False))],
        "collective": [("collective", dict(capacity=small, line=(a, b))),
                       ("collective", dict(capacity=small, line=(a, b)))],
    }
    fail_at = random.randint(2, 40)
    r0, r1 = run_ranks(finder_body, 2, args=(scenarios, fail_at))
    return r0, r1, dict(a=a, b=b, small=small, cliff=cliff, b0=b0, b1=b1, fail_at=fail_at)


def test_ranks_agree_on_a_size_that_fits_the_smallest_rank(searches):
    """Ranks with different room (the oracle: the same search run alone on the rank with the least),
    one rank that runs out of memory where the other does not, peaks and capacities that differ in
    opposite directions, a step with its own collectives; all_ranks=False searches alone."""
    r0, r1, figures = searches
    a, b, small, cliff, b0, b1 = (figures[k] for k in ("a", "b", "small", "cliff", "b0", "b1"))

    for name in ("room", "group", "one_rank_runs_out", "opposite", "collective"):
        # every rank ran the same sizes and returned the same answer, agreed trial by trial
        assert r0[name]["sizes"] == r1[name]["sizes"] and r0[name]["size"] == r1[name]["size"], name
        assert r0[name]["trials"] == r1[name]["trials"] and r0[name]["world_size"] == 2, name
        assert all(len(t.rank_peaks) == 2 for t in r0[name]["trials"])

    # different room, same peaks: exactly the search alone on the rank with the least room
    for name in ("room", "group"):
        oracle, step = search(line(a, b), small)
        assert r0[name]["size"] == int(oracle) and r0[name]["sizes"] == step.sizes
        assert r0[name]["capacity"] == small and r0[name]["margin"] == oracle.margin_bytes
        assert [t.peak_bytes for t in r0[name]["trials"]] == [t.peak_bytes for t in oracle.trials]
        assert line(a, b)(r0[name]["size"]) <= small - r0[name]["margin"]
    assert "on each of 2 ranks" in r0["room"]["text"]

    # alone, each rank finds its own: the larger rank's answer would not fit the smaller one
    alone0, alone1 = r0["alone"]["size"], r1["alone"]["size"]
    assert alone0 == int(search(line(a, b), CAPACITY)[0]) and alone1 == r0["room"]["size"]
    assert r0["alone"]["world_size"] == 1 and line(a, b)(alone0) > small

    # an OOM on rank 1 only: the trial failed for both, nobody waited, and the answer is below the cliff
    got = r0["one_rank_runs_out"]
    oracle, step = search(line(a, b, cliff), CAPACITY)
    assert got["size"] == int(oracle) < cliff and got["sizes"] == step.sizes
    lone = [t for t in got["trials"] if t.oom]
    assert lone and all(t.rank_peaks[0] is not None and t.rank_peaks[1] is None for t in lone)
    assert all(t.error.startswith("rank 1: CUDA out of memory") for t in lone)
    assert "OOM (rank 1)" in got["text"]

    # opposite: each rank within its own capacity less the margin. Where the ranks' lines cross inside
    # the search, the peak that counts bends there: like curved peaks, that widens the margin
    got = r0["opposite"]
    margin = got["margin"]
    assert margin >= int(0.03 * small)
    assert line(a, b0)(got["size"]) <= CAPACITY - margin and line(a, b1)(got["size"]) <= small - margin
    # the oracle: the search alone on one memory whose peak is the rule's, from a baseline below it by the
    # larger rank's growth at the first size
    def counted(s):
        return max(line(a, b0)(s) + small - CAPACITY, line(a, b1)(s))

    memory = FakeMemory(capacity=small, baseline=counted(1) - (a + max(b0, b1)))
    step = FakeStep(memory, counted)
    oracle = hotloop.find_max_batch_size(step, memory=memory)
    assert got["size"] == int(oracle) and got["sizes"] == step.sizes and margin == oracle.margin_bytes
    for t in (t for t in got["trials"] if not t.oom):  # the peak that counts: each rank's against the smallest capacity
        assert t.peak_bytes == max(t.rank_peaks[0] + small - CAPACITY, t.rank_peaks[1])

    assert r0["collective"]["size"] == int(search(line(a, b), small)[0])


class PeakFails(FakeMemory):
    def peak(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def failing_body(rank, world_size, fail_at):
    """Each scenario ends in an exception on every rank; what each raised, and then a search that
    works: the group is still usable (no rank is a collective ahead)."""
    out = {}

    tried = []

    def bug(size):
        tried.append(size)
        if rank == 1 and size >= fail_at:
            raise ValueError(f"a bug in rank 1's step at {size}")
        step(size)

    def outcome(fn):
        try:
            fn()
        except Exception as e:
            return type(e).__name__, str(e)
        return None

    memory = FakeMemory()
    step = FakeStep(memory, line(GiB, 100 * MiB))
    out["step_raises"] = outcome(lambda: hotloop.find_max_batch_size(bug, memory=memory))
    out["sizes"] = tried
    out["peak_raises"] = outcome(lambda: hotloop.find_max_batch_size(
        step, memory=PeakFails() if rank == 0 else FakeMemory()))
    out["different_starts"] = outcome(lambda: hotloop.find_max_batch_size(step, memory=FakeMemory(), start=1 + rank))
    lone = dist.new_group([0])  # every rank makes it; rank 1 is not in it
    out["not_a_member"] = outcome(lambda: hotloop.find_max_batch_size(step, memory=FakeMemory(), process_group=lone))
    out["after"] = int(search(line(GiB, 100 * MiB), CAPACITY)[0])
    return out


def test_an_error_on_one_rank_is_raised_on_every_rank(searches):
    r0, r1 = searches[0]["failing"], searches[1]["failing"]
    fail_at = searches[2]["fail_at"]
    # rank 1 raised its own; rank 0, whose steps ran, raises too, naming rank 1 and its error
    assert r1["step_raises"] == ("ValueError", f"a bug in rank 1's step at {r1['sizes'][-1]}")
    kind, text = r0["step_raises"]
    assert kind == "RuntimeError" and f"rank 1 raised in its trial of batch size {r1['sizes'][-1]}" in text
    assert f"ValueError: a bug in rank 1's step at {r1['sizes'][-1]}" in text
    assert r0["sizes"] == r1["sizes"] and r0["sizes"][-1] >= fail_at  # both stopped at the same trial
    # an error of the memory source (not the step) on rank 0
    assert r0["peak_raises"] == ("RuntimeError", "CUDA error: an illegal memory access was encountered")
    assert r1["peak_raises"][0] == "RuntimeError" and "rank 0 raised" in r1["peak_raises"][1]
    for r in (r0, r1):
        assert r["different_starts"][0] == "ValueError" and "different batch sizes [1, 2]" in r["different_starts"][1]
    assert r0["not_a_member"] is None  # rank 0 searched alone in its one-rank group
    assert r1["not_a_member"][0] == "ValueError" and "not a member" in r1["not_a_member"][1]
    assert r0["after"] == r1["after"] == int(search(line(GiB, 100 * MiB), CAPACITY)[0])


def test_distributed_arguments_without_a_process_group():
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        hotloop.find_max_batch_size(lambda s: None, memory=FakeMemory(), all_ranks=True)
    with pytest.raises(ValueError, match="process_group= with all_ranks=False"):
        hotloop.find_max_batch_size(lambda s: None, memory=FakeMemory(), all_ranks=False, process_group=object())
    with pytest.raises(TypeError, match="all_ranks"):
        hotloop.find_max_batch_size(lambda s: None, memory=FakeMemory(), all_ranks="yes")
    result, _ = search(line(GiB, 100 * MiB), CAPACITY, all_ranks=None)  # not distributed: as before
    assert result.world_size == 1 and all(t.rank_peaks == () for t in result.trials)


# ---- the monitor's gathered report ----

def monitor_body(rank, world_size, library, figures):
    """Each block on this rank with its own scripted figures (NVML through the fake library, torch's
    allocator scripted, the loader's waits); what it printed and reported."""
    mp = pytest.MonkeyPatch()
    os.environ["HOTLOOP_NVML_LIBRARY"] = library
    fake = FakeNvml(library)
    out = {}
    for name, f in figures.items():
        fake.reset()
        mine = f[rank]
        if mine.get("allocated") is not None:
            ScriptedAllocator(mine["reserved0"], mine["allocated"], mine["reserved"]).install(mp)
            fake.set("used", mine["context"] + mine["reserved0"])
        else:
            mp.setattr(torch.cuda, "is_available", lambda: False)
            fake.set("used", mine["context"])
        waits = iter([{"wait_seconds": 3.0, "batches": 5, "samples": 20},
                      {"wait_seconds": 3.0 + mine["wait"], "batches": 9, "samples": 36}])
        mp.setattr(input_wait, "snapshot", lambda: next(waits))
        text = io.StringIO()
        group = dist.new_group([1]) if f.get("group") else None  # every rank makes it; rank 0 is not in it

        def work(fail=False):
            fake.set("spike_value", mine["peak"])
            fake.set("spike_next", 1)
            wait_for(lambda: fake.get("spike_next") == 0)
            time.sleep(0.2)  # the loader's scripted wait is a share of this
            if fail:
                raise ValueError("the training loop's error")

        if f.get("raises"):  # a block that raises gathers nothing: each rank prints its own
            train = hotloop.memory_monitor(work, report="table", file=text, interval_ms=0.5, all_ranks=True)
            try:
                train(fail=True)
            except ValueError:
                pass
            report = train.last_report
        elif f.get("explicit"):  # gathered afterwards, by a call on every rank
            with hotloop.MemoryMonitor(interval_ms=0.5, report="table", file=text) as mon:
                work()
            report = mon.report(all_ranks=True)
            assert mon.report(all_ranks=True) is report  # gathered once: no second collective
        else:
            train = hotloop.memory_monitor(work, report="table", file=text, interval_ms=0.5, all_ranks=True,
                                           process_group=group)
            train()
            report = train.last_report
        out[name] = {"printed": text.getvalue(), "report": report.to_dict(), "text": str(report)}
        mp.undo()
    return out


def rank_figures(imbalance, torch_figures=True):
    """Per-rank figures whose peaks (device used) differ by `imbalance`, the difference in torch's
    allocated memory; rank 1 waits on its loader far longer."""
    context = 500 * MiB + 4096 * random.randint(1, 1000)
    reserved0 = random.randint(1, 3) * GiB
    base = random.randint(8, 30) * GiB
    out = []
    for rank, wait in ((0, 0.001), (1, 0.2)):
        allocated = base + (rank * int((imbalance - 1) * (base + context + 1 * GiB)))
        reserved = allocated + 512 * MiB
        figures = {"context": context, "wait": wait, "peak": context + reserved + 512 * MiB}
        if torch_figures:
            figures.update(reserved0=reserved0, allocated=allocated, reserved=reserved)
        out.append(figures)
    return out


def test_gathered_report_has_a_row_per_rank_and_flags_imbalance(fake_nvml_library):
    heavy = random.uniform(1.2, 1.6)
    figures = {"imbalanced": dict(enumerate(rank_figures(heavy))),
               "balanced": dict(enumerate(rank_figures(random.uniform(1.0, 1.05)))),
               "nvml_only": dict(enumerate(rank_figures(heavy, torch_figures=False))),
               "explicit": dict(enumerate(rank_figures(heavy, torch_figures=False)), explicit=True),
               "subgroup": dict(enumerate(rank_figures(heavy)), group=True),
               "raises": dict(enumerate(rank_figures(heavy)), raises=True)}
    r0, r1 = run_ranks(monitor_body, 2, args=(fake_nvml_library, figures), timeout=90)
    print(r0["imbalanced"]["printed"], r0["nvml_only"]["printed"], sep="\n")  # pytest -s shows them

    for name in ("imbalanced", "balanced", "nvml_only"):
        got0, got1 = r0[name]["report"], r1[name]["report"]
        # rank 0 printed one table, a row per rank; rank 1 printed nothing and kept its own report
        assert r1[name]["printed"] == "" and got1["ranks"] == [] and (got1["rank"], got1["world_size"]) == (1, 2)
        assert r0[name]["printed"].strip() == r0[name]["text"] and (got0["rank"], got0["world_size"]) == (0, 2)
        rows = got0["ranks"]
        assert [row["rank"] for row in rows] == [0, 1]
        # each row is what that rank measured itself
        for row, own in zip(rows, (got0, got1), strict=True):
            assert row["peak_device_used"] == own["peak_device_used"] == figures[name][row["rank"]]["peak"]
            for field in ("peak_reserved", "peak_allocated", "fragmentation_at_peak", "non_torch_at_peak",
                          "context_baseline", "stall_fraction", "loader_wait_s", "duration_s"):
                assert row[field] == own[field], (name, field)
        assert rows[1]["stall_fraction"] > 0.1 > rows[0]["stall_fraction"]
        table = r0[name]["printed"].split("per rank (2")[1].splitlines()
        assert table[1].split()[:3] == ["rank", "device", "peak"]
        for line_, row in zip(table[2:4], rows, strict=True):
            assert line_.split()[0] == str(row["rank"]) and format_size(row["peak_device_used"]) in line_
        assert any("rank 1 waited on its data loader" in a for a in got0["advice"])

    flagged = [a for a in r0["imbalanced"]["report"]["advice"] if a.startswith("imbalance")]
    ratio = figures["imbalanced"][1]["peak"] / figures["imbalanced"][0]["peak"]
    heaviest = format_size(figures["imbalanced"][1]["peak"])
    assert len(flagged) == 1 and f"rank 1's peak (device used, NVML) is {heaviest}" in flagged[0]
    assert f"{ratio:.2f}x rank 0's" in flagged[0] and "memory torch allocated" in flagged[0]
    assert "uneven batches or sequence lengths" in flagged[0] and "pipeline stages" in flagged[0]
    table = r0["imbalanced"]["printed"].split("per rank (2")[1].splitlines()
    assert "<- lightest" in table[2] and "<- heaviest" in table[3]
    assert not any(a.startswith("imbalance") for a in r0["balanced"]["report"]["advice"])
    # without torch's figures: the device's peaks, the causes listed without a breakdown
    flagged = [a for a in r0["nvml_only"]["report"]["advice"] if a.startswith("imbalance")]
    assert len(flagged) == 1 and "(device used, NVML)" in flagged[0] and "likely uneven batches" in flagged[0]
    assert "allocated" not in r0["nvml_only"]["printed"].split("per rank")[1].splitlines()[1]

    # gathered by report(all_ranks=True) after the block: the same rows; the block printed each rank's own
    got0, got1 = r0["explicit"]["report"], r1["explicit"]["report"]
    assert "per rank" not in r0["explicit"]["printed"] and "rank 1 of 2" not in r1["explicit"]["printed"]
    assert r1["explicit"]["printed"] and "per rank (2" in r0["explicit"]["text"]
    assert [row["peak_device_used"] for row in got0["ranks"]] == [got0["peak_device_used"], got1["peak_device_used"]]
    assert any(a.startswith("imbalance") for a in got0["advice"]) and got1["ranks"] == []
    for r in (r0, r1):
        got = r["raises"]["report"]
        assert got["world_size"] is None and got["ranks"] == []
        assert r["raises"]["printed"].strip() == r["raises"]["text"]
    # process_group=: a group of rank 1 alone, whose first rank is global rank 1; rank 0 is not in it
    got0, got1 = r0["subgroup"]["report"], r1["subgroup"]["report"]
    assert got0["world_size"] is None and got0["ranks"] == [] and r0["subgroup"]["printed"]
    assert (got1["rank"], got1["world_size"]) == (0, 1) and len(got1["ranks"]) == 1
    assert got1["ranks"][0]["peak_device_used"] == figures["subgroup"][1]["peak"] and r1["subgroup"]["printed"]


def row(rank, allocated, fragmentation=256 * MiB, outside=300 * MiB, context=500 * MiB, nvml=True, stall=None):
    reserved = allocated + fragmentation
    return RankMemory(rank=rank, host="h", device=f"cuda:{rank}", duration_s=1.0,
                      peak_device_used=context + reserved + outside if nvml else None, context_baseline=context,
                      peak_reserved=reserved, peak_allocated=allocated, fragmentation_at_peak=fragmentation,
                      non_torch_at_peak=outside, stall_fraction=stall)


@pytest.mark.parametrize("heaviest", [0, 1])
@pytest.mark.parametrize("part, words", [("allocated", "memory torch allocated"),
                                         ("fragmentation", "expandable_segments:True"),
                                         ("outside", "torch.cuda.set_device(local_rank)")])
def test_imbalance_advice_names_the_part_that_differs(heaviest, part, words):
    base = random.randint(10, 40) * GiB
    extra = int(random.uniform(0.15, 0.5) * base)
    rows = [row(0, base), row(1, base)]
    grown = {"allocated": dict(allocated=base + extra),
             "fragmentation": dict(allocated=base, fragmentation=256 * MiB + extra),
             "outside": dict(allocated=base, outside=300 * MiB + extra)}[part]
    rows[heaviest] = row(heaviest, **grown)
    advice = compute_rank_advice(rows)
    assert len(advice) == 1 and advice[0].startswith(f"imbalance: rank {heaviest}'s peak") and words in advice[0]
    assert f"(+{format_size(extra)})" in advice[0]
    # work only rank 0 does is named where rank 0 is the heaviest by what torch allocated
    assert ("work only rank 0 does" in advice[0]) == (part == "allocated" and heaviest == 0)
    lines = format_ranks(rows)
    assert "<- heaviest" in lines[2 + heaviest] and "<- lightest" in lines[3 - heaviest]


def test_imbalance_threshold_and_what_is_compared():
    base = random.randint(10, 40) * GiB
    total = base + 256 * MiB + 300 * MiB + 500 * MiB  # rank 0's device peak
    just_over, just_under = int(0.1 * total) + 64 * MiB, int(0.1 * total) - 64 * MiB
    assert any(a.startswith("imbalance") for a in compute_rank_advice([row(0, base), row(1, base + just_over)]))
    assert compute_rank_advice([row(0, base), row(1, base + just_under)]) == []
    # a rank without NVML: torch's reserved peaks are compared
    advice = compute_rank_advice([row(0, base, nvml=False), row(1, base + base // 2)])
    assert len(advice) == 1 and "(torch reserved)" in advice[0] and "memory torch allocated" in advice[0]
    # stalls that differ by more than 10 points
    assert compute_rank_advice([row(0, base, stall=0.02), row(1, base, stall=0.10)]) == []
    advice = compute_rank_advice([row(0, base, stall=0.30), row(1, base, stall=0.02)])
    assert len(advice) == 1 and advice[0].startswith("rank 0 waited on its data loader 30 %")


def test_all_ranks_without_a_process_group_changes_nothing(fake):
    out = io.StringIO()
    with hotloop.MemoryMonitor(all_ranks=True, report="table", file=out) as mon:
        pass
    r = mon.report(all_ranks=True)
    assert r.rank is None and r.world_size is None and r.ranks == [] and "per rank" not in out.getvalue()
    assert "hotloop memory report" in out.getvalue()
    with pytest.raises(TypeError, match="all_ranks"):
        hotloop.MemoryMonitor(all_ranks=1)
    with pytest.raises(TypeError, match="all_ranks"):
        mon.report(all_ranks="yes")


# ---- two GPUs, NCCL ----

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def gpu_monitor_body(rank, world_size, extra):
    torch.cuda.empty_cache()
    out = io.StringIO()
    with hotloop.MemoryMonitor(all_ranks=True, report="table", file=out) as mon:
        x = torch.randn(256 * MiB // 4, device="cuda")
        hog = torch.empty(extra[rank], dtype=torch.uint8, device="cuda").fill_(1)
        y = (x * 2).sum()
        torch.cuda.synchronize()
        dist.all_reduce(y)
        torch.cuda.synchronize()
        del hog, x
    r = mon.report()
    return {"printed": out.getvalue(), "report": r.to_dict()}


@pytest.mark.gpu
@two_gpus
def test_gathered_report_on_two_gpus():
    extra = [0, random.randint(3, 6) * GiB]
    r0, r1 = run_ranks(gpu_monitor_body, 2, args=(extra,), backend="nccl", timeout=180)
    print(r0["printed"])
    rows = r0["report"]["ranks"]
    assert [row["rank"] for row in rows] == [0, 1] and r1["printed"] == "" and r1["report"]["ranks"] == []
    assert rows[1]["peak_device_used"] == r1["report"]["peak_device_used"]
    assert rows[1]["peak_allocated"] - rows[0]["peak_allocated"] >= extra[1]
    flagged = [a for a in r0["report"]["advice"] if a.startswith("imbalance")]
    assert len(flagged) == 1 and "rank 1's peak" in flagged[0] and "memory torch allocated" in flagged[0]


def gpu_finder_body(rank, world_size, leave):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).cuda(),
                device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(0, free - leave[rank]), dtype=torch.uint8, device="cuda")  # ranks with different room

    def step(size, sync=False):
        for _ in range(2):
            x = torch.randn(size, 4096, device="cuda")
            if sync:
                model(x).square().mean().backward()
            else:
                with model.no_sync():  # the trials leave out DDP's all-reduce: one rank may run out alone
                    model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    try:
        result = hotloop.find_max_batch_size(step)
        capacity = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):  # the real run, with DDP's all-reduce, at the answer
            step(int(result), sync=True)
        torch.cuda.synchronize()
        return {"size": int(result), "sizes": [t.batch_size for t in result.trials], "text": str(result),
                "peak": torch.cuda.max_memory_reserved(), "capacity": capacity}
    finally:
        del hog
        torch.cuda.empty_cache()


@pytest.mark.gpu
@two_gpus
def test_finder_agrees_on_two_gpus():
    leave = [8 * GiB, random.randint(3, 5) * GiB]
    r0, r1 = run_ranks(gpu_finder_body, 2, args=(leave,), backend="nccl", timeout=300)
    print(r0["text"])
    assert r0["size"] == r1["size"] > 100 and r0["sizes"] == r1["sizes"]
    for r in (r0, r1):  # the real run at the answer fits each rank
        assert r["peak"] <= r["capacity"]

"""The host memory sampler and the report's host part: figures checked against /proc read here, the
copy-on-read finding on a list dataset and its absence on a numpy one, workers that come and go."""
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import hotloop
from hotloop import _C
from hotloop.memory.advice import compute_advice
from hotloop.memory.host import ProcessMemory, oom_kills, processes_of
from hotloop.memory.report import MemoryReport

MiB = 1 << 20


def smaps_rollup(pid="self"):
    """/proc/PID/smaps_rollup parsed here, apart from the C reader: {field: bytes}"""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def meminfo():
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}


class Samples(torch.utils.data.Dataset):
    """Samples of PER floats each, held as a list of Python floats ("list") or one numpy array; each
    __getitem__ reads its sample's floats and reports the worker's own USS, read from /proc here on
    every 25th sample it serves (-1 on the others: the read is slow)."""
    PER = 2000

    def __init__(self, n, kind):
        self.n = n
        values = np.random.rand(n * self.PER)
        self.data = values.tolist() if kind == "list" else values
        self.served = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(0.003)
        chunk = self.data[i * self.PER:(i + 1) * self.PER]
        self.served += 1
        total = float(sum(chunk))  # every float of the sample is read: its reference count written
        own = smaps_rollup() if self.served % 25 == 1 else None
        uss = own["Private_Clean"] + own["Private_Dirty"] if own else -1
        return torch.tensor([total, os.getpid(), uss, self.served], dtype=torch.float64)


def run_loader(kind, loader_class, n=1000, **options):
    ds = Samples(n, kind)
    out = io.StringIO()
    mon = hotloop.MemoryMonitor(file=out, report="table", host_pss_budget=0.5)
    rows = []
    with mon:
        for batch in loader_class(ds, batch_size=10, num_workers=2, **options):
            rows.append(batch)
    rows = torch.cat(rows)
    return mon.report(), out.getvalue(), rows


def worker_readings(rows):
    """{pid: (first uss, last uss, samples served between)} as the workers read themselves"""
    seen = {}
    for pid in rows[:, 1].unique().tolist():
        mine = rows[(rows[:, 1] == pid) & (rows[:, 2] >= 0)]
        mine = mine[mine[:, 3].argsort()]
        seen[int(pid)] = (int(mine[0, 2]), int(mine[-1, 2]), int(mine[-1, 3] - mine[0, 3]))
    return seen


@pytest.fixture
def no_gpu(monkeypatch, tmp_path):
    """the machine as if it had no GPU: no NVML library, no CUDA in torch"""
    monkeypatch.setenv("HOTLOOP_NVML_LIBRARY", str(tmp_path / "no-libnvidia-ml.so"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_sampler_figures_match_proc_read_here():
    """The C reader's figures for this process, a child and the machine against /proc parsed in Python."""
    s = _C.HostSampler(interval_ms=10.0, scan_interval_ms=20.0, pss_budget=1.0)
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(48 << 20); "
                              "b[::4096] = b'x' * len(b[::4096]); print(1, flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"  # its 48 MiB are touched
        s.start()
        time.sleep(0.3)
        s.stop()  # its last reading is a whole one (pss_budget=1: every tick is), a tick ago: read /proc here now
        # (PSS of shared library pages moves with every other process on the machine that maps them)
        mine, theirs = smaps_rollup(), smaps_rollup(child.pid)
        snap = s.snapshot()
        by_pid = {p["pid"]: p for p in snap["processes"]}
        assert snap["main_pid"] == os.getpid() and child.pid in by_pid
        assert by_pid[child.pid]["ppid"] == os.getpid() and by_pid[child.pid]["alive"]
        for pid, ref in ((os.getpid(), mine), (child.pid, theirs)):
            got = by_pid[pid]
            assert abs(got["last_pss"] - ref["Pss"]) <= max(0.05 * ref["Pss"], 4 * MiB), (pid, got, ref)
            uss = ref["Private_Clean"] + ref["Private_Dirty"]
            assert abs(got["last_uss"] - uss) <= max(0.05 * uss, 4 * MiB)
        assert by_pid[child.pid]["last_uss"] >= 48 * MiB
        one = _C.proc_memory(child.pid)
        ref = smaps_rollup(child.pid)
        assert abs(one["pss"] - ref["Pss"]) <= 1 * MiB and one["swap"] == ref["SwapPss"]
        info, machine = meminfo(), _C.machine_memory()
        assert machine["total"] == info["MemTotal"] == snap["total"]
        assert machine["swap_total"] == info["SwapTotal"]
        assert abs(machine["available"] - info["MemAvailable"]) < 0.05 * info["MemTotal"]
        assert snap["ticks"] >= 3 and snap["rounds"] >= 2 and snap["errors"] == 0
    finally:
        child.kill()
        child.wait()


def test_tick_sums_add_up():
    """Each tick's tree figures are the sum of its processes' records; the peak is the largest sum."""
    s = _C.HostSampler(interval_ms=10.0, scan_interval_ms=20.0, pss_budget=1.0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        s.start()
        time.sleep(0.3)
        s.stop()
    finally:
        child.kill()
        child.wait()
    snap = s.snapshot()
    tl = hotloop.memory.Timeline(None, 0.0, host=snap)
    assert len(tl.host) == snap["ticks"] >= 3
    for tick in tl.host:
        mine = tl.procs[tl.procs["t"] == tick["t"]]
        assert len(mine) == tick["processes"] and tick["unreadable"] == 0
        assert int(mine["pss"].sum()) == tick["tree_pss"] and int(mine["rss"].sum()) == tick["tree_rss"]
        assert int(mine["pss"][mine["pid"] == os.getpid()].sum()) == tick["main_pss"]
    whole = tl.host["whole"] == 1
    assert whole[0] and snap["whole_ticks"] == whole.sum()  # the first tick of a window reads every process
    assert snap["peak_tree_pss"] == tl.host_tree_pss[whole].max()
    assert snap["peak_processes"] >= 2 and child.pid in set(tl.procs["pid"].tolist())


def test_list_dataset_grows_every_worker_and_the_advice_fires():
    """A dataset of Python floats read in __getitem__: each worker's USS grows steadily, as the workers
    themselves read it from /proc, and the advice names copy-on-read and its fixes with the figures."""
    r, text, rows = run_loader("list", torch.utils.data.DataLoader)
    workers = [p for p in r.host_processes if p.role == "torch worker"]
    reported = worker_readings(rows)
    assert {w.pid for w in workers} >= set(reported)
    for pid, (first, last, served) in reported.items():
        w = next(w for w in workers if w.pid == pid)
        assert w.steady_growth and w.exited and not w.low_memory_exit
        # its own first and last reads bracket the sampler's window: the growth agrees within a tick's worth
        assert last - first >= 16 * MiB
        assert abs(w.growth_bytes - (last - first)) <= 0.25 * (last - first), (w, first, last)
        assert w.growth_bytes_per_s > 0 and w.steadiness >= 0.8
    advice = "\n".join(r.advice)
    assert "copy-on-read" in advice and "numpy arrays or torch tensors" in advice and "memory-mapped" in advice
    assert "fewer workers" in advice and "#13246" in advice
    assert all(f"pid {pid} +" in advice for pid in reported)
    assert "steady" in text and "copy-on-read" in text
    assert r.host_forecast is not None and r.host_forecast["seconds"] > 0


def test_growth_per_thousand_samples_from_a_hotloop_dataloader():
    """hotloop.DataLoader counts its samples: each worker's growth per 1,000 samples agrees with the
    figure the worker computes from its own /proc reads and its own count of samples served."""
    r, text, rows = run_loader("list", hotloop.DataLoader)
    assert r.loader_samples == 1000
    reported = worker_readings(rows)
    busiest = max(reported, key=lambda pid: reported[pid][2])
    first, last, served = reported[busiest]
    own = (last - first) / served * 1000 / MiB
    w = next(p for p in r.host_processes if p.pid == busiest)
    assert w.growth_mib_per_1k_samples is not None
    assert abs(w.growth_mib_per_1k_samples - own) <= 0.35 * own, (w, own)
    assert "MiB per 1,000 samples" in text
    if any(p.steady_growth for p in r.host_processes):  # (the torch loader's test requires it)
        assert r.host_forecast["samples"] > 0 and "more samples" in text


def test_numpy_dataset_shows_no_growth_and_no_advice():
    r, text, rows = run_loader("array", torch.utils.data.DataLoader)
    workers = [p for p in r.host_processes if p.role == "torch worker"]
    assert len(workers) >= 2
    for pid, (first, last, served) in worker_readings(rows).items():
        # the workers' own reads: nothing of the data copied (the list's workers copy ~30 MiB each; the
        # bound leaves room for an AddressSanitizer build's own allocator growth)
        assert abs(last - first) < 12 * MiB
        w = next(w for w in workers if w.pid == pid)
        assert not w.steady_growth and w.growth_bytes < 12 * MiB
    assert not any("copy-on-read" in a for a in r.advice) and r.host_forecast is None


def test_report_host_lines_add_up(no_gpu):
    r, text, _ = run_loader("array", torch.utils.data.DataLoader, n=300)
    assert r.host and not r.nvml and r.device is None
    assert r.host_peak_bytes == r.host_peak_main_bytes + r.host_peak_children_bytes
    assert r.host_peak_bytes == int(r.timeline.host_tree_pss.max())
    at_peak = r.timeline.host[r.timeline.host_tree_pss.argmax()]
    assert at_peak["main_pss"] == r.host_peak_main_bytes and at_peak["processes"] == r.host_peak_processes
    assert r.host_peak_processes >= 3  # the main process and two workers at once
    line = next(line for line in text.splitlines() if "peak host memory (PSS)" in line)
    assert f"+ {r.host_peak_processes - 1} other processes" in line
    assert r.cpu_main_s > 0 and r.cpu_children_s > 0
    assert r.host_available_min_bytes <= r.host_total_bytes == meminfo()["MemTotal"]


def test_workers_that_come_and_go_are_each_followed(no_gpu):
    """Three epochs without persistent workers: six workers, each seen, each gone; a process killed
    meanwhile is marked gone, the sampler goes on."""
    ds = Samples(300, "array")
    loader = torch.utils.data.DataLoader(ds, batch_size=10, num_workers=2, persistent_workers=False)
    with hotloop.MemoryMonitor(report=None, host_pss_budget=0.5) as mon:
        pids = set()
        for _ in range(3):
            pids |= {int(p) for p in torch.cat(list(loader))[:, 1].tolist()}
        victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        time.sleep(0.8)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        time.sleep(0.3)
    r = mon.report()
    assert len(pids) == 6
    seen = {p.pid: p for p in r.host_processes}
    assert pids <= set(seen) and victim.pid in seen
    assert all(seen[pid].exited and seen[pid].readings >= 1 for pid in pids | {victim.pid})
    assert not seen[victim.pid].low_memory_exit  # the machine had memory: not the OOM killer's


def test_given_pids_outside_the_tree_are_watched():
    """set_pids() names processes that are not descendants (a forkserver's worker, an adopted one)."""
    orphan = subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    pid = int(orphan.stdout)
    try:
        s = _C.HostSampler(interval_ms=10.0, pss_budget=1.0)
        s.set_pids([pid])
        s.start()
        time.sleep(0.2)
        s.stop()
        got = {p["pid"]: p for p in s.snapshot()["processes"]}
        assert got[pid]["given"] and got[pid]["ppid"] != os.getpid()
        assert got[pid]["last_pss"] > 0
    finally:
        os.kill(pid, signal.SIGKILL)


def test_json_is_one_object_with_the_same_keys_without_a_gpu(no_gpu):
    out = io.StringIO()

    @hotloop.memory_monitor(report="json", file=out)
    def train():
        time.sleep(0.05)

    train()
    d = json.loads(out.getvalue())
    assert set(d) == {f.name for f in dataclasses.fields(MemoryReport)} - {"timeline"}
    for key in ("peak_device_used", "peak_allocated", "peak_reserved", "device_total", "util_mean", "device"):
        assert d[key] is None
    assert d["host"] is True and d["host_peak_bytes"] > 0 and d["host_processes"][0]["role"] == "main"


def test_json_has_the_same_keys_with_a_fake_gpu(fake_nvml_library, monkeypatch):
    monkeypatch.setenv("HOTLOOP_NVML_LIBRARY", fake_nvml_library)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = io.StringIO()
    with hotloop.MemoryMonitor(report="json", file=out):
        time.sleep(0.02)
    d = json.loads(out.getvalue())
    assert set(d) == {f.name for f in dataclasses.fields(MemoryReport)} - {"timeline"}
    assert d["peak_device_used"] is not None and d["host_peak_bytes"] > 0


def _process(**kw):
    base = dict(pid=11, ppid=10, role="worker", start_s=0.0, end_s=10.0, first_pss=100 * MiB, last_pss=900 * MiB,
                peak_pss=900 * MiB, first_uss=10 * MiB, last_uss=810 * MiB, growth_bytes=800 * MiB,
                growth_bytes_per_s=80 * MiB, steadiness=0.99, readings=50, exited=True,
                available_at_exit=40 * MiB, low_memory_exit=True)
    base.update(kw)
    return ProcessMemory(**base)


def test_a_worker_gone_with_memory_near_zero_is_named_as_the_oom_killers():
    r = MemoryReport(host=True, host_processes=[_process()])
    advice = "\n".join(compute_advice(r))
    assert "OOM killer" in advice and "pid 11" in advice and "+0.78 GiB" in advice and "40.0 MiB" in advice
    r = MemoryReport(host=True, host_processes=[_process(low_memory_exit=False)])
    assert "OOM killer" not in "\n".join(compute_advice(r))


def test_low_memory_exit_read_from_the_sampler_snapshot():
    """processes_of marks a process that vanished while available memory was below the threshold."""
    def record(pid, alive, available):
        return dict(pid=pid, ppid=1, alive=alive, given=False, first_t=1.0, last_t=2.0, gone_t=None if alive else 2.1,
                    first_pss=MiB, last_pss=2 * MiB, peak_pss=2 * MiB, first_uss=MiB, last_uss=2 * MiB, first_rss=MiB,
                    last_rss=2 * MiB, peak_rss=2 * MiB, samples=4, sum_t=2.0, sum_tt=1.5, sum_p=6.0, sum_tp=3.5,
                    sum_pp=10.0, cpu_s=0.5, available_last=available, forked=pid != 1, comm="python",
                    unreadable=False)
    snap = {"main_pid": 1, "total": 64 << 30, "running": False,
            "processes": [record(1, True, 1 << 30), record(2, False, 100 * MiB), record(3, False, 8 << 30)]}
    got = {p.pid: p for p in processes_of(snap, 0.0, None)}
    assert all(p.samples is None for p in got.values())
    assert got[1].role == "main" and not got[1].exited
    assert got[2].low_memory_exit and got[2].available_at_exit == 100 * MiB
    assert got[3].exited and not got[3].low_memory_exit


@pytest.mark.parametrize("kwargs, error", [
    (dict(interval_ms=0.5), ValueError), (dict(pss_budget=0.0), ValueError), (dict(pss_budget=2.0), ValueError),
    (dict(scan_interval_ms=1.0, interval_ms=10.0), ValueError), (dict(capacity=0), ValueError),
])
def test_sampler_arguments_are_checked(kwargs, error):
    with pytest.raises(error):
        _C.HostSampler(**kwargs)


def test_set_pids_checks_its_argument():
    s = _C.HostSampler()
    with pytest.raises(TypeError, match="sequence"):
        s.set_pids(5)
    with pytest.raises(ValueError, match="positive"):
        s.set_pids([os.getpid(), -3])
    with pytest.raises(ValueError, match="at most"):
        s.set_pids(list(range(1, _C.HOST_MAX_GIVEN_PIDS + 2)))


def test_fork_leaves_no_host_sampler_running_in_the_child():
    s = _C.HostSampler(interval_ms=10.0)
    s.start()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the sampler's thread is not here; stopping and freeing must not hang
            try:
                ok = not s.running
                s.stop()
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert s.running
    finally:
        s.stop()


def test_monitor_cli_csv_has_the_host_columns(fake_nvml_library, tmp_path):
    """`hotloop monitor --pid P --csv F`: the machine's available memory and P's tree (P and its child)."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                               "print(c.pid, flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        int(parent.stdout.readline())
        out = tmp_path / "rows.csv"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
        env["HOTLOOP_NVML_LIBRARY"] = fake_nvml_library
        p = subprocess.run([sys.executable, "-m", "hotloop", "monitor", "--interval-ms", "100", "--duration", "1.0",
                            "--pid", str(parent.pid), "--csv", str(out)], capture_output=True, text=True, env=env,
                           timeout=120)
        assert p.returncode == 0, p.stderr
        rows = list(__import__("csv").DictReader(open(out)))
        assert len(rows) >= 3
        total = meminfo()["MemTotal"] / MiB
        for r in rows:
            assert 0 < float(r["host_available_mib"]) <= total
            assert r["host_swap_used_mib"] != ""
        assert rows[-1]["tree_processes"] == "2" and float(rows[-1]["tree_pss_mib"]) > 1
        assert f"tree of pid {parent.pid}: peak" in p.stdout and "summary host: available at least" in p.stdout
    finally:
        parent.kill()
        parent.wait()


def test_the_demo_on_a_cpu_shows_the_host_report(tmp_path):
    """The README's first command on a machine without a GPU: the report of the host, its memory, its
    CPU time and the loader's stalls."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NVML_", "HOTLOOP_NVML"))}
    env.update(HOTLOOP_NVML_LIBRARY=str(tmp_path / "no-libnvidia-ml.so"), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "hotloop", "demo", "--device", "cpu", "--steps", "24", "--batch-size",
                        "16", "--workers", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "hotloop memory report: host (no GPU)" in p.stderr, p.stderr
    line = next(line for line in p.stderr.splitlines() if "peak host memory (PSS)" in line)
    assert "= main process" in line and "other process" in line
    assert "CPU time" in p.stderr and "data loader stalls" in p.stderr
    # the loader's worker has its line (24 steps: a worker alive for a few host samples; with 4 the
    # monitored loop took 0.09 s, and the sampler met the worker in about half the runs)
    assert "worker " in p.stderr


class KillsItsWorkerOnce(torch.utils.data.Dataset):
    """Sample 5 kills its worker with SIGKILL (as the OOM killer does) the first time it is read."""

    def __init__(self, flag):
        self.flag = flag

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == 5 and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([float(i)])


@pytest.mark.parametrize("oom_rose", [True, False])
def test_a_worker_killed_while_the_oom_killer_struck_is_named_so(tmp_path, monkeypatch, caplog, oom_rose):
    """hotloop's restart message says a SIGKILLed worker was the OOM killer's when /proc/vmstat's
    oom_kill rose meanwhile (the counter scripted here: a real OOM kill cannot be staged in CI), and
    says nothing of it otherwise."""
    import hotloop.data.consumer.pool as pool
    import hotloop.memory.host as host

    monkeypatch.setattr(pool, "oom_kills", lambda: 3)
    monkeypatch.setattr(host, "oom_kills", lambda: 4 if oom_rose else 3)
    loader = hotloop.DataLoader(KillsItsWorkerOnce(str(tmp_path / "killed")), batch_size=2, num_workers=2)
    with caplog.at_level("WARNING"):
        got = torch.cat(list(loader))
    assert torch.equal(got.flatten(), torch.arange(12.0))  # the batch was redone by the successor
    death = [rec.getMessage() for rec in caplog.records if "is killed by signal" in rec.getMessage()]
    assert len(death) == 1, caplog.text
    if oom_rose:
        assert "OOM killer killed 1 process(es) meanwhile" in death[0] and "available now" in death[0]
        assert "copy-on-read" in death[0]
    else:
        assert "OOM" not in death[0]


def test_oom_kills_reads_proc_vmstat():
    with open("/proc/vmstat") as f:
        line = next((line for line in f if line.startswith("oom_kill ")), None)
    expected = None if line is None else int(line.split()[1])
    assert oom_kills() == expected


def test_samples_are_shared_out_by_cpu_time():
    """The loop's samples go to the workers by their CPU time: an idle child (a leftover worker of
    another loader, a subprocess) gets none and leaves the others' figures alone."""
    def record(pid, ppid, cpu, growth):
        return dict(pid=pid, ppid=ppid, alive=True, given=False, first_t=1.0, last_t=3.0, gone_t=None,
                    first_pss=MiB, last_pss=MiB, peak_pss=MiB, first_uss=8 * MiB, last_uss=8 * MiB + growth,
                    first_rss=MiB, last_rss=MiB, peak_rss=MiB, samples=6, sum_t=6.0, sum_tt=8.0, sum_p=6.0,
                    sum_tp=6.0, sum_pp=6.0, cpu_s=cpu, available_last=1 << 30, forked=pid != 1, comm="python",
                    unreadable=False)
    cpu = np.random.uniform(0.5, 3.0, size=2)
    growth = np.random.randint(10, 90, size=2) * MiB
    snap = {"main_pid": 1, "total": 64 << 30, "processes": [
        record(1, 0, 5.0, 0), record(2, 1, float(cpu[0]), int(growth[0])), record(3, 1, float(cpu[1]), int(growth[1])),
        record(4, 1, 0.0, 0)]}
    got = {p.pid: p for p in processes_of(snap, 0.0, 1000, hotloop_fed=True)}  # forks of main: hotloop's workers
    assert got[2].role == got[3].role == "worker"
    assert got[1].samples is None and got[4].samples is None  # the main process; the idle child
    for pid, i in ((2, 0), (3, 1)):
        share = 1000 * cpu[i] / cpu.sum()
        assert got[pid].samples == pytest.approx(share)
        assert got[pid].growth_mib_per_1k_samples == pytest.approx(growth[i] / MiB / share * 1000)


def test_smaps_sums_agree_with_smaps_rollup():
    """Where the kernel has no smaps_rollup (before 4.14, some sandboxes) the reader sums smaps: the same
    figures, to the per-mapping rounding of the kernel's kB."""
    keep = np.random.rand(4 << 20)  # 32 MiB of this process's own
    rollup, sums = _C.proc_memory(os.getpid()), _C.proc_memory(os.getpid(), rollup=False)
    assert keep.sum() > 0
    assert sums["rss"] == pytest.approx(rollup["rss"], abs=2 * MiB)
    assert sums["pss"] == pytest.approx(rollup["pss"], abs=2 * MiB)
    assert sums["uss"] == pytest.approx(rollup["uss"], abs=2 * MiB) and sums["uss"] >= 32 * MiB
    assert _C.proc_memory(2 ** 31 - 1) is None and _C.proc_memory(2 ** 31 - 1, rollup=False) is None
    with pytest.raises(ValueError, match="positive process id"):
        _C.proc_memory(0)

"""The host report's truth about the process tree, on a CPU with real forked workers of hotloop's and torch's
loaders: copy-on-read named with the figures /proc gives, a peak that is one moment's sum, live workers not gone,
a child that is no worker named by its command, windows that nest and run in threads, a monitor cheap to enter."""
import io
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import hotloop
from hotloop.memory import host as host_module

from .test_host import MiB, Samples, no_gpu, smaps_rollup, worker_readings  # noqa: F401  (no_gpu: a fixture)

LOADERS = {"hotloop": hotloop.DataLoader, "torch": torch.utils.data.DataLoader}


def run(kind, loader, epochs=1, n=600, persistent=False, **monitor):
    """`epochs` passes over a Samples dataset by 2 workers inside a monitor; (report, its text, rows served)"""
    ds = Samples(n, kind)
    out = io.StringIO()
    mon = hotloop.MemoryMonitor(file=out, report="table", host_pss_budget=0.5, **monitor)
    rows = []
    with mon:
        dl = LOADERS[loader](ds, batch_size=10, num_workers=2, persistent_workers=persistent)
        for _ in range(epochs):
            rows += list(dl)
    return mon.report(), out.getvalue(), torch.cat(rows), dl


def _size(text):
    value, unit = re.fullmatch(r"([\d.]+) (KiB|MiB|GiB)", text).groups()
    return float(value) * {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


@pytest.mark.parametrize("loader", ["hotloop", "torch"])
def test_list_dataset_gets_copy_on_read_advice_with_the_figures_proc_gives(no_gpu, loader):
    r, text, rows, _ = run("list", loader, n=1200)  # each worker copies the half it reads: ~20 MiB
    own = worker_readings(rows)  # each worker's USS read by itself from /proc, first sample to last
    assert len(own) == 2
    copied = np.mean([last - first for first, last, _ in own.values()])
    assert copied >= 16 * MiB
    advice = next(a for a in r.advice if "copy-on-read" in a)
    each = _size(re.search(r"each worker copied about ([\d.]+ [KMG]iB)", advice).group(1))
    assert abs(each - copied) <= 0.2 * copied, (each, copied, advice)
    together = _size(re.search(r"2 workers hold ([\d.]+ [KMG]iB) together", advice).group(1))
    held = sum(last for _, last, _ in own.values())  # their own last readings of their USS
    assert abs(together - held) <= 0.2 * held, (together, held, advice)
    assert "numpy arrays or torch tensors, Arrow, or a memory-mapped file" in advice and "#13246" in advice
    workers = [p for p in r.host_processes if p.pid in own]
    # flagged as a plateau (copied) or, where the copy was still going on at the last reading, as steady growth
    assert len(workers) == 2 and all(p.is_worker for p in workers) and any(p.copied or p.steady_growth for p in workers)
    assert {p.role for p in workers} == {"worker" if loader == "hotloop" else "torch worker"}


def test_copy_on_read_is_weighed_against_what_workers_can_copy_not_mapped_files(no_gpu, tmp_path):
    """A CUDA process's USS holds the private pages of the libraries it maps (file pages no other
    process maps), which no worker copies. Here a file mapped and read stands in for them: it makes
    main's USS large enough that the workers' copies, against USS, fall under the advice's share;
    against main's anonymous memory, where the list lives, they do not. Both sizes follow main's
    anonymous memory as the test starts (a long test session holds more of it)."""
    import mmap

    anon = host_module.rss_anon()
    # a list of about a sixth of main's anonymous memory: each worker, copying the half it reads, copies
    # over COPY_MIN_SHARE of main's anonymous memory with the list; a mapped file twice that memory
    # keeps the copies under COPY_MIN_SHARE of main's USS
    n = max(1200, int(anon / 6 / (Samples.PER * 32)))  # a float in a list: its object and its slot
    path = tmp_path / "mapped-library-stand-in"
    with open(path, "wb") as f:
        f.truncate(max(768 * MiB, 2 * anon) // 4096 * 4096)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    try:
        assert int(np.frombuffer(mapped, dtype=np.uint8)[::4096].sum()) == 0  # every page read: resident here
        assert smaps_rollup(os.getpid())["Private_Clean"] >= 700 * MiB  # in main's USS, not its RssAnon
        r, text, rows, _ = run("list", "hotloop", n=n)
        workers = [p for p in r.host_processes if p.is_worker]
        assert len(workers) == 2 and all(p.copied for p in workers), text
        assert any("copy-on-read" in a for a in r.advice), text
    finally:
        mapped.close()


@pytest.mark.parametrize("loader", ["hotloop", "torch"])
def test_numpy_dataset_gets_no_copy_on_read_advice(no_gpu, loader):
    r, text, rows, _ = run("array", loader)
    for first, last, _ in worker_readings(rows).values():
        assert abs(last - first) < 12 * MiB  # the workers' own reading: nothing of the data copied
    assert not any("copy-on-read" in a for a in r.advice)
    assert not any(p.copied or p.steady_growth for p in r.host_processes)


@pytest.mark.parametrize("loader", ["hotloop", "torch"])
def test_live_workers_are_not_gone(no_gpu, loader):
    r, text, rows, dl = run("array", loader, epochs=2, n=200, persistent=True)
    try:
        served = set(int(p) for p in rows[:, 1].tolist())
        seen = {p.pid: p for p in r.host_processes}
        assert served <= set(seen)
        for pid in served:
            os.kill(pid, 0)  # alive now, after the monitor's end
            assert not seen[pid].exited and seen[pid].is_worker
        # each served worker's own row says it lived on; other rows may tell of a process that did exit
        # (a previous test's launcher still winding down, a short subprocess), and say so truly
        for pid in served:
            row = next(line for line in text.splitlines() if f"pid {pid} " in line)
            assert "alive at the end" in row and "gone" not in row and "exited" not in row, row
    finally:
        del dl


def test_a_child_that_is_no_worker_is_named_by_its_command(no_gpu):
    with hotloop.MemoryMonitor(report=None, host_pss_budget=0.5) as mon:
        child = subprocess.Popen(["sleep", "30"])
        try:
            time.sleep(0.4)  # a scan of /proc finds it
        finally:
            child.kill()
            child.wait()
        time.sleep(0.2)
    p = next(p for p in mon.report().host_processes if p.pid == child.pid)
    assert p.role == "child" and p.command == "sleep" and not p.is_worker and p.exited
    assert f"child (sleep) pid {child.pid}" in re.sub(r" +", " ", str(mon.report()))


def _tree_pss(pids):
    return sum(smaps_rollup(pid)["Pss"] for pid in pids)


def test_the_peak_is_one_moments_sum_across_a_fork(no_gpu):
    """Main holds 96 MiB, then forks a child that shares them: the tree's PSS is the same before and after (the
    pages are shared, not copied). A sum of main's reading from before the fork and the child's from after it
    would count half of them twice; the peak must equal this test's own reading of the tree, taken at once."""
    with hotloop.MemoryMonitor(report=None, host_interval_ms=20.0, host_pss_budget=1.0) as mon:
        block = np.random.rand(96 * MiB // 8)  # touched: main's own
        time.sleep(0.3)
        r_fd, w_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child only sleeps: it shares main's pages
            os.close(r_fd)
            os.write(w_fd, b"1")
            time.sleep(30)
            os._exit(0)
        os.close(w_fd)
        os.read(r_fd, 1)
        time.sleep(0.5)
        own = _tree_pss([os.getpid(), pid])  # this test's reading of the whole tree, now
        time.sleep(0.2)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    r = mon.report()
    assert block.sum() > 0
    tl = r.timeline
    whole = tl.host["whole"] == 1
    assert r.host_peak_bytes == int(tl.host_tree_pss[whole].max())  # the peak is over whole ticks only
    peak_tick = tl.host[whole][tl.host_tree_pss[whole].argmax()]
    records = tl.procs[tl.procs["t"] == peak_tick["t"]]
    assert int(records["pss"].sum()) == r.host_peak_bytes  # one tick's records make it
    assert abs(r.host_peak_bytes - own) <= max(0.05 * own, 8 * MiB), (r.host_peak_bytes, own)


def test_samplers_are_made_once_and_entering_is_cheap(no_gpu):
    """Every monitor of the process opens a window on one host sampler and one thread: no thread is started or
    joined per monitor; and entering and leaving is cheap (loose: the machine is shared)."""
    def tasks():
        return set(os.listdir("/proc/self/task"))

    with hotloop.MemoryMonitor(report=None):
        pass
    sampler = host_module.shared_sampler(50.0, 131072 // 16, 0.02)
    before = tasks()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        with hotloop.MemoryMonitor(report=None) as mon:
            pass
        times.append(time.perf_counter() - t0)
        assert mon._host.sampler is sampler
    assert tasks() == before  # the same threads: none started, none ended
    assert sorted(times)[10] < 0.05


def test_nested_and_threaded_monitors_each_get_their_window(no_gpu):
    out = io.StringIO()
    with hotloop.MemoryMonitor(report=None, host_pss_budget=0.5) as outer:
        time.sleep(0.3)
        with hotloop.MemoryMonitor(report=None, host_pss_budget=0.5) as inner:
            time.sleep(0.3)
        reports = {}

        def watched(name):
            with hotloop.MemoryMonitor(report="table", file=out, host_pss_budget=0.5) as m:
                time.sleep(0.3)
            reports[name] = m.report()

        threads = [threading.Thread(target=watched, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.2)
    o, i = outer.report(), inner.report()
    assert o.duration_s > i.duration_s + 0.4
    assert o.host_samples > i.host_samples >= 3
    ti, to = i.timeline.host_time, o.timeline.host_time
    assert ti.min() >= -0.01 and ti.max() <= i.duration_s + 0.06 and to.max() > i.duration_s + 0.3
    assert set(reports) == {0, 1} and all(r.host_samples >= 3 for r in reports.values())
    assert out.getvalue().count("hotloop memory report") == 2


def test_a_raising_function_still_gets_its_report(no_gpu):
    out = io.StringIO()
    error = ValueError(f"boom {np.random.randint(1 << 30)}")

    @hotloop.memory_monitor(file=out)
    def train():
        time.sleep(0.1)
        raise error

    with pytest.raises(ValueError) as caught:
        train()
    assert caught.value is error
    assert "hotloop memory report" in out.getvalue() and train.last_report.host


def _monitor_cli(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NVML_", "HOTLOOP_NVML"))}
    env["HOTLOOP_NVML_LIBRARY"] = "/nonexistent/libnvidia-ml.so"
    return subprocess.run([sys.executable, "-m", "hotloop", "monitor", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_monitor_pid_without_a_gpu_prints_host_rows(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(32 << 20); b[::4096] = b'x' * "
                              "len(b[::4096]); time.sleep(30)"])
    try:
        time.sleep(0.5)
        csv_path = tmp_path / "rows.csv"
        p = _monitor_cli("--interval-ms", "100", "--duration", "1.0", "--pid", str(child.pid), "--csv", str(csv_path))
        assert p.returncode == 0, p.stderr
        assert "logging the host alone" in p.stderr
        rows = [line.split() for line in p.stdout.splitlines() if re.match(r"\d\d:\d\d:\d\d\.\d{3} ", line)]
        assert len(rows) >= 3
        own = smaps_rollup(child.pid)["Pss"] / MiB
        for row in rows:  # time, available MiB, tree MiB: the GPU columns are empty
            assert len(row) == 3 and float(row[1]) > 0 and abs(float(row[2]) - own) <= max(0.2 * own, 4)
        lines = csv_path.read_text().splitlines()
        assert lines[0].startswith("time,gpu,used_mib") and len(lines) == len(rows) + 1
        cells = lines[-1].split(",")
        assert cells[1:14] == [""] * 13 and float(cells[14]) > 0 and cells[17] == "1"
    finally:
        child.kill()
        child.wait()


def test_monitor_pid_that_does_not_exist_or_exits_is_said_and_monitoring_goes_on():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
    p = _monitor_cli("--interval-ms", "100", "--duration", "1.5", "--pid", str(child.pid))
    child.wait()
    assert p.returncode == 0, p.stderr
    assert f"--pid {child.pid} exited; logging the machine's memory alone" in p.stderr
    late = [line for line in p.stdout.splitlines() if re.match(r"\d\d:\d\d:\d\d\.\d{3} ", line)][-1].split()
    assert len(late) == 2 and float(late[1]) > 0  # the machine's column goes on
    p = _monitor_cli("--interval-ms", "100", "--duration", "0.3", "--pid", "4194303")
    assert p.returncode == 0 and "--pid 4194303: no such process" in p.stderr

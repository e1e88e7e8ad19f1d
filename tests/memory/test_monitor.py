"""The C sampler and MemoryMonitor against a fake NVML built at test time (CPU, no GPU needed)."""
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import hotloop
from hotloop import _C, input_wait, memory
from hotloop.memory.advice import compute_advice

from ..forked import wait_for_child
from ..seeding import derived_seed
from .conftest import GiB, MiB, ScriptedAllocator, wait_for


def thread_count():
    return len(os.listdir("/proc/self/task"))


def test_exact_peak_includes_a_spike_the_ring_dropped(fake):
    rng = np.random.default_rng(derived_seed())
    base = int(rng.integers(1, 4)) * GiB + int(rng.integers(0, MiB))
    step = int(rng.integers(1, 1000)) * 4096
    spike_call = int(rng.integers(20, 40))
    spike = 60 * GiB + int(rng.integers(0, MiB))
    fake.set("used", base)
    fake.set("step", step)
    m = _C.Monitor(0, interval_ms=0.2, capacity=8)
    fake.set("memory_calls", 0)  # count from the first sampled call
    fake.set("spike_call", spike_call)
    fake.set("spike_value", spike)
    m.start()
    wait_for(lambda: fake.get("memory_calls") > spike_call + 60)
    m.stop()
    s = m.snapshot()
    calls = fake.get("memory_calls")
    assert s["memory_samples"] == calls
    assert s["peak_used"] == spike  # exact, although the ring no longer holds that sample
    assert s["peak_t"] > 0 and s["error"] is None
    tl = memory.Timeline(s, s["started"])
    assert len(tl) == 8
    assert s["memory_dropped"] == calls - 8
    # the kept samples are the newest ones, oldest first, every one as the fake scripted it
    expected = base + step * np.arange(calls - 8, calls, dtype=np.int64)
    np.testing.assert_array_equal(tl.used.astype(np.int64), expected)
    assert spike not in tl.used
    assert np.all(np.diff(tl.time) > 0)
    assert np.all(tl.reserved == 512 * MiB)
    assert np.all(tl.free == 80 * GiB - 512 * MiB - tl.used)


def test_start_stop_twice_and_threads_joined(fake):
    before = thread_count()
    m = _C.Monitor(0, interval_ms=1.0, slow_interval_ms=5.0, pcie_interval_ms=1.0, capacity=64)
    fake.set("pcie_delay_us", 2000)
    for run in range(2):
        m.start()
        assert m.running
        assert thread_count() == before + 2  # the sampler and the PCIe reader
        with pytest.raises(RuntimeError, match="already running"):
            m.start()
        wait_for(lambda: m.snapshot()["memory_samples"] >= 20 and m.snapshot()["pcie_samples"] >= 2)
        m.stop()
        assert not m.running
        assert thread_count() == before  # both joined
        s = m.snapshot()
        assert s["memory_samples"] >= 20 and s["slow_samples"] >= 1 and s["pcie_samples"] >= 2
        assert s["ticks"] >= s["memory_samples"]
        if run == 1:  # a second start clears the first run
            assert s["started"] > first_started
        first_started = s["started"]
        m.stop()  # stopping a stopped monitor does nothing
    tl = memory.Timeline(m.snapshot(), first_started)
    assert np.all(tl.pcie_rx_mb_s == 1000 / 1024) and np.all(tl.pcie_tx_mb_s == 2000 / 1024)
    assert np.all(tl.util_gpu == 97) and np.all(tl.power_w == 300.0) and np.all(tl.temperature_c == 55)


def test_pcie_reads_do_not_hold_up_the_memory_tick(fake):
    fake.set("pcie_delay_us", 20000)  # like the real call: blocks ~20 ms per counter
    m = _C.Monitor(0, interval_ms=1.0, pcie_interval_ms=1.0, capacity=4096)
    m.start()
    wait_for(lambda: m.snapshot()["pcie_samples"] >= 3)
    m.stop()
    s = m.snapshot()
    # each PCIe sample took >= 40 ms; a 1 ms memory tick held up by it would give ~1 sample per PCIe sample
    assert s["memory_samples"] >= 10 * s["pcie_samples"]


def test_several_monitors_and_devices(fake):
    fake.set_device_count(2)
    a_used, b_used = 3 * GiB + 4096 * int(np.random.randint(1, 100)), 7 * GiB + 4096 * int(np.random.randint(1, 100))
    fake.set("used", a_used, device=0)
    fake.set("used", b_used, device=1)
    a = _C.Monitor(0, interval_ms=0.5)
    b = _C.Monitor("GPU-fake-1", interval_ms=0.5)
    c = _C.Monitor(1, interval_ms=2.0)
    assert (a.device, b.device, c.device) == (0, 1, 1)
    for m in (a, b, c):
        m.start()
    wait_for(lambda: all(m.snapshot()["memory_samples"] >= 10 for m in (a, b, c)))
    for m in (a, b, c):
        m.stop()
    assert a.snapshot()["peak_used"] == a_used
    assert b.snapshot()["peak_used"] == b_used == c.snapshot()["peak_used"]
    with pytest.raises(ValueError, match="0 to 1"):
        _C.Monitor(2)
    with pytest.raises(hotloop.NvmlError) as err:
        _C.Monitor("GPU-nope")
    assert err.value.call == "nvmlDeviceGetHandleByUUID"


def test_bad_arguments(fake):
    with pytest.raises(ValueError, match="interval_ms"):
        _C.Monitor(0, interval_ms=0.0)
    with pytest.raises(ValueError, match="capacity"):
        _C.Monitor(0, capacity=0)
    with pytest.raises(TypeError, match="NVML index"):
        _C.Monitor(1.5)
    with pytest.raises(ValueError, match="report"):
        hotloop.MemoryMonitor(report="xml")


def test_memory_v1_fallback(fake):
    fake.set("no_v2", 1)
    used = 5 * GiB + 4096 * int(np.random.randint(1, 1000))
    fake.set("used", used)
    m = _C.Monitor(0)
    assert not m.memory_v2
    u, reserved, free, total = m.read_memory()
    assert (u, reserved, total) == (used + 512 * MiB, 0, 80 * GiB)  # v1 counts the reservation as used
    assert free == total - u


def test_missing_nvml_is_a_clear_error(fake, monkeypatch, tmp_path):
    monkeypatch.setenv("HOTLOOP_NVML_LIBRARY", str(tmp_path / "libnvidia-ml.so.1"))
    assert "NVML library not found" in _C.nvml_unavailable_reason()
    with pytest.raises(hotloop.NvmlError, match="NVML library not found") as err:
        _C.Monitor(0)
    assert err.value.code == 12 and err.value.call == "dlopen"
    # the Python monitor still runs, and says what is missing
    with hotloop.MemoryMonitor() as mon:
        pass
    r = mon.report()
    assert not r.nvml and "NVML library not found" in r.nvml_unavailable_reason
    assert "NVML" in str(r) and "not available" in str(r)
    assert len(mon.timeline) == 0


def test_nvml_init_failure(fake_nvml_library, monkeypatch, tmp_path):
    copy = tmp_path / "libfake_failing.so"  # a fresh path: a library that opened once stays open
    shutil.copy(fake_nvml_library, copy)
    monkeypatch.setenv("HOTLOOP_NVML_LIBRARY", str(copy))
    monkeypatch.setenv("FAKE_NVML_INIT_ERROR", "9")
    with pytest.raises(hotloop.NvmlError, match="Driver Not Loaded") as err:
        _C.Monitor(0)
    assert err.value.code == 9 and err.value.call == "nvmlInit_v2"


def test_errors_while_sampling(fake):
    m = _C.Monitor(0, interval_ms=0.5)
    fake.fail("nvmlDeviceGetMemoryInfo_v2", 15, after=10)
    m.start()
    wait_for(lambda: m.snapshot()["error"] is not None and m.snapshot()["error"]["count"] >= 5)
    m.stop()
    s = m.snapshot()
    assert s["memory_samples"] == 10  # only the successful readings are samples
    assert s["error"]["code"] == 15 and s["error"]["call"] == "nvmlDeviceGetMemoryInfo_v2"
    assert s["error"]["text"] == "GPU is lost"
    assert s["ticks"] == s["memory_samples"] + s["error"]["count"]
    with pytest.raises(hotloop.NvmlError, match="GPU is lost") as err:
        m.check()
    assert err.value.code == 15 and err.value.call == "nvmlDeviceGetMemoryInfo_v2"
    with pytest.raises(hotloop.NvmlError):
        m.read_memory()


def test_unsupported_readings_are_none_not_errors(fake):
    fake.set("unsupported_power", 1)
    with hotloop.MemoryMonitor(interval_ms=1.0, slow_interval_ms=2.0) as mon:
        wait_for(lambda: mon.timeline.slow.size >= 3)
    r = mon.report()
    assert r.nvml_errors is None
    assert r.power_mean_w is None and r.power_max_w is None
    assert np.all(np.isnan(mon.timeline.power_w))
    assert r.util_mean == 97 and r.temperature_max_c == 55


def test_jpeg_engine_utilisation(fake):
    """nvmlDeviceGetJpgUtilization: in every slow sample and in nvml_device_info; a GPU without JPEG
    engines answers NOT_SUPPORTED, which is NaN / None, not an error."""
    busy = int(np.random.default_rng(derived_seed()).integers(1, 100))
    fake.set("util_jpeg", busy)
    m = _C.Monitor(0, interval_ms=1.0, slow_interval_ms=2.0, capacity=256)
    m.start()
    wait_for(lambda: m.snapshot()["slow_samples"] >= 3)
    m.stop()
    s = m.snapshot()
    tl = memory.Timeline(s, s["started"])
    assert len(tl.util_jpeg) == len(tl.util_gpu) >= 3 and np.all(tl.util_jpeg == busy)
    assert _C.nvml_device_info(0)["utilization_jpeg"] == busy
    fake.set("unsupported_jpeg", 1)
    m.start()
    wait_for(lambda: m.snapshot()["slow_samples"] >= 3)
    m.stop()
    s = m.snapshot()
    assert s["error"] is None
    tl = memory.Timeline(s, s["started"])
    assert np.all(np.isnan(tl.util_jpeg)) and np.all(tl.util_gpu == 97)
    assert _C.nvml_device_info(0)["utilization_jpeg"] is None


def test_report_shows_the_jpeg_engines_beside_the_sms(fake):
    busy = int(np.random.default_rng(derived_seed()).integers(1, 100))
    fake.set("util_jpeg", busy)
    with hotloop.MemoryMonitor(interval_ms=1.0, slow_interval_ms=2.0) as mon:
        wait_for(lambda: mon.timeline.slow.size >= 3)
    r = mon.report()
    assert r.util_jpeg_mean == busy
    assert re.search(rf"JPEG decoders \(mean\)\s+{busy} %", str(r)), str(r)
    fake.set("unsupported_jpeg", 1)
    with hotloop.MemoryMonitor(interval_ms=1.0, slow_interval_ms=2.0) as mon:
        wait_for(lambda: mon.timeline.slow.size >= 3)
    r = mon.report()
    assert r.util_jpeg_mean is None and "JPEG decoders" not in str(r)


def test_fork_leaves_no_sampler_in_the_child(fake):
    m = _C.Monitor(0, interval_ms=1.0)
    m.start()
    wait_for(lambda: m.snapshot()["memory_samples"] >= 5)
    pid = os.fork()
    if pid == 0:  # child: the sampler thread does not exist here; stop must not hang
        ok = (not m.running) and thread_count() == 1
        m.stop()
        m.start()  # a fresh sampler in the child works
        n = m.snapshot()["memory_samples"]
        time.sleep(0.05)
        ok = ok and m.snapshot()["memory_samples"] > n
        m.stop()
        os._exit(0 if ok else 1)
    code = wait_for_child(pid, timeout=30)
    assert code is not None, "the forked child hung"
    assert code == 0, code
    n = m.snapshot()["memory_samples"]
    wait_for(lambda: m.snapshot()["memory_samples"] > n + 5)  # the parent's sampler kept going
    m.stop()


# ---- MemoryMonitor and the decorator ----

def test_decorator_forms_keep_results_and_exceptions(fake):
    out = io.StringIO()

    @hotloop.memory_monitor
    def bare(x):
        return x + 1

    @hotloop.memory_monitor()
    def empty(x):
        return x * 2

    @hotloop.memory_monitor(interval_ms=0.5, report="json", file=out)
    def with_options(x, y=3):
        return {"sum": x + y}

    @hotloop.memory_monitor(report=None, file=out)
    def failing():
        raise KeyError("boom")

    value = np.random.randint(1000)
    assert bare(value) == value + 1
    assert empty(value) == value * 2
    assert with_options(value, y=4) == {"sum": value + 4}
    assert bare.__name__ == "bare" and bare.last_report.nvml
    report = json.loads(out.getvalue())
    assert report["interval_ms"] == 0.5 and report["device_total"] == 80 * GiB
    out.truncate(0)
    with pytest.raises(KeyError, match="boom"):
        failing()
    assert out.getvalue() == ""  # report=None prints nothing
    assert failing.last_report is not None


def test_table_report_is_printed(fake, capsys):
    @hotloop.memory_monitor
    def train():
        time.sleep(0.01)

    train()
    err = capsys.readouterr().err
    assert "hotloop memory report" in err and "peak device used (NVML)" in err
    assert "80.00 GiB" in err


def test_report_fields_from_the_fake(fake):
    used = 2 * GiB + 4096 * int(np.random.randint(1, 1000))
    fake.set("used", used)
    fake.set("util_gpu", 31)
    fake.set("power_mw", 650000)
    fake.set("temperature_c", 88)
    fake.set("reasons", 0x4 | 0x40 | 0x1)
    with hotloop.MemoryMonitor(interval_ms=0.5, slow_interval_ms=1.0) as mon:
        fake.set("spike_value", used + 3 * GiB)
        fake.set("spike_next", 1)
        wait_for(lambda: fake.get("spike_next") == 0 and mon.timeline.slow.size >= 2)
    r = mon.report()
    assert r.peak_device_used == used + 3 * GiB
    assert r.context_baseline == used  # no torch CUDA: the device's use at start
    assert r.device_total == 80 * GiB and r.driver_reserved == 512 * MiB
    assert r.device_name == "Fake GPU 0"
    assert r.util_mean == 31 and r.power_mean_w == 650 and r.power_max_w == 650 and r.power_limit_w == 700
    assert r.temperature_max_c == 88
    assert r.throttle_reasons == ["software power cap", "hardware thermal slowdown"]
    assert r.samples >= 3 and r.samples == r.samples_kept + r.samples_dropped
    assert r.duration_s > 0 and r.sample_rate_hz > 0
    assert r.peak_allocated is None and not r.torch_cuda
    text = "\n".join(r.advice)
    assert "power cap" in text and "thermal" in text and "busy only 31 %" in text
    d = r.to_dict()
    assert json.loads(r.to_json()) == d
    assert "timeline" not in d and d["peak_device_used"] == used + 3 * GiB
    assert mon.timeline.used.max() == used + 3 * GiB


def test_loader_stall_fraction(fake, monkeypatch):
    snapshots = iter([{"wait_seconds": 1.0, "batches": 1, "samples": 4},
                      {"wait_seconds": 1.0 + 0.02, "batches": 2, "samples": 8}])
    monkeypatch.setattr(input_wait, "snapshot", lambda: next(snapshots))
    fake.set("util_gpu", 40)
    with hotloop.MemoryMonitor(slow_interval_ms=1.0) as mon:
        time.sleep(0.05)
    r = mon.report()
    assert r.loader_wait_s == pytest.approx(0.02)
    assert r.stall_fraction == pytest.approx(0.02 / r.duration_s)
    assert any("data loader stalled" in a and "hotloop.DataLoader" in a for a in r.advice)


def test_no_loader_means_no_stall_line(fake):
    with hotloop.MemoryMonitor() as mon:
        pass
    assert mon.report().stall_fraction is None
    assert "loader stalls" not in str(mon.report())


def test_oom_report_is_attached_and_printed(fake):
    out = io.StringIO()
    fake.set("used", 70 * GiB)
    request = int(np.random.randint(2, 9)) * GiB

    @hotloop.memory_monitor(report=None, file=out)
    def train():
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {request / GiB:.2f} GiB. "
                                     "GPU 0 has a total capacity of 80 GiB")

    with pytest.raises(torch.OutOfMemoryError) as err:
        train()
    r = err.value.hotloop_report
    assert r.oom["requested_bytes"] == request
    assert r.oom["free_bytes"] == 80 * GiB - 512 * MiB - 70 * GiB
    assert r.oom["total_bytes"] == 80 * GiB
    assert "OUT OF MEMORY" in out.getvalue()  # printed even with report=None
    assert any("out of memory" in a for a in r.advice)


def test_memory_freed_during_a_forward_never_makes_a_module_negative():
    """Another thread (or the garbage collector) freeing memory while a module runs lowers the
    allocated count between its hooks: what the module kept reads 0, not a negative size."""
    from hotloop.memory.hooks import ModuleHooks

    freed = int(np.random.randint(1, 1 << 30))
    counts = iter([2 * freed, freed])  # before the forward, then after it (freed meanwhile)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    hooks = ModuleHooks(model, lambda: next(counts))
    model(torch.randn(2, 8))
    hooks.remove()
    (module,) = hooks.modules()
    assert module.activation_bytes == 0 and module.calls == 1


def test_model_hooks_and_amp_advice(fake):
    batch = int(np.random.randint(2, 9))
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
    x = torch.randn(batch, 64)
    with hotloop.MemoryMonitor(model=model) as mon:
        model(x).sum().backward()
        model(x)
    r = mon.report()
    by_name = {m.name: m for m in r.modules}
    assert set(by_name) == {"0", "1", "2"}
    # without torch's CUDA allocator the estimate is the output's size
    assert by_name["0"].activation_bytes == by_name["0"].output_bytes == batch * 256 * 4
    assert by_name["2"].output_bytes == batch * 32 * 4
    assert all(m.calls == 2 for m in r.modules)
    assert r.autocast_seen is False and r.fp32_matmul_seen is True
    assert any("use AMP" in a for a in r.advice)
    assert "activations per module" in str(r)
    # hooks are removed at stop
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
    with hotloop.MemoryMonitor(model=model) as mon:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
    assert mon.report().autocast_seen is True
    assert not any("use AMP" in a for a in mon.report().advice)


def advice_for(**fields):
    return compute_advice(memory.MemoryReport(**fields))


def test_advice_triggers(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    # fragmentation -> expandable segments
    a = advice_for(peak_reserved=40 * GiB, peak_allocated=30 * GiB, fragmentation_at_peak=10 * GiB, alloc_retries=0)
    assert len(a) == 1 and "expandable_segments:True" in a[0] and "10.00 GiB" in a[0]
    assert advice_for(peak_reserved=40 * GiB, peak_allocated=39 * GiB, fragmentation_at_peak=GiB) == []
    assert "expandable_segments" in advice_for(peak_reserved=4 * GiB, peak_allocated=4 * GiB,
                                               fragmentation_at_peak=0, alloc_retries=3)[0]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert advice_for(peak_reserved=40 * GiB, peak_allocated=30 * GiB, fragmentation_at_peak=10 * GiB) == []
    # activation-dominated -> checkpoint the heaviest, with the saving
    mods = [memory.ModuleMemory("encoder", 12 * GiB, 1 * GiB, 1), memory.ModuleMemory("decoder", 6 * GiB, GiB, 1),
            memory.ModuleMemory("head", GiB // 2, GiB // 4, 1), memory.ModuleMemory("encoder.layer0", 3 * GiB, 0, 1)]
    a = advice_for(peak_allocated=24 * GiB, peak_reserved=24 * GiB, fragmentation_at_peak=0, modules=mods)
    assert len(a) == 1 and "checkpointing of encoder " in a[0] and "save about 11.00 GiB" in a[0]
    assert advice_for(peak_allocated=80 * GiB, modules=mods) == []  # 18.5 of 80 GiB: not dominant
    # AMP
    assert "AMP" in advice_for(autocast_seen=False, fp32_matmul_seen=True)[0]
    assert advice_for(autocast_seen=True, fp32_matmul_seen=False) == []
    # utilisation with and without stalls
    assert "hotloop.DataLoader" in advice_for(util_mean=45.0, stall_fraction=0.3)[0]
    a = advice_for(util_mean=45.0, stall_fraction=0.01)
    assert len(a) == 1 and "busy only 45 %" in a[0] and "stalled only 1 %" in a[0]
    assert "busy only 45 %" in advice_for(util_mean=45.0)[0]
    assert advice_for(util_mean=95.0, stall_fraction=0.3) == []
    # throttling
    assert "power cap" in advice_for(throttle_reasons=["software power cap"], power_limit_w=450.0,
                                     power_max_w=449.0)[0]
    assert "thermal" in advice_for(throttle_reasons=["hardware thermal slowdown"], temperature_max_c=91)[0]
    assert advice_for(throttle_reasons=[]) == []


def test_timeline_is_numpy(fake):
    with hotloop.MemoryMonitor(interval_ms=0.5, slow_interval_ms=1.0, pcie_interval_ms=1.0) as mon:
        fake.set("pcie_delay_us", 100)
        wait_for(lambda: mon.timeline.pcie.size >= 2 and len(mon.timeline) >= 10)
    tl = mon.timeline
    assert isinstance(tl.used, np.ndarray) and tl.used.dtype == np.uint64
    assert tl.time.dtype == np.float64 and np.all(np.diff(tl.time) > 0) and tl.time[0] >= 0
    assert len(tl.slow_time) == len(tl.util_gpu) == len(tl.power_w) and len(tl.pcie_time) >= 2


def test_plot_writes_a_png(fake, tmp_path):
    pytest.importorskip("matplotlib")
    with hotloop.MemoryMonitor(slow_interval_ms=1.0) as mon:
        time.sleep(0.02)
    path = mon.report().plot(tmp_path / "memory.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_import_hotloop_stays_torch_free():
    code = ("import sys, hotloop; hotloop.memory_monitor; hotloop.MemoryMonitor; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_sampler_keeps_the_rate_without_the_gil(fake):
    # a Python thread spinning with the GIL held does not starve the C sampler
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin)
    t.start()
    try:
        m = _C.Monitor(0, interval_ms=1.0)
        m.start()
        time.sleep(0.3)
        m.stop()
    finally:
        stop.set()
        t.join()
    s = m.snapshot()
    assert s["memory_samples"] + s["ticks_missed"] >= 200  # ~300 ticks in 0.3 s; lenient on a busy CI box


def test_torch_and_nvml_figures_add_up(fake, monkeypatch):
    context = 500 * MiB + 4096 * int(np.random.randint(1, 100))
    reserved0 = 2 * GiB
    alloc = ScriptedAllocator(reserved0, peak_allocated=10 * GiB, peak_reserved=14 * GiB)
    alloc.install(monkeypatch)
    fake.set("used", context + reserved0)  # what the device shows at start
    with hotloop.MemoryMonitor(interval_ms=0.5) as mon:
        peak = context + 14 * GiB + 300 * MiB  # torch's peak plus a workspace outside torch
        fake.set("spike_value", peak)
        fake.set("spike_next", 1)
        wait_for(lambda: fake.get("spike_next") == 0)
    r = mon.report()
    assert alloc.synced == 1  # once, at start (the context must exist for the baseline)
    assert r.torch_cuda and r.device == "cuda:0" and r.device_name == "Scripted"
    assert r.context_baseline == context
    assert r.peak_device_used == peak
    assert r.non_torch_at_peak == 300 * MiB
    assert r.context_baseline + r.peak_reserved + r.non_torch_at_peak == r.peak_device_used
    assert r.fragmentation_at_peak == 4 * GiB and r.inactive_split_peak == 123 * MiB
    assert r.alloc_retries == 0  # counted from the start: the scripted count does not move
    text = str(r)
    assert "= context" in text and "torch reserved 14.00 GiB" in text and "other 300.0 MiB" in text
    assert any("expandable_segments" in a for a in r.advice)  # 4 of 14 GiB reserved unused at the peak


def test_a_failing_report_never_hides_the_result_or_the_error(fake, monkeypatch, caplog):
    def broken(self):
        raise RuntimeError("report failed")

    monkeypatch.setattr(memory.MemoryMonitor, "_build_report", broken)
    before = thread_count()

    @hotloop.memory_monitor
    def ok():
        return 42

    @hotloop.memory_monitor
    def bad():
        raise ValueError("the user's error")

    assert ok() == 42
    with pytest.raises(ValueError, match="the user's error"):
        bad()
    assert thread_count() == before  # the samplers were stopped anyway
    assert "no report for this run" in caplog.text


def test_stall_fraction_from_a_real_hotloop_dataloader(fake):
    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            time.sleep(0.005)  # a slow decode: the consumer waits on it
            return torch.full((4,), float(i) + 0.5)

    with hotloop.MemoryMonitor() as mon:
        batches = list(hotloop.DataLoader(Slow(), batch_size=3, num_workers=0))
    r = mon.report()
    assert len(batches) == 4
    assert r.loader_wait_s is not None and 0 < r.loader_wait_s <= r.duration_s
    assert r.stall_fraction == pytest.approx(r.loader_wait_s / r.duration_s)
    assert "data loader stalls" in str(r)
    assert r.loader_ring_bytes is None  # num_workers=0 without a device: no ring


def test_report_says_how_much_the_loaders_rings_held(fake):
    """The memory report gives the largest host shared memory hotloop.DataLoader rings held at once
    while it watched, as loader.stats gives one loader's."""
    n = int(np.random.randint(2, 6))
    data = torch.randn(64, n, 1000)
    with hotloop.MemoryMonitor() as mon:
        loader = hotloop.DataLoader(data, batch_size=8, num_workers=2)
        got = torch.cat(list(loader))
        assert loader.stats.ring_bytes >= 6 * 8 * n * 1000 * 4  # 6 slots of 8 samples at least
    assert torch.equal(got, data)
    r = mon.report()
    assert r.loader_ring_bytes == loader.stats.ring_bytes
    assert "data loader rings" in str(r)
    with hotloop.MemoryMonitor() as mon:  # the ring was gone before this one watched
        pass
    assert mon.report().loader_ring_bytes is None


def test_generator_function_is_monitored_across_its_iteration(fake):
    """A decorated generator function is measured while it is iterated, not only while the generator
    object is made: the run lasts as long as the iteration, and sees what happens in it."""
    pause = 0.05 + 0.05 * np.random.rand()

    @hotloop.memory_monitor(report=None)
    def batches(n):
        for i in range(n):
            time.sleep(pause / n)
            yield i

    assert list(batches(5)) == list(range(5))
    r = batches.last_report
    assert r is not None and r.duration_s >= pause * 0.9 and r.samples > 0


def test_coroutine_function_is_monitored_across_its_awaits(fake):
    import asyncio

    pause = 0.05 + 0.05 * np.random.rand()

    @hotloop.memory_monitor(report=None)
    async def step(x):
        await asyncio.sleep(pause)
        return x * 2

    assert asyncio.run(step(21)) == 42
    assert step.last_report is not None and step.last_report.duration_s >= pause * 0.9


def test_async_generator_function_is_refused_clearly():
    with pytest.raises(TypeError, match="async generator"):
        @hotloop.memory_monitor
        async def stream():
            yield 1


@pytest.mark.parametrize("spec,index", [("cuda:1", 1), ("cuda", 0), (1, 1)])
def test_device_specs_parsed_as_torch_parses_them(fake, spec, index):
    """Without CUDA in torch the device names an NVML index, read from any spec torch accepts."""
    fake.set_device_count(2)
    fake.set("used", 3 * GiB, device=index)
    with hotloop.MemoryMonitor(device=spec) as mon:
        time.sleep(0.01)
    r = mon.report()
    assert r.device == f"nvml:{index}" and r.nvml and r.peak_device_used == 3 * GiB


NO_GPU_SCRIPT = """
import hotloop

@hotloop.memory_monitor
def train(x):
    return x + 1

assert train(1) == 2 and train(2) == 3
assert train.last_report is not None and not train.last_report.nvml and train.last_report.host
"""


def test_without_a_gpu_the_report_is_the_hosts(tmp_path):
    """No NVML and no CUDA in torch: each run prints a report of the host (its memory, CPU time), with
    one short line for the missing GPU and no dlopen error or C file:line in it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NVML_", "HOTLOOP_NVML"))}
    env.update(HOTLOOP_NVML_LIBRARY=str(tmp_path / "no-libnvidia-ml.so"), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-c", NO_GPU_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    text = p.stdout + p.stderr
    assert text.count("hotloop memory report: host (no GPU)") == 2, text
    assert text.count("peak host memory (PSS)") == 2 and text.count("CPU time") == 2
    assert ".c:" not in text and "nvml:" not in text and "dlopen" not in text


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(model=5), TypeError, "expected model to be a torch.nn.Module"),
    (dict(model=torch.zeros(2)), TypeError, "expected model to be a torch.nn.Module"),
    (dict(interval_ms=True), TypeError, "interval_ms"),
    (dict(interval_ms=float("nan")), ValueError, "interval_ms"),
    (dict(slow_interval_ms=-1.0), ValueError, "slow_interval_ms"),
    (dict(pcie_interval_ms=float("inf")), ValueError, "pcie_interval_ms"),
    (dict(capacity=0), ValueError, "capacity"),
    (dict(capacity=2.5), TypeError, "capacity"),
])
def test_monitor_arguments_are_checked_where_given(kwargs, error, words):
    with pytest.raises(error, match=words):
        hotloop.MemoryMonitor(**kwargs)
    with pytest.raises(error, match=words):  # at decoration, not at the first call
        hotloop.memory_monitor(**kwargs)(lambda: None)

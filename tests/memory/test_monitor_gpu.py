"""The memory monitor on a real GPU: NVML figures against torch's allocator, a short spike, OOM, the CLI."""
import gc
import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import hotloop

pytestmark = pytest.mark.gpu
GiB = 1 << 30


def settle():
    # garbage of earlier tests holding CUDA tensors, collected in the middle of a measured forward,
    # lowered allocated memory there (module 0's activations read -992 MiB once in the GPU suite)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_peak_device_used_covers_torch_reserved_plus_context():
    settle()
    sizes = np.random.randint(64, 1024, size=6) * (1 << 20)
    with hotloop.MemoryMonitor(interval_ms=1.0, report=None) as mon:
        tensors = [torch.randn(int(n) // 4, device="cuda") for n in sizes]
        a = torch.randn(4096, 4096, device="cuda")
        b = a @ a  # cuBLAS workspace: memory outside the tensors
        torch.cuda.synchronize()
        time.sleep(0.05)  # hold the peak for many ticks
        del tensors, a, b
    r = mon.report()
    print(r)
    assert r.nvml and r.torch_cuda
    assert r.peak_allocated >= int(sizes.sum())
    assert r.peak_reserved >= r.peak_allocated
    assert r.context_baseline > 0  # the CUDA context is on the device before any tensor
    assert r.peak_device_used >= r.peak_reserved + r.context_baseline
    # the report's lines add up to the device's peak
    assert r.context_baseline + r.peak_reserved + r.non_torch_at_peak == r.peak_device_used
    assert r.samples > 30 and r.sample_rate_hz > 500
    assert r.util_mean is not None and r.power_mean_w is not None and r.power_limit_w > 0
    assert r.nvml_errors is None


def test_a_50_ms_allocation_of_8_gb_is_caught():
    settle()
    with hotloop.MemoryMonitor(interval_ms=1.0, report=None) as mon:
        time.sleep(0.05)
        x = torch.empty(8 * GiB, dtype=torch.uint8, device="cuda")
        x.fill_(7)
        torch.cuda.synchronize()
        time.sleep(0.05)
        del x
        torch.cuda.empty_cache()
        time.sleep(0.05)
    r = mon.report()
    tl = mon.timeline
    baseline = int(tl.used[:10].min())
    assert r.peak_device_used - baseline >= 8 * GiB
    assert int(tl.used[-5:].max()) - baseline < GiB  # and it went away again
    assert r.peak_reserved >= 8 * GiB and r.peak_allocated >= 8 * GiB


def test_oom_report_attached_to_the_error():
    settle()
    free, total = torch.cuda.mem_get_info()

    @hotloop.memory_monitor(report=None)
    def greedy():
        keep = torch.empty(GiB, dtype=torch.uint8, device="cuda")
        return torch.empty(2 * total, dtype=torch.uint8, device="cuda"), keep

    with pytest.raises(torch.OutOfMemoryError) as err:
        greedy()
    r = err.value.hotloop_report
    print(r)
    assert r.oom["requested_bytes"] is not None and abs(r.oom["requested_bytes"] - 2 * total) < 0.01 * total
    assert 0 < r.oom["free_bytes"] <= total
    assert r.oom["reserved_bytes"] >= GiB and r.oom["fragmentation_bytes"] >= 0
    assert r.ooms == 1
    assert any("out of memory" in a for a in r.advice)
    settle()


def test_model_hooks_measure_activations_on_the_gpu():
    settle()
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    x = torch.randn(2048, 1024, device="cuda")
    with hotloop.MemoryMonitor(model=model, report=None) as mon:
        model(x).sum().backward()
    r = mon.report()
    by_name = {m.name: m for m in r.modules}
    # Linear 0 keeps its output (2048 x 4096 fp32 = 32 MiB), which GELU saves for backward
    assert by_name["0"].activation_bytes >= 2048 * 4096 * 4
    assert by_name["0"].output_bytes == 2048 * 4096 * 4
    assert by_name["2"].backward_allocated_bytes > 0
    assert r.fp32_matmul_seen and r.autocast_seen is False


def test_cli_monitor_and_doctor_run():
    p = subprocess.run([sys.executable, "-m", "hotloop", "monitor", "--interval-ms", "50", "--duration", "1"],
                       capture_output=True, text=True, timeout=60)
    print(p.stdout[-2000:], p.stderr[-2000:])
    assert p.returncode == 0 and "summary gpu 0:" in p.stdout
    p = subprocess.run([sys.executable, "-m", "hotloop", "doctor", "--json"], capture_output=True, text=True,
                       timeout=120)
    print(p.stdout[-6000:], p.stderr[-2000:])
    report = json.loads(p.stdout)
    assert p.returncode == report["exit_code"] in (0, 1, 2)
    names = {c["name"]: c for c in report["checks"]}
    assert names["driver"]["status"] == "PASS"
    assert "gpu 0 PCIe link" in names and "gpu 0 H2D bandwidth" in names
    assert report["facts"]["h2d_gbps"]["gpu 0"] > 1.0


JSON_KEYS_SCRIPT = """
import io, json, sys, time
import hotloop
out = io.StringIO()
with hotloop.MemoryMonitor(report="json", file=out):
    time.sleep(0.05)
print(json.dumps(sorted(json.loads(out.getvalue()))))
"""


def test_json_has_the_same_keys_with_the_gpu_as_without():
    """report='json' writes one object with the same keys on the GPU as without one (there the GPU's
    are null); here the GPU's and the host's are filled."""
    import dataclasses
    import io
    import os

    out = io.StringIO()
    with hotloop.MemoryMonitor(report="json", file=out):
        x = torch.randn(1 << 20, device="cuda")
        torch.cuda.synchronize()
        time.sleep(0.05)
        del x
    d = json.loads(out.getvalue())
    fields = {f.name for f in dataclasses.fields(hotloop.MemoryReport)} - {"timeline"}
    assert set(d) == fields
    assert d["nvml"] and d["torch_cuda"] and d["peak_device_used"] > 0 and d["peak_allocated"] >= 4 << 20
    assert d["host"] and d["host_peak_bytes"] > 0 and d["host_processes"][0]["role"] == "main"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HOTLOOP_NVML_LIBRARY="/nonexistent/libnvidia-ml.so")
    p = subprocess.run([sys.executable, "-c", JSON_KEYS_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == sorted(d)


class _Strings(torch.utils.data.Dataset):
    """The issue's dataset: a list of Python strings (copy-on-read), each sample a small image-like tensor."""

    def __init__(self, n):
        self.items = [str(i) * 8 for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return torch.full((3, 32, 32), float(len(self.items[i])))


@pytest.mark.parametrize("loader", [hotloop.DataLoader, torch.utils.data.DataLoader])
def test_report_on_a_dataloader_with_workers_feeding_a_cuda_model(loader):
    """Workers feed a CUDA model: the report has the GPU's peaks and the host's tree, each worker alive at the
    end named a worker, and the list dataset's copy-on-read advice."""
    settle()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.LazyLinear(10)).cuda()
    # 4 M strings, 300 batches: a worker copies the list's pages over many of the sampler's ticks, as with a
    # real dataset's per-sample cost. With a small list and samples this cheap, a fast host's worker copies
    # it all within its first tick, before the sampler's first reading of it, and no growth is seen.
    dl = loader(_Strings(4_000_000), batch_size=1024, num_workers=2, shuffle=True, persistent_workers=True)
    with hotloop.MemoryMonitor(report=None, host_pss_budget=0.5) as mon:
        for i, x in enumerate(dl):
            model(x.cuda(non_blocking=True)).sum().backward()
            if i == 300:
                break
        torch.cuda.synchronize()
    r = mon.report()
    print(r)
    assert r.nvml and r.torch_cuda and r.peak_allocated > 0 and r.peak_device_used >= r.peak_reserved
    workers = [p for p in r.host_processes if p.is_worker]
    assert len(workers) == 2 and not any(p.exited for p in workers)
    assert r.host_peak_bytes == r.host_peak_main_bytes + r.host_peak_children_bytes
    assert any("copy-on-read" in a and "2 workers hold" in a for a in r.advice), r.advice
    del dl

"""`python -m hotloop doctor` and `python -m hotloop monitor` without a GPU, and against the fake NVML."""
import csv
import json
import os
import select
import subprocess
import sys

import pytest


def run_cli(*args, env=None, timeout=60):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NVML_", "HOTLOOP_NVML"))}
    # the fake (or missing) NVML is the whole story: a real GPU on the test machine stays hidden from torch
    full_env["CUDA_VISIBLE_DEVICES"] = ""
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "hotloop", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def checks_by_name(report):
    return {c["name"]: c for c in report["checks"]}


def test_doctor_json_without_a_gpu(tmp_path):
    p = run_cli("doctor", "--json", env={"HOTLOOP_NVML_LIBRARY": str(tmp_path / "no-such-libnvidia-ml.so")})
    assert p.returncode in (0, 1), p.stderr  # only host warnings can remain; never a traceback
    assert "Traceback" not in p.stderr
    report = json.loads(p.stdout)
    checks = checks_by_name(report)
    assert checks["GPU"]["status"] == "SKIP" and "no NVIDIA GPU" in checks["GPU"]["value"]
    assert report["exit_code"] == p.returncode
    assert report["facts"]["nvml"] is None and report["facts"]["cpu_cores"] >= 1
    assert {"CPU cores", "/dev/shm", "open-file limit"} <= set(checks)
    assert all(c["status"] in ("PASS", "WARN", "FAIL", "SKIP") for c in report["checks"])
    assert not any(name.startswith("gpu ") for name in checks)


def test_doctor_text_without_a_gpu(tmp_path):
    p = run_cli("doctor", env={"HOTLOOP_NVML_LIBRARY": str(tmp_path / "missing.so")})
    assert "[SKIP] GPU" in p.stdout and "passed" in p.stdout.splitlines()[-1]


def test_doctor_finds_a_narrow_link_and_a_lowered_power_limit(fake_nvml_library):
    env = {"HOTLOOP_NVML_LIBRARY": fake_nvml_library, "FAKE_NVML_PCIE_WIDTH": "8", "FAKE_NVML_POWER_LIMIT_MW": "400000",
           "FAKE_NVML_REASONS": str(0x40), "FAKE_NVML_PERSISTENCE": "0", "FAKE_NVML_MIG": "1",
           "FAKE_NVML_DEVICE_COUNT": "2"}
    p = run_cli("doctor", "--json", env=env)
    report = json.loads(p.stdout)
    checks = checks_by_name(report)
    assert checks["driver"]["status"] == "PASS" and "580.00.fake" in checks["driver"]["value"]
    assert "x8" in checks["gpu 0 PCIe link"]["value"] and "x16" in checks["gpu 0 PCIe link"]["value"]
    assert checks["gpu 1 power"]["status"] == "WARN" and "57 %" in checks["gpu 1 power"]["advice"]
    assert "never changes" in checks["gpu 0 power"]["advice"]
    assert checks["gpu 0 thermal"]["status"] == "WARN" and "hardware thermal" in checks["gpu 0 thermal"]["value"]
    assert checks["gpu 0 persistence"]["status"] == "WARN"
    assert checks["gpu 1 MIG"]["status"] == "WARN"
    assert len(report["facts"]["gpus"]) == 2
    # torch cannot use the GPU NVML sees (a CPU build, or the device hidden): a failure, exit code 2
    assert checks.get("torch CUDA", checks["torch"])["status"] == "FAIL"
    assert p.returncode == report["exit_code"] == 2


def test_doctor_healthy_fake_gpu_passes_gpu_checks(fake_nvml_library):
    p = run_cli("doctor", "--json", env={"HOTLOOP_NVML_LIBRARY": fake_nvml_library})
    checks = checks_by_name(json.loads(p.stdout))
    for name in ("gpu 0 device", "gpu 0 power", "gpu 0 thermal", "gpu 0 persistence", "gpu 0 MIG"):
        assert checks[name]["status"] == "PASS", checks[name]


def test_monitor_cli_writes_rows_and_a_summary(fake_nvml_library, tmp_path):
    out = tmp_path / "log.csv"
    env = {"HOTLOOP_NVML_LIBRARY": fake_nvml_library, "FAKE_NVML_DEVICE_COUNT": "2", "FAKE_NVML_PCIE_DELAY_US": "500",
           "FAKE_NVML_USED": str(3 << 30), "FAKE_NVML_POWER_MW": "123456"}
    p = run_cli("monitor", "--interval-ms", "20", "--duration", "1.0", "--device", "1", "--csv", str(out), env=env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("time") and "used MiB" in lines[0]
    assert lines[-1].startswith("summary gpu 1:") and "peak used 3.00 GiB" in lines[-1]
    assert "power mean/max 123/123 W" in lines[-1]
    rows = list(csv.DictReader(open(out)))
    assert len(rows) >= 3
    assert all(r["gpu"] == "1" and r["used_mib"] == "3072" and r["power_w"] == "123.5" for r in rows)


def test_monitor_cli_without_nvml(tmp_path):
    """No NVML: the host alone is logged (the machine's available memory), the GPU's columns empty; --device
    asks for a GPU that cannot be read, which is an error."""
    p = run_cli("monitor", "--duration", "0.35", env={"HOTLOOP_NVML_LIBRARY": str(tmp_path / "missing.so")})
    assert p.returncode == 0 and "no GPU to watch" in p.stderr and "Traceback" not in p.stderr
    rows = [line.split() for line in p.stdout.splitlines()[1:] if line[:1].isdigit()]
    assert rows and all(len(row) == 2 and float(row[1]) > 0 for row in rows)
    p = run_cli("monitor", "--duration", "0.1", "--device", "0",
                env={"HOTLOOP_NVML_LIBRARY": str(tmp_path / "missing.so")})
    assert p.returncode == 2 and "--device given, but no GPU can be read" in p.stderr


def started_monitor(env, sigint):
    """`python -m hotloop monitor --interval-ms 20` with SIGINT set to `sigint` at its start, once its
    header is out (it runs)."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "hotloop", "monitor", "--interval-ms", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    ready, _, _ = select.select([proc.stdout], [], [], 30)  # bounded wait for the header
    if not ready or not proc.stdout.readline().startswith("time"):
        proc.kill()
        raise AssertionError("the monitor printed no header in 30 s")
    return proc


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_monitor_cli_ends_cleanly_on_a_signal(fake_nvml_library, sig):
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    env.update({"HOTLOOP_NVML_LIBRARY": fake_nvml_library, "FAKE_NVML_PCIE_DELAY_US": "500", "CUDA_VISIBLE_DEVICES": ""})
    # SIGINT as a terminal delivers it, even where the tests run in a background job, which inherits it ignored
    proc = started_monitor(env, signal.SIG_DFL)
    try:
        time.sleep(0.1)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "summary gpu 0:" in out and "Traceback" not in err


SLOW_NUMPY_IMPORT = """
import sys, time

class SlowNumpy:  # the monitor imports numpy for its first row, after the header: this import takes 1 s
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            time.sleep(1.0)
        return None

sys.meta_path.insert(0, SlowNumpy())
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_monitor_cli_finishes_the_row_a_signal_lands_in(fake_nvml_library, tmp_path, sig):
    """A signal stops the logger between rows: one landing in the first row's import of numpy lets the row
    finish. Raised there as KeyboardInterrupt it broke numpy's import, or left Python to die of SIGINT at exit."""
    import signal

    (tmp_path / "sitecustomize.py").write_text(SLOW_NUMPY_IMPORT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    env.update({"HOTLOOP_NVML_LIBRARY": fake_nvml_library, "CUDA_VISIBLE_DEVICES": "",
                "PYTHONPATH": os.pathsep.join([str(tmp_path)] + [p for p in [env.get("PYTHONPATH")] if p])})
    proc = started_monitor(env, signal.SIG_DFL)  # the header is out: the first row's numpy import has begun
    try:
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = out.splitlines()  # the header was read above
    assert len(lines) == 2 and lines[0].split()[1:3] == ["0", "1024"], out  # the row: gpu 0, 1024 MiB used
    assert lines[1].startswith("summary gpu 0:") and err == "", (out, err)


def test_monitor_cli_started_with_sigint_ignored_keeps_ignoring_it(fake_nvml_library):
    """A monitor started as a background job (SIGINT ignored, as `cmd &` in a script leaves it) is not
    ended by a Ctrl-C meant for the foreground; SIGTERM still ends it with its summary."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    env.update({"HOTLOOP_NVML_LIBRARY": fake_nvml_library, "CUDA_VISIBLE_DEVICES": ""})
    proc = started_monitor(env, signal.SIG_IGN)
    try:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None, "SIGINT ended a monitor that was started with it ignored"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "summary gpu 0:" in out and err == "", (out, err)


def one_clear_line(p):
    """A failure said in one line on stderr, with a non-zero exit code: no traceback."""
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("where", ["missing-folder", "dev-full"])
def test_monitor_csv_that_cannot_be_written(fake_nvml_library, tmp_path, where):
    path = str(tmp_path / "no" / "such" / "rows.csv") if where == "missing-folder" else "/dev/full"
    if where == "dev-full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    p = run_cli("monitor", "--interval-ms", "10", "--duration", "0.3", "--csv", path,
                env={"HOTLOOP_NVML_LIBRARY": fake_nvml_library})
    one_clear_line(p)
    assert "csv" in p.stderr.lower()


@pytest.mark.parametrize("duration", ["-1", "nan", "0", "inf"])
def test_monitor_refuses_a_duration_that_is_not_a_positive_number(fake_nvml_library, duration):
    p = run_cli("monitor", "--duration", duration, env={"HOTLOOP_NVML_LIBRARY": fake_nvml_library})
    assert p.returncode == 2 and "--duration" in p.stderr and "Traceback" not in p.stderr


def test_monitor_stops_at_its_duration_even_with_a_long_interval(fake_nvml_library):
    import time

    t0 = time.monotonic()
    p = run_cli("monitor", "--interval-ms", "60000", "--duration", "0.5", env={"HOTLOOP_NVML_LIBRARY": fake_nvml_library})
    assert p.returncode == 0, p.stderr
    assert time.monotonic() - t0 < 30  # not the minute of one interval
    assert "summary gpu 0:" in p.stdout


def test_monitor_piped_into_a_reader_that_stops(fake_nvml_library):
    """`python -m hotloop monitor | head -1`: the reader goes, the monitor ends without a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    env.update({"HOTLOOP_NVML_LIBRARY": fake_nvml_library, "CUDA_VISIBLE_DEVICES": ""})
    proc = subprocess.Popen([sys.executable, "-m", "hotloop", "monitor", "--interval-ms", "10"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.readline().startswith("time")
        proc.stdout.close()  # what head does after its line
        err = proc.stderr.read()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "Traceback" not in err and len(err.strip().splitlines()) <= 1, err


class _OpenedDecoder:
    closed = False

    def close(self):
        self.closed = True


@pytest.mark.parametrize("engines, without", [(True, "hybrid"), (False, "cpu"), (False, "hybrid"), (False, None)])
def test_doctor_says_which_jpeg_decoder_gpu_decode_takes(monkeypatch, engines, without):
    """Without engines: what auto takes next (gpu_decode.AUTO_WITHOUT_ENGINES), or the workers where that
    does not open either (None: refused)."""
    import torch

    from hotloop.cli import doctor
    from hotloop.data.image import decoder_opening, gpu_decode

    opened = _OpenedDecoder()
    opened.threads = 7
    asked = []

    def open_decoder(device, backend, max_batch):
        asked.append((device, backend))
        if backend == "hardware" and not engines:
            return None, RuntimeError("nvjpeg: no hardware JPEG decoder on this GPU")
        if backend == "hybrid" and without is None:
            return None, RuntimeError("nvjpeg: no hybrid today")
        return opened, None

    monkeypatch.setattr(decoder_opening, "open_decoder", open_decoder)
    monkeypatch.setattr(gpu_decode, "AUTO_WITHOUT_ENGINES", without or "hybrid")
    d = doctor.Doctor()
    gpu = torch.device("cuda", 0)
    d.jpeg_decode("gpu 0", gpu)
    check = d.checks[-1]
    assert check.name == "gpu 0 JPEG decode" and check.status == "PASS"
    if engines:
        assert asked == [(gpu, "hardware")]
        assert "JPEG engines (backend 'hardware')" in check.value and opened.closed
    elif without == "hybrid":
        assert asked == [(gpu, "hardware"), (gpu, "hybrid")] and opened.closed
        assert "backend 'hybrid'" in check.value and "on 7 threads" in check.value
        assert "no hardware JPEG decoder on this GPU" in check.value
    else:
        assert asked == [(gpu, "hardware")] + ([(gpu, "hybrid")] if without is None else [])
        assert "backend 'cpu'" in check.value and "no hardware JPEG decoder on this GPU" in check.value
        assert ("no hybrid today" in check.value) == (without is None)

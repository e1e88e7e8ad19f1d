"""What the commands say on a CPU machine: info's nvjpeg line when none loads, doctor's NVRTC advice under a CPU
build of torch, and the bench rows that do not apply on a CPU (no figure) and the start-up row."""
import math

import pytest

from hotloop.bench.harness import Context, Row, format_table
from hotloop.cli import doctor, info


def test_info_names_every_nvjpeg_path_tried(monkeypatch, tmp_path):
    import hotloop.data.image.nvjpeg as nvjpeg

    missing = [str(tmp_path / f"libnvjpeg-{k}.so") for k in range(2)]
    monkeypatch.setattr(nvjpeg, "nvjpeg_library_candidates", lambda: missing)
    error = info._nvjpeg()["error"]
    assert "\n" not in error and not error.rstrip().endswith("tried:")
    assert all(path in error for path in missing)
    assert info._one_line("x: no nvjpeg library could be loaded; tried:") == "x: no nvjpeg library could be loaded"


@pytest.mark.parametrize("torch_cuda", [None, "12.8"])
def test_doctor_without_nvrtc_advises_by_the_torch_build(monkeypatch, torch_cuda):
    from hotloop.rtc import report

    monkeypatch.setattr(report, "nvrtc_report", lambda: {"path": None, "version": None,
                                                         "error": "no NVRTC\n" + "pip install nvidia-cuda-nvrtc-cu12"})
    d = doctor.Doctor()
    d.facts.update(torch="2.9.0" + ("+cpu" if torch_cuda is None else ""), torch_cuda=torch_cuda)
    d.kernels(None)
    check = next(c for c in d.checks if c.name == "kernels (NVRTC)")
    assert check.status == "SKIP"
    if torch_cuda is None:  # nothing of NVRTC helps a CPU torch
        assert "pip install nvidia-cuda-nvrtc" not in check.advice and "CPU build" in check.advice
    else:
        assert "pip install nvidia-cuda-nvrtc-cu12" in check.advice


def test_a_row_that_does_not_apply_shows_no_figure():
    table = format_table([Row("monitor", "on a GPU only", float("nan"), float("nan"), "ms", "n/a on CPU: why"),
                          Row("monitor", "here", 2.0, 4.0, "ms")])
    na = next(line for line in table.splitlines() if "on a GPU only" in line)
    assert "nan" not in na and "n/a on CPU" in na
    assert "0.500" in next(line for line in table.splitlines() if line.startswith("monitor    here"))


def test_monitor_rows_on_a_cpu():
    from hotloop.bench import monitor

    rows = {r.figure: r for r in monitor.rows(Context("cpu", quick=True))}
    enter = rows["enter + leave a default memory monitor (empty block)"]
    assert math.isfinite(enter.hotloop) and enter.hotloop > 0 and "IQR" in enter.note
    steady = next(r for name, r in rows.items() if "steady overhead" in name)
    assert math.isnan(steady.hotloop) and math.isnan(steady.torch) and steady.note.startswith("n/a on CPU")


def test_startup_row_compares_one_job_on_both_sides():
    from hotloop.bench import startup

    row = next(startup.rows(Context("cpu", quick=True)))
    assert row.figure == "import torch + hotloop vs import torch alone, fresh process"
    added = float(row.note.split("adds ")[1].split(" ms")[0])
    assert row.hotloop == pytest.approx(row.torch + added, abs=0.1) and row.hotloop >= row.torch

"""`bench components --json FILE`: the file holds the rows the table printed and the settings they were measured under."""
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

import pytest
import torch

import hotloop


def test_components_json_holds_the_printed_rows_and_the_settings(tmp_path):
    path = tmp_path / "ops.json"
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    out = subprocess.run([sys.executable, "-m", "hotloop", "bench", "components", "--quick", "--only", "ops",
                          "--device", "cpu", "--json", str(path)], capture_output=True, text=True, timeout=300)
    after = datetime.datetime.now(datetime.timezone.utc)
    assert out.returncode == 0, out.stderr
    document = json.loads(path.read_text())

    printed = [line.split() for line in out.stdout.split("\n\n", 1)[1].splitlines() if line.startswith("ops ")]
    assert len(document["rows"]) == len(printed) == 2
    for row, cells in zip(document["rows"], printed, strict=True):
        assert set(row) == {"component", "figure", "hotloop", "torch", "unit", "note"}
        assert row["component"] == "ops" and row["figure"] in " ".join(cells)
        unit_at = cells.index(row["unit"])
        assert float(cells[unit_at - 2]) == pytest.approx(row["hotloop"], rel=1e-3)
        assert float(cells[unit_at - 1]) == pytest.approx(row["torch"], rel=1e-3)
        assert row["hotloop"] > 0 and row["torch"] > 0

    assert document["hotloop"] == hotloop.__version__
    assert document["torch"] == torch.__version__
    assert document["python"] == platform.python_version()
    assert document["device"] == "cpu" and document["device_name"] == document["cpu_name"] != ""
    assert document["cpu_count"] == os.cpu_count()
    assert len(document["load_average_at_start"]) == len(document["load_average_at_end"]) == 3
    assert document["quick"] is True and document["only"] == ["ops"]
    assert before <= datetime.datetime.fromisoformat(document["date_utc"]) <= after
    assert shlex.split(document["command"]) == ["python", "-m", "hotloop", "bench", "components", "--only", "ops",
                                                "--device", "cpu", "--quick", "--json", str(path)]


def test_components_json_to_an_unwritable_path_fails_before_measuring(tmp_path):
    path = tmp_path / "no such folder" / "ops.json"
    out = subprocess.run([sys.executable, "-m", "hotloop", "bench", "components", "--quick", "--only", "ops",
                          "--device", "cpu", "--json", str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "--json" in out.stderr and "ops:" not in out.stdout
    assert not path.exists()

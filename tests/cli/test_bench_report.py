"""`bench report`: docs/performance.md and the README's performance table are what the generator makes of the
committed docs/results/*.json, and the generator puts each file's figures where the rule says."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from hotloop.bench import report
from hotloop.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*.json")))
README = os.path.join(ROOT, "README.md")
PAGE = os.path.join(ROOT, "docs", "performance.md")


def bench_report(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hotloop", "bench", "report", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_committed_docs_are_what_the_results_make():
    assert RESULTS, "docs/results/ holds no bench components --json file"
    for path, text in report.expected_files(RESULTS, README, PAGE).items():
        with open(path) as f:
            assert f.read() == text, (f"{os.path.relpath(path, ROOT)} differs from what the results make: "
                                      f"run `{report.COMMAND}`")


def copy_docs(tmp_path):
    """The README, the page and the results in a folder of their own, laid out as in the repository."""
    os.makedirs(tmp_path / "docs" / "results")
    shutil.copy(README, tmp_path / "README.md")
    shutil.copy(PAGE, tmp_path / "docs" / "performance.md")
    for path in RESULTS:
        shutil.copy(path, tmp_path / "docs" / "results")
    return sorted(os.path.relpath(p, tmp_path) for p in glob.glob(str(tmp_path / "docs" / "results" / "*.json")))


def test_check_names_the_files_a_changed_figure_makes_stale_and_a_run_rewrites_them(tmp_path):
    files = copy_docs(tmp_path)
    assert bench_report("--check", *files, cwd=tmp_path).returncode == 0
    first = tmp_path / files[0]
    document = json.loads(first.read_text())
    ops = next(row for row in document["rows"] if row["figure"] == "non_finite_check read bandwidth")
    ops["hotloop"], ops["torch"] = 2468.0, 617.0
    first.write_text(json.dumps(document))

    out = bench_report("--check", *files, cwd=tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"hotloop bench report: {name} differs from what `{report.COMMAND}` makes"
        for name in ("README.md", os.path.join("docs", "performance.md"))]

    out = bench_report(*files, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    readme, page = (tmp_path / "README.md").read_text(), (tmp_path / "docs" / "performance.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| inf/NaN check, read bandwidth |"))
    assert "| 4.00x (2,468 vs 617 GB/s) |" in row  # in the changed machine's column, whichever that is
    assert "| ops | non\\_finite\\_check read bandwidth | 2,468 GB/s | 617 GB/s | 4.000 | 4.00x |" in page
    outside = readme.split(report.README_BEGIN)[0] + readme.split(report.README_END)[1]
    with open(README) as f:
        committed = f.read()
    assert outside == committed.split(report.README_BEGIN)[0] + committed.split(report.README_END)[1]
    assert bench_report("--check", *files, cwd=tmp_path).returncode == 0


def settings(**changes):
    base = {"command": "python -m hotloop bench components --json x.json", "date_utc": "2026-01-02T03:04:05+00:00",
            "device": "cpu", "device_name": "Some CPU", "cpu_name": "Some CPU", "cpu_count": 4, "hotloop": "0.1.0",
            "torch": "2.14.1", "python": "3.11.7", "quick": False, "load_average_at_start": [0.5, 0.4, 0.3],
            "load_average_at_end": [0.75, 0.5, 0.4]}
    return {**base, **changes}


def row(component, figure, hotloop, torch, unit, note=""):
    return {"component": component, "figure": figure, "hotloop": hotloop, "torch": torch, "unit": unit, "note": note}


def write(path, document):
    path.write_text(json.dumps(document))
    return str(path)


def test_the_readme_table_follows_the_headline_rule(tmp_path):
    cpu = write(tmp_path / "a-cpu.json", {**settings(), "rows": [
        row("ops", "non_finite_check, 49 fp32 tensors", 3.0, 9.0, "ms"),
        row("ops", "non_finite_check read bandwidth", 30.0, 10.0, "GB/s"),
        row("optim", "unscale+clip+AdamW+update, tiny", 2.0, 4.0, "ms"),
        row("optim", "unscale+clip+AdamW+update, large", 1.0, 8.0, "ms"),  # not the first: not shown
        row("photos", "loader alone, fp16 channels_last, steady img/s", float("nan"), float("nan"), "img/s")]})
    gpu_settings = settings(device="cuda:0", device_name="Some GPU")
    gpu = write(tmp_path / "b-gpu.json", {**gpu_settings, "rows": [
        row("optim", "unscale+clip+AdamW+update, 1.3 B", 10.0, 15.0, "ms")]})
    # a second file of the same GPU (an `--only photos` run) fills the same column
    photos = write(tmp_path / "c-gpu-photos.json", {**gpu_settings, "command": "bench --only photos", "rows": [
        row("photos", "loader alone, fp16 channels_last, steady img/s", 18000.0, 3000.0, "img/s"),
        row("photos", "resnet50 fp16 fed, steady, % of resident", 90.0, 60.0, "%")]})
    table = report.readme_table([report.load(p) for p in (photos, cpu, gpu)]).splitlines()
    assert table[:7] == [
        "| job | Some GPU | Some CPU, 4 cores |",
        "| --- | --- | --- |",
        "| inf/NaN check, read bandwidth | – | 3.00x (30 vs 10 GB/s) |",
        "| whole step: unscale + clip + AdamW + update | 1.50x (10 vs 15 ms) | 2.00x (2 vs 4 ms) |",
        "| JPEG folder loader, gpu\\_decode=True | 6.00x (18,000 vs 3,000 img/s) | – |",
        "| ResNet-50 AMP fed by it: % of its speed on a batch already on the GPU | 1.50x (90 vs 60 %) | – |",
        ""]
    assert table[8].startswith("- **Some GPU**: 2026-01-02; hotloop 0.1.0; torch 2.14.1; Python 3.11.7.")
    assert table[8].endswith("`python -m hotloop bench components --json x.json`")
    assert table[9].startswith("- **Some GPU**: ") and table[9].endswith("`bench --only photos`")
    assert table[10].startswith("- **Some CPU, 4 cores**: 2026-01-02;")
    assert "load average 0.50 at the start" in table[10]
    assert table[10].endswith("`python -m hotloop bench components --json x.json`")
    assert len(table) == 11


def test_the_page_has_every_row_of_every_file(tmp_path):
    rows = [row("ops", "non_finite_check read bandwidth", 30.0, 10.0, "GB/s", "a | note"),
            row("loader", "loader alone, 2 workers", 1500.0, 500.0, "img/s"),
            row("images", "needs torchvision", float("nan"), float("nan"), "img/s")]
    path = write(tmp_path / "cpu.json", {**settings(quick=True), "rows": rows})
    page = report.performance_page([report.load(path)], str(tmp_path / "performance.md"))
    assert "## Some CPU, 4 cores" in page and "[cpu.json](cpu.json)" in page and "--quick" in page
    assert "| ops | non\\_finite\\_check read bandwidth | 30 GB/s | 10 GB/s | 3.000 | 3.00x | a \\| note |" in page
    assert "| loader | loader alone, 2 workers | 1,500 img/s | 500 img/s | 3.000 | 3.00x |  |" in page
    assert "| images | needs torchvision | – | – | – | – |  |" in page


@pytest.mark.parametrize("content,message", [
    ("not json", "not JSON"),
    (json.dumps([1, 2]), "expected the JSON object"),
    (json.dumps({"rows": []}), "missing command, date_utc"),
])
def test_a_file_that_is_not_a_result_is_refused_in_one_line(tmp_path, content, message):
    files = copy_docs(tmp_path)
    (tmp_path / "bad.json").write_text(content)
    out = bench_report(*files, "bad.json", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith("hotloop bench report: bad.json: ") and message in out.stderr
    assert (tmp_path / "README.md").read_text() == open(README).read()


def test_a_readme_without_the_markers_is_refused(tmp_path):
    files = copy_docs(tmp_path)
    (tmp_path / "README.md").write_text("# a README without a performance table\n")
    out = bench_report(*files, cwd=tmp_path)
    assert out.returncode == 2 and "lacks the markers" in out.stderr
    assert (tmp_path / "README.md").read_text() == "# a README without a performance table\n"


def test_an_unknown_option_shows_reports_own_usage(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["__main__.py"])  # prog: "python -m hotloop"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "report", "x.json", "--nosuch"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: python -m hotloop bench report ")
    assert err.rstrip().endswith("error: unrecognized arguments: --nosuch")


def test_report_without_files_is_refused_by_its_usage(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["__main__.py"])
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "report"])
    assert exit_.value.code == 2 and "FILE.json" in capsys.readouterr().err


@pytest.mark.parametrize("name, plain", [("Intel(R) Xeon(R) Processor", "Intel Xeon CPU"), ("AMD EPYC", "AMD EPYC CPU"),
                                         ("Intel(R) Core(TM) i9-13900K CPU @ 3.00GHz", "Intel Core i9-13900K CPU")])
def test_cpu_names_lose_marks_clock_and_generic_words(name, plain):
    assert report._plain_cpu_name(name) == plain

"""`bench components --only optim` (rows produced, their figures consistent with each other) and `bench loop`'s
GPT cases stepping hotloop.optim.AdamW on the hotloop side, on the CPU; the real sizes under the `gpu` marker."""
import json
import math
import re
import subprocess
import sys

import pytest

from hotloop.bench.models import MODEL_TINY, transformer_shapes
from hotloop.bench.optim import FLOOR_BYTES_PER_ELEMENT, MODEL_MANY_SMALL, STEP_CASES, STEP_DTYPES


def bench(*args, timeout=600):
    p = subprocess.run([sys.executable, "-m", "hotloop", "bench", *args], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr
    return p.stdout


def table(stdout):
    """the printed table's rows as dicts; cells are apart by two spaces or more, figures and notes never hold two"""
    lines = stdout.split("\n\n", 1)[1].strip().splitlines()
    header = re.split(r"\s{2,}", lines[0])
    assert lines[1].startswith("---")
    return [dict(zip(header, re.split(r"\s{2,}", line.strip()))) for line in lines[2:]]


def check_rows(rows, numel):
    """Every row: positive figures, the ratio and the speed-up as the table states them; the two
    step rows share hotloop's measurement, and the bytes row is the floor's bytes over the device-time
    row's times."""
    assert [r["component"] for r in rows] == ["optim"] * len(rows)
    for r in rows:
        ours, theirs = float(r["hotloop"]), float(r["torch"])
        assert ours > 0 and theirs > 0, r
        # both shown to 4 significant digits, the ratio to 3 decimals: 1e-3 relative covers their rounding
        assert float(r["hotloop÷torch"]) == pytest.approx(ours / theirs, rel=2e-3, abs=1e-3), r
        better = theirs / ours if r["unit"] == "ms" else ours / theirs
        assert float(r["better by"][:-1]) == pytest.approx(better, rel=2e-3, abs=0.006), r
    step, mixed, device, rate = rows[:4]
    assert step["figure"].startswith("unscale+clip+AdamW+update") and step["unit"] == "ms"
    assert mixed["figure"].startswith("hotloop's scaler: hotloop AdamW vs torch fused AdamW")
    assert mixed["hotloop"] == step["hotloop"]
    assert device["figure"].startswith("device time of the whole step (host ahead)") and device["unit"] == "ms"
    assert rate["unit"] == "GB/s" and f"({FLOOR_BYTES_PER_ELEMENT} B an element)" in rate["figure"]
    gb = numel * FLOOR_BYTES_PER_ELEMENT / 1e9
    assert f"the floor's {gb:.2f} GB" in rate["note"]
    for side in ("hotloop", "torch"):  # GB/s x ms = the floor's bytes (each shown to 4 digits)
        assert float(rate[side]) * float(device[side]) * 1e-3 == pytest.approx(gb, rel=2e-3)
    copy = float(re.search(r"copy rate here (\d+) GB/s", rate["note"]).group(1))
    assert copy > 0
    shown = re.search(r"hotloop (\d+)%, torch (\d+)% of it", rate["note"])
    for percent, side in zip(shown.groups(), ("hotloop", "torch")):
        # the percentage is rounded to 1, the copy rate to 1 GB/s (0.5 / copy of the percentage)
        expected = 100 * float(rate[side]) / copy
        assert int(percent) == pytest.approx(expected, abs=0.5 + expected * 0.6 / copy + 0.1)
    return copy


def step_tag(label, shapes):
    """How a step row names its parameter set, `{}` standing for the dtype's name."""
    numel = sum(math.prod(s) for s in shapes)
    return f"{label} {{}} params ({len(shapes)} tensors, {numel / 1e6:.0f} M)"


STEP_ROWS_PER_SET = len(STEP_DTYPES) * len(STEP_CASES) * 2  # each case without and with grad_scale, found_inf


def check_step_rows(rows, tags):
    """The rows of each optimizer's step alone: per parameter set (`tags`, each formatted with the dtype's
    name), per dtype, per STEP_CASES entry, without then with a GradScaler's grad_scale and found_inf."""
    expected = [(name, kwargs, tag.format(dtype), scaler) for tag in tags for dtype in STEP_DTYPES
                for name, kwargs in STEP_CASES for scaler in ("", " + grad_scale, found_inf")]
    for r, (name, kwargs, tag, scaler) in zip(rows, expected, strict=True):
        args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        assert r["figure"] == f"{name}({args}).step(){scaler}, {tag}", r
        assert r["unit"] == "ms" and f"against torch.optim.{name}(fused=True)" in r["note"]
        assert float(r["hotloop"]) > 0 and float(r["torch"]) > 0


def test_optim_component_quick_on_the_cpu():
    rows = table(bench("components", "--quick", "--only", "optim", "--device", "cpu"))
    shapes = transformer_shapes(*MODEL_TINY)
    numel = sum(math.prod(s) for s in shapes)
    assert len(rows) == 6 + 2 * STEP_ROWS_PER_SET
    check_rows(rows, numel)
    check_step_rows(rows[6:], [step_tag("tiny", shapes), step_tag("many small", transformer_shapes(*MODEL_MANY_SMALL))])
    assert f"({len(shapes)} tensors, {numel / 1e6:.0f} M)" in rows[0]["figure"]
    assert [r["figure"] for r in rows[4:6]] == [f"host time unscale+clip+AdamW+update, tiny model ({len(shapes)} tensors)",
                                              f"host time AdamW.step() alone, tiny model ({len(shapes)} tensors)"]
    assert "host syncs" not in rows[0]["note"]  # counted on a GPU only


def test_loop_gpt_case_steps_hotloops_adamw_on_the_cpu(tmp_path):
    out = bench("loop", "--case", "tiny-gpt", "--case", "tiny-cnn", "--device", "cpu", "--steps", "3", "--workers",
                "0", "--json", str(tmp_path / "l.json"))
    runs = json.loads((tmp_path / "l.json").read_text())["runs"]
    assert [(r["case"], r["loop"], r["optimizer"]) for r in runs] == [
        ("tiny-gpt", "torch", "torch.optim.AdamW"), ("tiny-gpt", "hotloop", "hotloop.optim.AdamW"),
        ("tiny-cnn", "torch", "torch.optim.AdamW"), ("tiny-cnn", "hotloop", "torch.optim.AdamW")]
    # the table names each side's optimizer on its row
    for r in runs:
        assert re.search(rf"^{r['case']}\s+{r['loop']}\s.*\s{re.escape(r['optimizer'])}$", out, re.M), out
    # the same model, data and seed: the same loss after three steps. The optimizers differ in float32
    # rounding only (tests/optim bounds it at a few ulps a step); bf16 autocast (8 bits) may round a few
    # activations the other way, which moves a mean over every token by far less than 1 %
    assert runs[1]["final_loss"] == pytest.approx(runs[0]["final_loss"], rel=1e-2)


@pytest.mark.gpu
def test_optim_component_on_the_gpu():
    """The real sizes (1.3 B in 481 tensors, 353 M in 289, a 2,000-tensor model): the rows, hotloop's
    step without a host sync, and no step moving its floor's bytes faster than the device copies."""
    from hotloop.bench.models import MODEL_1_3B, MODEL_353M

    out = bench("components", "--only", "optim")
    print(out)
    rows = table(out)
    assert len(rows) == 10 + 2 * STEP_ROWS_PER_SET
    for block, (size, label) in zip((rows[0:4], rows[4:8]), ((MODEL_1_3B, "1.3 B"), (MODEL_353M, "353 M"))):
        shapes = transformer_shapes(*size)
        numel = sum(math.prod(s) for s in shapes)
        copy = check_rows(block, numel)
        assert f"{label} fp32 params+grads ({len(shapes)} tensors" in block[0]["figure"]
        assert "host syncs per step: hotloop 0," in block[0]["note"]
        # the floor's bytes at the copy rate is the least time the step can take: faster would mean a
        # step that skipped its work (a few % for timing noise)
        assert float(block[3]["hotloop"]) < 1.05 * copy and float(block[3]["torch"]) < 1.05 * copy
    assert "2,000-tensor model (1993 tensors)" in rows[8]["figure"]
    check_step_rows(rows[10:], [step_tag("353 M", transformer_shapes(*MODEL_353M)),
                                step_tag("many small", transformer_shapes(*MODEL_MANY_SMALL))])

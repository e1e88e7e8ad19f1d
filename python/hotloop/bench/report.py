"""`python -m hotloop bench report docs/results/*.json`: writes docs/performance.md (every row of every
result file) and the README's performance table (the headline rows) from `bench components --json`
files, so that no figure in the docs is typed by hand. `--check` only compares."""
import dataclasses
import json
import math
import os
import sys

from .harness import Row
from .workloads import BenchError

COMMAND = "python -m hotloop bench report docs/results/*.json"
README_BEGIN = f"<!-- performance table: made by `{COMMAND}`; edit the JSON files or the generator, not this table -->"
README_END = "<!-- end of performance table -->"

# The README's headline rows: (the row's title in the README, component, how its figure starts). Per
# result file the first row of the component whose figure starts so; one key per job a user swaps in
# whose torch column is torch's own way of that job (not the monitor's, whose other column is a Python
# sampler, nor startup's), named by the part of the figure that stays the same on every device and
# size. A job a device cannot do (a GPU's on a CPU) shows as "–" in that device's column, and a job no
# file has is left out.
HEADLINE = [
    ("inf/NaN check, read bandwidth", "ops", "non_finite_check read bandwidth"),
    ("GradScaler unscale + clip", "scaler", "unscale+clip, "),
    ("whole step: unscale + clip + AdamW + update", "optim", "unscale+clip+AdamW+update, "),
    ("DataLoader alone", "loader", "loader alone, "),
    ("crop + resize + flip + normalise", "images", "images per second"),
    ("JPEG folder loader, gpu_decode=True", "photos", "loader alone, fp16 channels_last, steady img/s"),
    ("ResNet-50 AMP fed by it: % of its speed on a batch already on the GPU", "photos", "resnet50 fp16 fed, steady"),
    ("ViT-B/16 bf16 fed by it: % of its speed on a batch already on the GPU", "photos", "vit_b_16 bf16 fed, steady"),
]


@dataclasses.dataclass
class Result:
    """One `bench components --json` file: where it is, what it was run with, its rows."""
    path: str
    settings: dict
    rows: list

    @property
    def is_gpu(self) -> bool:
        return self.settings["device"].startswith("cuda")

    @property
    def machine(self) -> str:
        s = self.settings
        if self.is_gpu:
            return s["device_name"]
        return f"{_plain_cpu_name(s['cpu_name'])}, {s['cpu_count']} cores"

    def describe(self) -> str:
        """The settings a reader needs to weigh the figures, in one sentence."""
        s = self.settings
        parts = [f"{s['date_utc'][:10]}", f"hotloop {s['hotloop']}", f"torch {s['torch']}", f"Python {s['python']}"]
        if not self.is_gpu:
            parts.append(f"load average {_load(s.get('load_average_at_start'))} at the start and "
                         f"{_load(s.get('load_average_at_end'))} at the end, on {s['cpu_count']} cores")
        if s.get("quick"):
            parts.append("--quick (small sizes, few repetitions: a smoke run)")
        return "; ".join(parts)


def _plain_cpu_name(name) -> str:
    """"Intel(R) Xeon(R) Processor" -> "Intel Xeon CPU": the marks, the clock and the generic words dropped."""
    name = name.split(" @ ")[0].replace("(R)", "").replace("(TM)", "")
    words = [w for w in name.split() if w not in ("Processor", "CPU")]
    return " ".join(words + ["CPU"])


def _load(averages) -> str:
    return "unknown" if not averages else f"{averages[0]:.2f}"


REQUIRED = ("command", "date_utc", "device", "device_name", "cpu_name", "cpu_count", "hotloop", "torch", "python")


def load(path) -> Result:
    """Read one result file; a file that is not one raises BenchError naming it and what it lacks."""
    try:
        with open(path) as f:
            document = json.load(f)
    except OSError as err:
        raise BenchError(f"{path}: cannot read it: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise BenchError(f"{path}: not JSON ({err})") from None
    if not isinstance(document, dict) or not isinstance(document.get("rows"), list):
        raise BenchError(f"{path}: expected the JSON object `bench components --json` writes, with a list of rows")
    missing = [key for key in REQUIRED if key not in document]
    if missing:
        raise BenchError(f"{path}: expected the settings `bench components --json` writes; missing {', '.join(missing)}")
    fields = [f.name for f in dataclasses.fields(Row)]
    try:
        rows = [Row(**{name: row[name] for name in fields if name in row}) for row in document["rows"]]
    except TypeError as err:
        raise BenchError(f"{path}: a row lacks a field ({err})") from None
    settings = {key: value for key, value in document.items() if key != "rows"}
    return Result(path=path, settings=settings, rows=rows)


def ordered(results):
    """GPU results first (the figures hotloop is for), then by file name."""
    return sorted(results, key=lambda r: (not r.is_gpu, os.path.basename(r.path)))


def headline_row(result, component, start):
    """The result's first row of the component whose figure starts so and has figures, or None."""
    for row in result.rows:
        if row.component == component and row.figure.startswith(start) and _finite(row):
            return row
    return None


def _finite(row) -> bool:
    return math.isfinite(row.hotloop) and math.isfinite(row.torch) and row.torch != 0


def _number(value) -> str:
    if not math.isfinite(value):
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _cell(text) -> str:
    """Text as one Markdown table cell: pipes, emphasis marks and line ends taken literally."""
    text = str(text).replace("\n", " ")
    for mark in ("\\", "|", "*", "_"):
        text = text.replace(mark, "\\" + mark)
    return text


def _figures(row):
    """hotloop, torch, hotloop ÷ torch and how many times better hotloop does, as table cells."""
    if not _finite(row):
        return _number(row.hotloop), _number(row.torch), "–", "–"
    return (f"{_number(row.hotloop)} {row.unit}", f"{_number(row.torch)} {row.unit}", f"{row.ratio:.3f}",
            f"{row.speedup:.2f}x")


def by_machine(results):
    """{machine: its results, in `ordered` order}, machines in the order of their first result: the
    files of one machine (one per `--only` run, say) share a column."""
    machines = {}
    for result in ordered(results):
        machines.setdefault(result.machine, []).append(result)
    return machines


def readme_table(results) -> str:
    """The README's table: a row per headline job, a column per machine (how many times better
    hotloop does, then both figures, from the first of the machine's files that has the row), then
    each file's settings and the command that made it."""
    machines = by_machine(results)
    lines = ["| job | " + " | ".join(_cell(m) for m in machines) + " |",
             "| --- |" + " --- |" * len(machines)]
    for title, component, start in HEADLINE:
        cells = []
        for files in machines.values():
            row = next(filter(None, (headline_row(f, component, start) for f in files)), None)
            cells.append("–" if row is None else
                         f"{row.speedup:.2f}x ({_number(row.hotloop)} vs {_number(row.torch)} {row.unit})")
        if any(cell != "–" for cell in cells):
            lines.append("| " + " | ".join([_cell(title)] + [_cell(c) for c in cells]) + " |")
    lines.append("")
    lines.append("Each cell: how many times better hotloop does than torch's way of the same job "
                 "(hotloop's figure vs torch's).")
    for result in [f for files in machines.values() for f in files]:
        lines.append(f"- **{_cell(result.machine)}**: {_cell(result.describe())}. "
                     f"`{result.settings['command']}`")
    return "\n".join(lines)


def performance_page(results, page_path) -> str:
    """docs/performance.md: what the figures are, then every row of every result file."""
    here = os.path.dirname(page_path) or "."
    out = [
        "# Performance",
        "",
        f"<!-- made by `{COMMAND}` from the files in docs/results/: edit those or "
        "python/hotloop/bench/report.py, not this page -->",
        "",
        "Every figure here comes from a JSON file under [results/](results/), written by",
        "`python -m hotloop bench components --json FILE` on the machine named, and is turned into this page",
        f"(and the README's table) by `{COMMAND}`; a test fails when the page and the files disagree.",
        "",
        "Each row times hotloop's way and torch's way of one job, alternated in one process after a",
        "warm-up (CUDA events on a GPU, the wall clock on a CPU), and gives the medians. *hotloop ÷ torch*",
        "is the ratio of the figures as stated; *better by* is how many times better hotloop does (for a",
        "time: torch ÷ hotloop; for a rate: hotloop ÷ torch). The *note* says what the torch column is.",
        "A CPU result measures the C reference paths, not the GPU kernels hotloop is built for; a run with",
        "`--quick` uses small sizes and few repetitions, and a machine that was busy (its load average",
        "is given) makes figures that move from run to run.",
        "",
        "To measure your own machine: `python -m hotloop bench components --json my-machine.json`",
        "(`--only COMPONENT` for one component). Whole models and loops have their own commands, which",
        "print their own tables: `bench train` (precision and batch size), `bench loop` (a training loop",
        "with hotloop's pieces against torch's), `bench distributed` (DDP and FSDP2),",
        "`bench inference` (latency); see the [CLI table](../README.md#command-line).",
        "",
    ]
    for result in ordered(results):
        link = os.path.relpath(result.path, here)
        out += [f"## {result.machine}", "",
                f"{_cell(result.describe())}. From [{os.path.basename(result.path)}]({link}), made by",
                f"`{result.settings['command']}`.", "",
                "| component | figure | hotloop | torch | hotloop ÷ torch | better by | note |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in result.rows:
            out.append("| " + " | ".join(_cell(c) for c in (row.component, row.figure, *_figures(row), row.note))
                       + " |")
        out.append("")
    return "\n".join(out)


def with_readme_table(readme_text, table) -> str:
    """The README with the text between its two markers replaced by the table."""
    begin, end = readme_text.find(README_BEGIN), readme_text.find(README_END)
    if begin < 0 or end < begin:
        raise BenchError(f"the README lacks the markers the table goes between: {README_BEGIN!r} then {README_END!r}")
    return readme_text[:begin + len(README_BEGIN)] + "\n" + table + "\n" + readme_text[end:]


def expected_files(paths, readme, page):
    """{path: the text it should hold} for the README and the performance page."""
    if not paths:
        raise BenchError("expected one or more JSON files written by `bench components --json`")
    results = [load(p) for p in paths]
    try:
        with open(readme) as f:
            readme_text = f.read()
    except OSError as err:
        raise BenchError(f"--readme {readme}: cannot read it: {err.strerror or err}") from None
    return {readme: with_readme_table(readme_text, readme_table(results)), page: performance_page(results, page)}


def run(args) -> int:
    wanted = expected_files(args.files, args.readme, args.performance)
    stale = []
    for path, text in wanted.items():
        try:
            with open(path) as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            with open(path, "w") as f:
                f.write(text)
    if args.check:
        for path in stale:
            print(f"hotloop bench report: {path} differs from what `{COMMAND}` makes", file=sys.stderr)
        return 1 if stale else 0
    for path in wanted:
        print(f"{'wrote' if path in stale else 'unchanged'} {path}")
    return 0

"""Comments give reasons, not runs: no comment or docstring in python/, csrc/ or kernels/ (bench/ aside,
whose rows print figures) quotes a throughput, a time per batch, or a GPU model's run, nor names a
script or branch the repository does not hold. Figures live in docs/results and docs/*.md, made by
`python -m hotloop bench`."""
import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ["python", "csrc", "kernels"]
SKIPPED = {"bench"}  # the benchmark rows: figures are what they print

GPU = r"(?:H100|H200|A100|A10G?|A40|L4|L40S?|V100|T4|B200|GB200|RTX ?\d{4}|\d{4} ?Ti)"
FIGURE = r"\d[\d.,]*\s*(?:k\s*)?(?:ms|µs|us|s|%|x|img/s|images/s|GB/s)(?!\w)"
RUN_LOGS = [
    (re.compile(r"\b(?:img|images|samples)/s\b"), "a throughput"),
    (re.compile(r"\d[\d.,]*(?:-\d[\d.,]*)?\s*ms\s+(?:a|per|each)\s+(?:batch|step|call|image)"), "a time per batch"),
    (re.compile(r"\bms/(?:batch|step|image)\b"), "a time per batch"),
    (re.compile(GPU + r"[^.;\n]{0,80}?" + FIGURE + "|" + FIGURE + r"[^.;\n]{0,80}?\(?" + GPU + r"\b"),
     "a GPU model's run"),
    (re.compile(r"\b(?:on|in) the [\w./-]+ branch\b"), "a branch"),
    (re.compile(r"(?:^|[\s(])\.gpu/"), "a script outside the repository"),
]


def _python_comments(text):
    """(line, text) of every # comment and docstring of a Python source."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _c_comments(text):
    return [(text.count("\n", 0, m.start()) + 1, m.group()) for m in _C_COMMENT.finditer(text)]


def _sources():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".c", ".h", ".cu", ".cuh") or SKIPPED & set(path.parts):
                continue
            yield path


def run_logs(text, c=False):
    """(line, what, the words) of each comment of the source that quotes a run."""
    found = []
    for line, comment in _c_comments(text) if c else _python_comments(text):
        flat = " ".join(comment.split())  # a figure wrapped over two lines reads as one
        for pattern, what in RUN_LOGS:
            m = pattern.search(flat)
            if m:
                found.append((line, what, m.group()))
    return found


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_comment_quotes_a_run(folder):
    """(csrc/'s comments pass once its run logs moved to docs/: issue 57's C part.)"""
    found = [f"{path.relative_to(ROOT)}:{line}: {what}: ...{words}..." for path in _sources()
             if path.parts[len(ROOT.parts)] == folder
             for line, what, words in run_logs(path.read_text(errors="replace"), c=path.suffix != ".py")]
    assert found == [], "comments give reasons, figures live in docs/:\n" + "\n".join(found)


@pytest.mark.parametrize("comment", [
    "# the loader alone ran at 22.8k img/s against 22.2k",
    "# it took the loader's thread 2.2 ms a batch of 256",
    "# (H100, medians of 4 fresh loaders): 11.4 ms",
    "# a call took 6.3 ms on an H100",
    "# measured with .gpu/diag_slot.py",
    "# on the gpu-diag branch",
    '"""Measured on an H200: 95.4 %."""',
])
def test_the_check_sees_a_run_log(comment):
    assert run_logs(f"{comment}\nx = 1\n"), comment
    assert run_logs("/* " + comment.strip('#"') + " */\nint x;\n", c=True), comment


@pytest.mark.parametrize("comment", [
    "# PCIe throughput blocks while NVML reads it: never ask for it faster than that",
    "# a branch per element would not vectorise",
    "# the JPEG engines (A100, H100, H200...): baseline, one scan",
    "# at most 20 ms while a task still waits for its slot",
])
def test_the_check_lets_reasons_pass(comment):
    assert run_logs(f"{comment}\nx = 1\n") == [], comment

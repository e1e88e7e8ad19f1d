"""The direction of calls in hotloop.data: each module imports only modules of the layers below its own
(parsed with ast, lazy imports included), and nothing below the loader's own layer (dataloader.py and
its iterators) is handed the loader: no weakref.proxy, no `loader` parameter or attribute, none of the
loader's or its iterators' `_hl_` state read. A module added to hotloop/data must be placed in LAYERS."""
import ast
import pathlib

import pytest

import hotloop

DATA = pathlib.Path(hotloop.__file__).parent / "data"

# top to bottom; a module may import modules of lower layers only (image/ is a package of its own,
# a BatchMaker the core reaches through batch_maker.py's hooks alone: test_stage_boundary.py)
LAYERS = [
    ["dataloader"],  # the user-facing class
    ["_iterators"],  # the iterators torch's loader returns: the loader's own layer, with the class
    ["_prefetch"],  # the thread that drives the feed between next() calls
    ["_feed"],  # one multi-worker epoch
    ["_pool"],  # tasks, messages, deaths, the ring's making
    ["_workers", "_slots", "_handout"],  # the processes and their pipes; the ring's slots; whole batches
    ["_launcher", "_making"],  # the process that forks workers 1..; where a maker's batches are made
    ["_worker", "_device"],  # the worker loop (runs in the worker processes); the copy engine
    ["_resume", "_rows", "normalize"],
    ["_tasks", "batch_maker", "leaf_transform"],
    ["_messages", "_batch", "_rng", "_config", "stats", "_inherited_garbage", "_shutdown"],
]
LEVEL = {name: k for k, names in enumerate(LAYERS) for name in names}
LOADER_LAYER = {"dataloader", "_iterators"}
BELOW_LOADER = [name for name in LEVEL if name not in LOADER_LAYER]


def _data_imports(path):
    """The hotloop.data modules the file imports (at any depth, lazy imports too), by name."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            elif node.level == 1:
                base = "hotloop.data" + (f".{node.module}" if node.module else "")
            else:
                continue  # above hotloop.data: not one of its modules
            dotted = [base] + [f"{base}.{alias.name}" for alias in node.names]  # `from . import _pool`
        else:
            continue
        for name in dotted:
            parts = name.split(".")
            if parts[:2] == ["hotloop", "data"] and len(parts) > 2 and parts[2] in LEVEL:
                found.add(parts[2])
    return found


def test_every_module_has_a_layer():
    modules = {p.stem for p in DATA.glob("*.py")} - {"__init__"}
    assert modules == set(LEVEL), f"place {sorted(modules - set(LEVEL))} in LAYERS; {sorted(set(LEVEL) - modules)} " \
                                  "are gone"


@pytest.mark.parametrize("name", sorted(LEVEL))
def test_imports_only_lower_layers(name):
    above = sorted(m for m in _data_imports(DATA / f"{name}.py") if m != name and LEVEL[m] <= LEVEL[name])
    assert above == [], f"{name} (layer {LEVEL[name]}) imports {above}, of its own layer or above: calls go down only"


def _handed_the_loader(path):
    """Where the file holds or reads a loader: weakref.proxy, a `loader` parameter, name or attribute,
    or the loader's (and its iterators') `_hl_` state."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "proxy" and isinstance(node.value, ast.Name) and node.value.id == "weakref":
                found.append((node.lineno, "weakref.proxy"))
            elif node.attr in ("loader", "_loader") or node.attr.startswith("_hl_"):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "weakref":
            found += [(node.lineno, "from weakref import proxy") for a in node.names if a.name == "proxy"]
        elif isinstance(node, ast.arg) and node.arg in ("loader", "_loader"):
            found.append((node.lineno, f"parameter {node.arg}"))
        elif isinstance(node, ast.Name) and node.id in ("loader", "_loader", "DataLoader"):
            found.append((node.lineno, f"name {node.id}"))
    return found


@pytest.mark.parametrize("name", BELOW_LOADER)
def test_nothing_below_the_loader_is_handed_it(name):
    """A lower object gets frozen settings (_config.py) and the stats sink, never the loader."""
    assert _handed_the_loader(DATA / f"{name}.py") == []


def test_the_checks_see_what_they_forbid(tmp_path):
    """Each check above fails where a module does what it forbids, however it is written."""
    imports = {"from ._feed import Feed": {"_feed"}, "from . import _pool": {"_pool"},
               "import hotloop.data.dataloader": {"dataloader"}, "def f():\n    from ._iterators import x\n": {"_iterators"},
               "from ..data._pool import Pool": set()}  # level 2 is hotloop: not resolved here, and not used
    for k, (source, expected) in enumerate(imports.items()):
        path = tmp_path / f"imports{k}.py"
        path.write_text(source + "\n")
        assert _data_imports(path) == expected, source
    handed = ["self.pool = weakref.proxy(pool)", "from weakref import proxy", "def __init__(self, loader): pass",
              "x = self.loader.stats", "x = owner._loader", "it._hl_pool.close()", "x = loader"]
    for k, source in enumerate(handed):
        path = tmp_path / f"handed{k}.py"
        path.write_text(source + "\n")
        assert _handed_the_loader(path), source
    clean = tmp_path / "clean.py"
    clean.write_text("def f(settings, stats):\n    stats.batches += 1\n    return settings.device\n")
    assert _handed_the_loader(clean) == []

"""The direction of calls in hotloop.data: each module imports only modules of the layers below its own
(parsed with ast, lazy imports included), and nothing below the loader's own layer (dataloader.py and
its iterators) is handed the loader: no weakref.proxy, no `loader` parameter or attribute, none of the
loader's or its iterators' `_hl_` state read. Modules live in rooms named by where their code runs
(ROOMS). A module added to hotloop/data must be placed in LAYERS.

One way down for a batch (NOTE [ One way down for a batch ] in data/prefetch/making.py): the copy
engine (ring/) imports nothing of image/ and of batch_maker.py, and calls no BatchMaker; a
BatchMaker's per-batch hooks are called from one module."""
import ast
import pathlib

import pytest

import hotloop

DATA = pathlib.Path(hotloop.__file__).parent / "data"

# where code runs: the consumer's side (next() in the main process), the prefetch thread, the worker
# process, the launcher process, the ring; image/ is gpu_decode's BatchMaker, a package of its own
ROOMS = {"consumer", "prefetch", "worker", "launcher", "ring", "image"}

# top to bottom, by dotted name under hotloop.data; a module may import modules of lower layers only
# (image/ is reached through batch_maker.py's hooks alone: test_stage_boundary.py)
LAYERS = [
    ["dataloader"],  # the user-facing class
    ["consumer.iterators"],  # the iterators torch's loader returns: the loader's own layer, with the class
    ["prefetch.thread"],  # the thread that drives the feed between next() calls
    ["consumer.feed"],  # one multi-worker epoch
    ["consumer.pool"],  # tasks, messages, deaths, the ring's making
    ["consumer.processes", "ring.slots", "consumer.handout"],  # the worker processes; the ring's slots; whole batches
    ["launcher.zygote", "prefetch.making"],  # the process that forks workers 1..; where a maker's batches are made
    ["worker.loop", "ring.copies"],  # the worker loop (runs in the worker processes); the copy engine
    ["consumer.resume", "worker.rows", "normalize"],
    ["consumer.tasks", "batch_maker", "leaf_transform"],
    ["messages", "ring.layout", "worker.rng", "settings", "stats", "worker.inherited_garbage", "at_exit"],
]
LEVEL = {name: k for k, names in enumerate(LAYERS) for name in names}
LOADER_LAYER = {"dataloader", "consumer.iterators"}
BELOW_LOADER = [name for name in LEVEL if name not in LOADER_LAYER]
COPY_ENGINE = ["ring.copies", "ring.slots", "ring.layout"]
MAKER_HOOKS = {"make", "place", "whole_batch", "slot_parts"}  # a BatchMaker's per-batch hooks
MAKING = "prefetch.making"  # where a batch becomes ready: the one module that calls them


def path_of(name):
    return DATA / (name.replace(".", "/") + ".py")


def dotted(path):
    """The module's dotted name under hotloop.data."""
    return ".".join(path.relative_to(DATA).with_suffix("").parts)


def _imported(path, package):
    """Every module (or module.name) the file imports, at any depth (lazy imports too), as an absolute
    dotted name; `package` is the file's own package (hotloop.data, or hotloop.data.ROOM)."""
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]  # `from . import pool`
    return names


def _data_imports(path, package="hotloop.data"):
    """The hotloop.data modules of LAYERS the file imports, by dotted name under hotloop.data."""
    found = set()
    for name in _imported(path, package):
        parts = name.split(".")
        if parts[:2] == ["hotloop", "data"]:
            for k in (4, 3):  # a room's module, or a module beside the rooms
                if ".".join(parts[2:k]) in LEVEL:
                    found.add(".".join(parts[2:k]))
                    break
    return found


def _package(name):
    return "hotloop.data" + ("." + name.rsplit(".", 1)[0] if "." in name else "")


def test_every_module_has_a_layer():
    modules = {dotted(p) for p in DATA.rglob("*.py")
               if p.name != "__init__.py" and p.relative_to(DATA).parts[0] != "image"}
    assert modules == set(LEVEL), f"place {sorted(modules - set(LEVEL))} in LAYERS; {sorted(set(LEVEL) - modules)} " \
                                  "are gone"


def test_rooms_say_where_code_runs():
    """data/ holds the user's class and what is shared beside a few rooms; each room says where its
    code runs in the line its __init__.py opens with."""
    rooms = {p.name for p in DATA.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == ROOMS
    for room in rooms - {"image"}:
        assert (DATA / room / "__init__.py").read_text().startswith('"""The '), room
    assert len(list(DATA.glob("*.py"))) <= 10, "a module beside the rooms: does it belong in one?"


@pytest.mark.parametrize("name", sorted(LEVEL))
def test_imports_only_lower_layers(name):
    imported = _data_imports(path_of(name), _package(name))
    above = sorted(m for m in imported if m != name and LEVEL[m] <= LEVEL[name])
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
    """A lower object gets frozen settings (settings.py) and the stats sink, never the loader."""
    assert _handed_the_loader(path_of(name)) == []


def _hook_calls(path):
    """(line, hook) of every call of a BatchMaker per-batch hook's name in the file."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.func.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MAKER_HOOKS
            and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self")]  # its own methods


@pytest.mark.parametrize("name", COPY_ENGINE)
def test_the_copy_engine_copies_bytes_and_makes_no_batch(name):
    """The copy engine imports nothing of image/, of batch_maker.py or of where batches are made, and
    calls no BatchMaker: it copies bytes and applies the leaf transform."""
    imported = _imported(path_of(name), _package(name))
    reached = [m for m in imported if m.startswith(("hotloop.data.image", "hotloop.data.batch_maker",
                                                     "hotloop.data.prefetch"))]
    assert reached == [], f"{name} imports {reached}"
    assert _hook_calls(path_of(name)) == [], f"{name} calls a BatchMaker"


def test_a_batch_maker_is_called_from_one_module():
    """make, place, whole_batch and slot_parts are called in prefetch/making.py alone (image/, the
    maker itself, aside): where a batch becomes ready."""
    callers = {dotted(p) for p in DATA.rglob("*.py")
               if p.relative_to(DATA).parts[0] != "image" and _hook_calls(p)}
    assert callers == {MAKING}, f"BatchMaker hooks called from {sorted(callers)}"


def test_the_checks_see_what_they_forbid(tmp_path):
    """Each check above fails where a module does what it forbids, however it is written."""
    imports = {"from .feed import Feed": {"consumer.feed"}, "from . import pool": {"consumer.pool"},
               "from ..ring import copies": {"ring.copies"}, "import hotloop.data.dataloader": {"dataloader"},
               "def f():\n    from .iterators import x\n": {"consumer.iterators"},
               "from ..settings import CopySettings": {"settings"}, "from ...data.ring.slots import RingSlots":
               {"ring.slots"}, "from ... import _C": set()}
    for k, (source, expected) in enumerate(imports.items()):
        path = tmp_path / f"imports{k}.py"
        path.write_text(source + "\n")
        assert _data_imports(path, "hotloop.data.consumer") == expected, source
    calls = tmp_path / "calls.py"
    calls.write_text("def f(maker, parts):\n    return maker.make(parts, 0, None)\n")
    assert _hook_calls(calls) == [(2, "make")]
    handed = ["self.pool = weakref.proxy(pool)", "from weakref import proxy", "def __init__(self, loader): pass",
              "x = self.loader.stats", "x = owner._loader", "it._hl_pool.close()", "x = loader"]
    for k, source in enumerate(handed):
        path = tmp_path / f"handed{k}.py"
        path.write_text(source + "\n")
        assert _handed_the_loader(path), source
    clean = tmp_path / "clean.py"
    clean.write_text("def f(settings, stats):\n    stats.batches += 1\n    return settings.device\n")
    assert _handed_the_loader(clean) == []

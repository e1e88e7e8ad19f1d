"""The package's layout holds: no module of hotloop uses another module's underscore names (what one
module needs from another is public there), and each component lives in its own folder."""
import ast
import pathlib

import pytest

import hotloop

PACKAGE = pathlib.Path(hotloop.__file__).parent
# the extension and the version are the package's own, offered to every module
SHARED = {"_C", "_version", "__version__"}


def modules():
    return {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}


def private(name):
    return name.startswith("_") and not name.startswith("__") and name not in SHARED


def defined_names(tree):
    """Underscore names a module binds: its functions, classes, attributes it assigns, what it imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if private(n)}


def crossings(path, tree, defined_elsewhere):
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("hotloop")):
            found += [f"{path}:{node.lineno}: imports {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if node.attr in defined_elsewhere:
                found.append(f"{path}:{node.lineno}: uses .{node.attr}")
    return found


def test_no_module_uses_another_modules_underscore_names():
    trees = modules()
    defined = {path: defined_names(tree) for path, tree in trees.items()}
    problems = []
    for path, tree in trees.items():
        elsewhere = set().union(*(names for other, names in defined.items() if other != path))
        problems += crossings(path, tree, elsewhere)
    assert not problems, "\n".join(problems)


def test_a_folder_per_component():
    top = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    components = {"data", "amp", "memory", "optim", "cli", "bench", "rtc", "integrations"}
    assert components <= top
    # the top level holds the package's entry points and what components publish to each other or share
    # (argument checks; rtc: the kernels' run-time compilation, which every component's kernels use;
    # _torch_compat: torch's private names, so that torch-version drift lives in one file; cuda_queues:
    # what `import hotloop` sets before CUDA starts, for every component), no component
    assert top - components == {"__init__.py", "__main__.py", "_version.py",
                                "input_wait.py", "_arguments.py", "_torch_compat.py", "cuda_queues.py"}


def test_every_subpackage_is_installed():
    """pyproject.toml lists the packages a wheel holds: a folder missing there works in an editable install
    and is absent from `pip install .` (hotloop.optim was, until CI's clean install said so)."""
    tomllib = pytest.importorskip("tomllib")
    root = pathlib.Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    source = root / "python"
    folders = {p.parent.relative_to(source).as_posix().replace("/", ".") for p in (source / "hotloop").rglob("__init__.py")}
    # hotloop.kernels is the top-level kernels/ folder, installed as data for NVRTC (package-dir)
    assert listed == folders | {"hotloop.kernels"}

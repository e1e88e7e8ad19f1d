"""The loader's core reaches gpu_decode's image path through batch_maker.BatchMaker alone: it imports
nothing of hotloop.data.image (the DataLoader class makes the maker, with image.make_maker), and
nothing outside ring/layout.py reads the spec's kind letters."""
import ast
import pathlib

import pytest
import torch

import hotloop
from hotloop.data import batch_maker, leaf_transform
from hotloop.data.ring import layout
from hotloop.data.image import ImageMaker

DATA = pathlib.Path(hotloop.__file__).parent / "data"
# the core: every module of data/ but the user's class and image/ (posix paths under data/)
CORE = sorted(p.relative_to(DATA).as_posix() for p in DATA.rglob("*.py")
              if p.relative_to(DATA).parts[0] != "image" and p.name not in ("dataloader.py", "__init__.py"))
SPEC_KINDS = {"T", "O", "S", "D", "L", "U", "N"}


def _imported_modules(path):
    """Every module the file imports, at any depth (a function's lazy import too), as an absolute
    dotted name resolved from the file's package."""
    inside = DATA in path.parents
    own = ["hotloop"] + list(path.relative_to(DATA.parent).parent.parts) if inside else ["hotloop", "data"]
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module
            else:
                package = own[:len(own) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]  # `from . import image`
    return names


def _image_imports(path):
    return [m for m in _imported_modules(path) if m == "hotloop.data.image" or m.startswith("hotloop.data.image.")]


@pytest.mark.parametrize("name", CORE)
def test_core_imports_nothing_of_image(name):
    imported = _imported_modules(DATA / name)
    assert imported or name in ("leaf_transform.py", "messages.py", "settings.py"), \
        f"{name}: no imports found (the parser missed them)"
    reached = _image_imports(DATA / name)
    assert reached == [], f"{name} imports {reached}: the core reaches image/ through BatchMaker's hooks only"


def test_the_loader_class_imports_only_the_makers_factory():
    """dataloader.py makes the maker (gpu_decode= is its argument); nothing else of image/."""
    assert _image_imports(DATA / "dataloader.py") == ["hotloop.data.image", "hotloop.data.image.make_maker"]


def test_the_interfaces_and_image_form_no_circle():
    """image/ builds on batch_maker.py; batch_maker.py and leaf_transform.py import nothing of data/
    but the spec helpers (ring/layout.py)."""
    for name in ("batch_maker.py", "leaf_transform.py"):
        data = [m for m in _imported_modules(DATA / name) if m.startswith("hotloop.data")]
        assert all(m.startswith("hotloop.data.ring.layout") for m in data), (name, data)


def test_the_parser_sees_image_imports(tmp_path):
    """The check above fails where a core module imports image/, however it is written."""
    cases = ["from .image import ImageMaker", "from .image.maker import encoded_parts", "from . import image",
             "import hotloop.data.image.nvjpeg", "def f():\n    from .image import make_maker\n"]
    for k, source in enumerate(cases):
        path = tmp_path / f"case{k}.py"
        path.write_text(source + "\n")
        assert any(m.startswith("hotloop.data.image") for m in _imported_modules(path)), source


@pytest.mark.parametrize("name", [n for n in CORE if n != "ring/layout.py"] + ["dataloader.py", "image/maker.py",
                                                                        "image/source.py", "image/gpu_decode.py"])
def test_no_spec_kind_literals_outside_the_layout(name):
    """A comparison with a spec kind's letter ("L", "D", "T", ...) outside ring/layout.py is code reading
    the spec by hand: ring.layout's spec_list / spec_dict / ring_leaf name the kinds."""
    tree = ast.parse((DATA / name).read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left] + node.comparators:
                if isinstance(side, ast.Constant) and side.value in SPEC_KINDS:
                    found.append((node.lineno, side.value))
                if isinstance(side, (ast.Tuple, ast.Set, ast.List)):
                    found += [(node.lineno, e.value) for e in side.elts
                              if isinstance(e, ast.Constant) and e.value in SPEC_KINDS]
    assert found == []


def test_spec_helpers_read_what_flatten_writes():
    tensors = []
    spec = layout.flatten([{"a": torch.zeros(2), "b": "side"}, (torch.ones(3),)], tensors)
    children = layout.spec_list(spec)
    assert children is not None and len(children) == 2
    items = layout.spec_dict(children[0])
    assert set(items) == {"a", "b"}
    assert layout.ring_leaf(items["a"]) == 0 and tensors[0] is not None
    assert layout.ring_leaf(items["b"]) is None  # a side object
    assert layout.spec_dict(spec) is None and layout.spec_list(children[0]) is None
    assert layout.ring_leaf(spec) is None
    # a tuple of samples collates to a tuple here (flatten keeps the type): not a list node
    assert layout.spec_list(children[1]) is None
    assert layout.ring_leaf(layout.flatten(torch.ones(1), [])) == 0


def test_each_side_implements_its_interface():
    assert issubclass(hotloop.Normalize, leaf_transform.LeafTransform)
    assert issubclass(ImageMaker, batch_maker.BatchMaker)
    assert not issubclass(hotloop.Normalize, batch_maker.BatchMaker)
    assert not issubclass(ImageMaker, leaf_transform.LeafTransform)
    for interface in (batch_maker.BatchMaker, leaf_transform.LeafTransform):
        hooks = [n for n, v in vars(interface).items() if callable(v) and not n.startswith("_")]
        implemented = ImageMaker if interface is batch_maker.BatchMaker else hotloop.Normalize
        missing = [n for n in hooks if getattr(implemented, n) is getattr(interface, n)
                   and n not in ("expect_device", "use_device")]
        assert missing == [], f"{implemented.__name__} leaves {missing} of {interface.__name__} unimplemented"
    tf = hotloop.Normalize((0.5,) * 3, (0.25,) * 3)
    assert tf.leaf_outputs([(torch.uint8, (2, 4, 4, 3)), (torch.int64, (2,))]) == [True, False]
    with pytest.raises(ValueError, match="no image leaf"):
        tf.leaf_outputs([(torch.int64, (2,))])

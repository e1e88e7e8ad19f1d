"""What the sdist and each wheel hold, against the manifest the repository implies (the C sources and
headers, the kernels, the Python package, the license), and the metadata an index shows."""
import email
import os
import re
import subprocess
import tarfile
import zipfile

import pytest

import hotloop

from . import release_files

ROOT = release_files.ROOT
EGG_INFO = {"PKG-INFO", "SOURCES.txt", "dependency_links.txt", "entry_points.txt", "requires.txt", "top_level.txt"}
DIST_INFO = {"METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt", "licenses/LICENSE"}


def tracked(folder):
    """The files git tracks under `folder`, relative to the repository's root."""
    out = subprocess.run(["git", "ls-files", "--", folder], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def expected_sdist():
    return ({"setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "PKG-INFO", "setup.cfg"}
            | tracked("csrc") | tracked("kernels") | tracked("python/hotloop")
            | {f"python/hotloop.egg-info/{name}" for name in EGG_INFO})


def expected_wheel():
    package = {"hotloop/" + os.path.relpath(p, "python/hotloop") for p in tracked("python/hotloop")}
    kernels = {"hotloop/kernels/" + os.path.basename(p) for p in tracked("kernels")}
    dist_info = {f"hotloop-{hotloop.__version__}.dist-info/{name}" for name in DIST_INFO}
    return package | kernels | dist_info | {"hotloop/_C.abi3.so"}


def test_sdist_holds_the_sources_headers_kernels_and_license():
    names = release_files.sdist_names(release_files.sdist())
    expected = expected_sdist()
    assert not expected - names, f"missing from the sdist: {sorted(expected - names)}"
    assert not names - expected, f"not expected in the sdist: {sorted(names - expected)}"
    assert any(n.endswith(".h") for n in names if n.startswith("csrc/"))


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_wheel_holds_the_package_kernels_module_and_license(arch):
    wheels = release_files.manylinux_wheels()
    if arch not in wheels:
        pytest.skip(f"no {arch} wheel was built")
    names = release_files.wheel_names(wheels[arch])
    expected = expected_wheel()
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    assert not names - expected, f"not expected in the wheel: {sorted(names - expected)}"
    assert {n for n in names if n.startswith("hotloop/kernels/") and n.endswith(".cu")}


def wheel_metadata(path):
    with zipfile.ZipFile(path) as z:
        text = z.read(f"hotloop-{hotloop.__version__}.dist-info/METADATA").decode()
        wheel = z.read(f"hotloop-{hotloop.__version__}.dist-info/WHEEL").decode()
    return email.message_from_string(text), wheel


def sdist_metadata(path):
    with tarfile.open(path) as tar:
        text = tar.extractfile(f"hotloop-{hotloop.__version__}/PKG-INFO").read().decode()
    return email.message_from_string(text)


def test_metadata_an_index_shows():
    meta, wheel = wheel_metadata(release_files.manylinux_wheels()["x86_64"])
    assert re.search(r"^Tag: cp310-abi3-manylinux_2_28_x86_64$", wheel, flags=re.M), wheel
    version = re.search(r'__version__ = "([^"]+)"', open(os.path.join(ROOT, "python/hotloop/_version.py")).read())
    for m in (meta, sdist_metadata(release_files.sdist())):
        assert m["Name"] == "hotloop" and m["Version"] == version.group(1) == hotloop.__version__
        assert m["License"] == "MIT" and m["License-File"] == "LICENSE"
        assert m["Requires-Python"] == ">=3.10"
        assert m["Description-Content-Type"] == "text/markdown"
        assert m.get_payload().strip() == open(os.path.join(ROOT, "README.md")).read().strip()
        classifiers = set(m.get_all("Classifier"))
        assert "Operating System :: POSIX :: Linux" in classifiers
        assert "Environment :: GPU :: NVIDIA CUDA" in classifiers
        assert {f"Programming Language :: Python :: 3.{minor}" for minor in (10, 11, 12, 13)} <= classifiers
        assert any(c.startswith("Topic :: ") for c in classifiers)
        assert "numpy" in m.get_all("Requires-Dist")
        assert not [r for r in m.get_all("Requires-Dist") if r.startswith("torch") and "extra ==" not in r]

"""The release files under test (an sdist and manylinux wheels that .ci/release-check built), what they
hold, and the glibc symbol versions an ELF file asks for."""
import glob
import os
import re
import subprocess
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLIBC_FLOOR = (2, 28)  # torch's own wheels need it: NOTE [ One wheel for every Linux ] in setup.py
# what _C may link: glibc's own libraries, which every manylinux system provides
SYSTEM_LIBRARIES = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1"}


def release_dir():
    """The folder .ci/release-check built the release files into; the tests skip without one."""
    folder = os.environ.get("HOTLOOP_RELEASE_DIST", "")
    if not folder:
        pytest.skip("the release files are built by .ci/release-check, which runs these tests with "
                    "HOTLOOP_RELEASE_DIST set")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"HOTLOOP_RELEASE_DIST={folder!r} is not a folder")
    return folder


def sdist():
    (path,) = glob.glob(os.path.join(release_dir(), "hotloop-*.tar.gz"))
    return path


def manylinux_wheels():
    """{arch: path} of the manylinux wheels built; x86_64 is always among them."""
    found = {}
    for path in glob.glob(os.path.join(release_dir(), "hotloop-*.whl")):
        match = re.search(r"-cp310-abi3-manylinux_2_28_(\w+)\.whl$", os.path.basename(path))
        assert match, f"{os.path.basename(path)} is not tagged cp310-abi3-manylinux_2_28_<arch>"
        found[match.group(1)] = path
    assert "x86_64" in found, f"no x86_64 wheel among {sorted(found)}"
    return found


def sdist_names(path):
    """The sdist's files, without its top folder (hotloop-<version>/)."""
    with tarfile.open(path) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    return {name.split("/", 1)[1] for name in names}


def wheel_names(path):
    with zipfile.ZipFile(path) as z:
        return set(z.namelist())


def extract_module(wheel, folder):
    """Unpacks the wheel's _C into `folder` and returns its path."""
    with zipfile.ZipFile(wheel) as z:
        (so,) = [n for n in z.namelist() if re.fullmatch(r"hotloop/_C\.abi3\.so", n)]
        z.extract(so, folder)
    return os.path.join(folder, so)


def dynamic_facts(path):
    """(glibc versions asked for, as tuples; NEEDED libraries; RPATH/RUNPATH entries) of an ELF file.
    readelf reads any architecture's ELF, so an aarch64 _C is checked on an x86_64 machine too."""
    symbols = subprocess.run(["readelf", "--dyn-syms", "--wide", path], capture_output=True, text=True, check=True)
    versions = {tuple(int(part) for part in v.split(".")) for v in re.findall(r"@GLIBC_([0-9.]+)", symbols.stdout)}
    dynamic = subprocess.run(["readelf", "--dynamic", "--wide", path], capture_output=True, text=True, check=True)
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic.stdout))
    paths = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", dynamic.stdout)
    return versions, needed, paths


def newer_than_floor(path):
    """The glibc versions `path` asks for that are newer than GLIBC_FLOOR, as 'GLIBC_2.34' strings."""
    versions, _, _ = dynamic_facts(path)
    return sorted("GLIBC_" + ".".join(map(str, v)) for v in versions if v > GLIBC_FLOOR)

"""Each manylinux wheel's _C asks for no glibc symbol newer than 2.28, links glibc's libraries alone and
carries no rpath; the same check finds the newer symbols of a build by this machine's compiler."""
import os

import pytest

import hotloop

from . import release_files


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_release_module_needs_glibc_2_28_at_most(arch, tmp_path):
    wheels = release_files.manylinux_wheels()
    if arch not in wheels:
        pytest.skip(f"no {arch} wheel was built")
    module = release_files.extract_module(wheels[arch], tmp_path)
    versions, needed, paths = release_files.dynamic_facts(module)
    assert versions, "readelf found no versioned glibc symbol: the check read nothing"
    assert release_files.newer_than_floor(module) == []
    assert needed <= release_files.SYSTEM_LIBRARIES, needed - release_files.SYSTEM_LIBRARIES
    assert paths == []


def test_the_check_finds_a_newer_glibc_in_a_system_build():
    # the _C this interpreter imported was built by the system compiler (pip install .): on glibc 2.34
    # and newer, dlopen and pthread_create moved into libc under GLIBC_2.34, and it asks for them so
    host = os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
    if tuple(int(p) for p in host.split(".")) < (2, 34):
        pytest.skip(f"this machine's glibc ({host}) is older than 2.34")
    release_files.release_dir()  # run with the release files: the installed _C is then a system build
    if hotloop.build_info()["sanitizers"]:
        pytest.skip("a sanitizer build")
    assert "GLIBC_2.34" in release_files.newer_than_floor(hotloop._C.__file__)

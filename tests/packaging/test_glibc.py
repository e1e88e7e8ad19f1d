"""Each manylinux wheel's _C asks for no glibc symbol newer than 2.28, links glibc's libraries alone and
carries no rpath; the same check finds the newer symbols of a build by this machine's compiler."""
import os
import subprocess

import pytest

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


def test_the_check_finds_a_newer_glibc_in_a_system_build(tmp_path):
    # a library this machine's compiler links, calling dlopen: on glibc 2.34 and newer dlopen moved into
    # libc under GLIBC_2.34, and such a build asks for that version (as `pip install .` builds _C do)
    host = os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
    if tuple(int(p) for p in host.split(".")) < (2, 34):
        pytest.skip(f"this machine's glibc ({host}) is older than 2.34")
    source = tmp_path / "probe.c"
    source.write_text("#include <dlfcn.h>\nvoid *probe(const char *name) { return dlopen(name, RTLD_NOW); }\n")
    library = tmp_path / "probe.so"
    compiler = os.environ.get("CC", "cc").split()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # CI's sanitizer step preloads ASan
    subprocess.run(compiler + ["-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=120, env=env)
    assert "GLIBC_2.34" in release_files.newer_than_floor(str(library))

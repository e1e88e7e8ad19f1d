"""The x86_64 release wheel's _C, loaded by every CPython >= 3.10 on this machine (pyenv's), runs its
libc-facing parts: shared memory (memfd), the sampler thread, /proc reading, dlopen of the driver."""
import subprocess
import textwrap

import pytest

from ..test_build import other_pythons
from . import release_files

MINORS = (10, 11, 12, 13)  # the classifiers in pyproject.toml name these

SCRIPT = textwrap.dedent("""
    import importlib.util, os, random, sys, time
    spec = importlib.util.spec_from_file_location("hotloop._C", sys.argv[1])
    C = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(C)
    assert C.build_info()["abi3"] is True and C.build_info()["cuda"] == "driver+nvrtc", C.build_info()
    # a ring of memfd shared memory: bytes written through one mapping are read through another
    ring = C.Ring(2, C.RING_PAGE_BYTES)
    other = C.Ring(2, C.RING_PAGE_BYTES, fd=os.dup(ring.fd))
    data = bytes(random.getrandbits(8) for _ in range(C.RING_PAGE_BYTES))
    ring.view(1)[:] = data
    assert bytes(other.view(1)) == data and other.nslots == 2
    other.close()
    ring.close()
    # the host sampler's thread reads this process's memory from /proc
    sampler = C.HostSampler(10.0, 10.0, 64, False, 0.02)
    sampler.start()
    time.sleep(0.1)
    sampler.stop()
    assert C.proc_memory(os.getpid())["rss"] > 0
    assert C.machine_memory()["total"] > 0
    # no driver here: dlopen fails and says so, in words
    print("cuda:", C.cuda_unavailable_reason() or "available")
    print("ran on", sys.version_info[:2])
""")


@pytest.mark.parametrize("minor", MINORS)
def test_release_module_runs_on_every_python(minor, tmp_path):
    wheel = release_files.manylinux_wheels()["x86_64"]
    exe = dict(other_pythons()).get(minor)
    if exe is None:
        pytest.skip(f"no CPython 3.{minor} on this machine")
    module = release_files.extract_module(wheel, tmp_path)
    out = subprocess.run([exe, "-I", "-c", SCRIPT, module], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"ran on (3, {minor})" in out.stdout

"""What an NVRTC said of itself, remembered beside the kernel images: a cached start never opens NVRTC, a
changed or damaged record is asked again, and a real compile still opens the library (NOTE [ Remembered
NVRTC facts ])."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import hotloop
from hotloop.rtc import nvrtc_facts, nvrtc_finder

from .conftest import wheel

FAKE_CUDA_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fake_cuda", "fake_cuda.c")


class CountingOpener:
    """open_nvrtc that counts its calls."""

    def __init__(self):
        self.opened = []

    def __call__(self, path):
        self.opened.append(path)
        return nvrtc_finder.open_nvrtc(path)


def test_first_sight_opens_and_remembers_then_a_later_process_does_not_open(nvrtc, cache_dir):
    opener = CountingOpener()
    first = nvrtc_facts.known_nvrtc(nvrtc.path, opener)
    assert opener.opened == [nvrtc.path] and first.opened
    assert first.version == tuple(nvrtc.version) and first.supported_archs() == nvrtc.supported_archs()
    again = nvrtc_facts.known_nvrtc(nvrtc.path, opener)
    assert opener.opened == [nvrtc.path] and not again.opened  # from the record alone
    assert again.version == first.version and again.supported_archs() == first.supported_archs()
    # the first compile opens it
    image = again.compile(b'extern "C" __global__ void k(float *x) { x[0] = 1.0f; }', "k.cu",
                          ["-arch=compute_%d" % min(again.supported_archs())], False)
    assert b".entry k" in image and again.opened and opener.opened == [nvrtc.path, nvrtc.path]


def test_a_changed_library_or_a_damaged_record_is_asked_again(nvrtc, cache_dir, tmp_path):
    copy = tmp_path / "lib" / os.path.basename(nvrtc.path)
    copy.parent.mkdir()
    for f in os.listdir(os.path.dirname(nvrtc.path)):  # the builtins library travels beside it
        shutil.copy(os.path.join(os.path.dirname(nvrtc.path), f), copy.parent / f)
    opener = CountingOpener()
    nvrtc_facts.known_nvrtc(str(copy), opener)
    assert nvrtc_facts.remembered(str(copy)) is not None
    os.utime(copy, ns=(0, os.stat(copy).st_mtime_ns + 10**9))  # replaced in place: its time changed
    assert nvrtc_facts.remembered(str(copy)) is None
    nvrtc_facts.known_nvrtc(str(copy), opener)
    assert len(opener.opened) == 2
    (record,) = (cache_dir / "kernels").glob("nvrtc.*.json")
    for damage in ("", "{", json.dumps({"path": str(copy)}), "[1, 2]"):
        record.write_text(damage)
        assert nvrtc_facts.remembered(str(copy)) is None
    facts = nvrtc_facts.known_nvrtc(str(copy), opener)
    assert len(opener.opened) == 3 and facts.version == tuple(nvrtc.version)


def test_an_unwritable_cache_folder_only_means_opening_each_time(nvrtc, cache_dir):
    cache_dir.mkdir(parents=True)
    (cache_dir / "kernels").write_text("a file where the folder should be")
    opener = CountingOpener()
    nvrtc_facts.known_nvrtc(nvrtc.path, opener)
    nvrtc_facts.known_nvrtc(nvrtc.path, opener)
    assert opener.opened == [nvrtc.path, nvrtc.path]


CACHED_START = """
    import json, os, hotloop
    from hotloop import _C
    from hotloop.rtc import nvrtc_finder
    for source in _C.KERNEL_SOURCES:
        _C.kernels_load(0, source)
    maps = open("/proc/self/maps").read()
    print(json.dumps({"loaded": sorted(_C.kernels_loaded(0)), "nvrtc_mapped": "libnvrtc" in maps,
                      "opened": nvrtc_finder.find_nvrtc().opened}))
"""


@pytest.mark.skipif(hotloop.build_info()["cuda"] is None, reason="a HOTLOOP_CUDA=0 build never opens the driver")
def test_a_cached_start_loads_every_kernel_without_opening_nvrtc(nvrtc_wheels, tmp_path):
    wheel(nvrtc_wheels, 13)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    fake = str(tmp_path / "libfake_cuda.so")
    subprocess.check_call([cc, "-shared", "-fPIC", "-O1", "-std=c11", "-D_GNU_SOURCE", "-o", fake, FAKE_CUDA_SOURCE])
    env = dict(os.environ, HOTLOOP_LIBCUDA=fake, FAKE_CUDA_VERSION="13000", FAKE_CUDA_CC="90",
               HOTLOOP_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("HOTLOOP_NVRTC", None)

    def start():
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(CACHED_START)], capture_output=True, text=True,
                             env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, cached = start(), start()
    assert cold["loaded"] == cached["loaded"] == sorted(hotloop._C.KERNEL_SOURCES)
    assert cold["nvrtc_mapped"] and cold["opened"]  # the first process compiled
    assert not cached["nvrtc_mapped"] and not cached["opened"]

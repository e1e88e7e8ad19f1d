"""doctor's trust checks: a cache folder, an entry or a HOTLOOP_* library path that others can write is a
warning that says what and how to mend it; the user's own are a pass."""
import json
import os
import re
import subprocess
import sys

import pytest

from hotloop.cli import trust_checks
from hotloop.rtc import kernel_cache

NOBODY = 65534


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HOTLOOP_CACHE_DIR", str(root))
    monkeypatch.delenv("HOTLOOP_CACHE_TRUSTED_OWNERS", raising=False)
    for variable in trust_checks.LIBRARY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    return root


def make_entries(root, count=2):
    folder = root / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    entries = [folder / f"tiny.sm_80.{i}.cubin" for i in range(count)]
    for entry in entries:
        entry.write_bytes(kernel_cache.pack(os.urandom(64)))
        os.chmod(entry, 0o600)
    return folder, entries


def test_a_cache_not_made_yet_and_ones_own_pass(cache):
    name, status, value = trust_checks.cache_folder_check()
    assert (name, status) == ("kernel cache trust", "PASS") and "not made yet" in value
    folder, _ = make_entries(cache)
    assert trust_checks.cache_folder_check()[1:] == ("PASS", f"{folder}: no one else can write it or its entries")


def test_a_cache_folder_others_can_write_is_a_warning_with_the_mend(cache):
    folder, _ = make_entries(cache)
    os.chmod(folder, 0o777)
    _, status, value, advice = trust_checks.cache_folder_check()
    assert status == "WARN" and f"{folder} is writable by group and others (mode 777)" in value
    assert f"chmod 700 {folder}" in advice


def test_entries_others_can_write_are_a_warning(cache):
    folder, entries = make_entries(cache, 3)
    os.chmod(entries[1], 0o666)
    _, status, value, advice = trust_checks.cache_folder_check()
    assert status == "WARN" and value.startswith(f"1 entries in {folder} are not loaded: {entries[1].name} is writable")
    assert "remove them" in advice


def test_the_folder_above_writable_by_others_is_a_warning(cache):
    make_entries(cache)
    os.chmod(cache, 0o777)
    _, status, value, advice = trust_checks.cache_folder_check()
    assert status == "WARN" and f"{cache} is writable by group and others" in value and advice == f"chmod go-w {cache}"


@pytest.mark.parametrize("variable", sorted(trust_checks.LIBRARY_VARIABLES))
def test_a_library_path_others_can_write_is_a_warning(cache, tmp_path, monkeypatch, variable):
    library = tmp_path / "libs" / "libsomething.so"
    library.parent.mkdir()
    library.write_bytes(b"\x7fELF")
    monkeypatch.setenv(variable, str(library))
    name, status, value = trust_checks.library_paths_check()
    assert (name, status) == ("library paths", "PASS") and f"{variable}={library}" in value
    os.chmod(library.parent, 0o775)
    _, status, value, advice = trust_checks.library_paths_check()
    assert status == "WARN" and f"{variable}={library}: {library.parent} is writable by group (mode 775)" in value
    assert "chmod go-w" in advice


def test_doctor_shows_the_checks(tmp_path):
    folder, _ = make_entries(tmp_path / "cache")
    os.chmod(folder, 0o757)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTLOOP_")}
    env.update(HOTLOOP_CACHE_DIR=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="",
               HOTLOOP_NVML_LIBRARY=str(tmp_path / "no-libnvidia-ml.so"))
    done = subprocess.run([sys.executable, "-m", "hotloop", "doctor", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["kernel cache trust"]["status"] == "WARN" and "writable by others (mode 757)" in \
        checks["kernel cache trust"]["value"]
    assert checks["library paths"]["status"] in ("PASS", "WARN") and done.returncode >= 1


def test_info_says_where_each_library_was_found_and_what_was_left_out(tmp_path):
    chosen = tmp_path / "libs" / "libnvjpeg.so.13"
    chosen.parent.mkdir()
    chosen.write_bytes(b"\x7fELF")
    os.chmod(chosen, 0o666)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTLOOP_")}
    env.update(HOTLOOP_CACHE_DIR=str(tmp_path / "cache"), HOTLOOP_NVJPEG=str(chosen))
    done = subprocess.run([sys.executable, "-m", "hotloop", "info", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    places = json.loads(done.stdout)["library_places"]
    assert places["nvjpeg"] == [{"path": None, "origin": None, "skipped": places["nvjpeg"][0]["skipped"]}]
    assert f"HOTLOOP_NVJPEG={chosen} is not opened: {chosen} is writable by group and others" in \
        places["nvjpeg"][0]["skipped"]
    nvrtc = [p for p in places["nvrtc"] if not p["skipped"]]
    text = subprocess.run([sys.executable, "-m", "hotloop", "info"], capture_output=True, text=True, env=env,
                          timeout=120).stdout
    assert "nvjpeg left out" in text and f"HOTLOOP_NVJPEG={chosen} is not opened" in text
    if nvrtc:  # the NVRTC in use, and where it came from
        assert re.search(rf"^NVRTC found as +{re.escape(nvrtc[0]['origin'])}$", text, re.M)

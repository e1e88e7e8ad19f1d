"""Where NVRTC and nvjpeg are looked for (NOTE [ Library search ]): installed places only, never the current
directory that `python -m` and `python -c` put on sys.path, and never a file or folder others can write or
an untrusted user owns (NOTE [ Trusted files ]). A planted library is a real shared object whose
constructor leaves a mark, so that being opened cannot go unseen."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from hotloop.data.image.nvjpeg import nvjpeg_library_candidates
from hotloop.rtc import file_trust, library_search, nvrtc_facts, nvrtc_finder

NOBODY = 65534
PLANTED_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
/* runs when the library is loaded: the mark says it was */
__attribute__((constructor)) static void planted(void) {
    const char *mark = getenv("PLANTED_MARK");
    FILE *f = mark ? fopen(mark, "a") : NULL;
    if (f) {
        fputs("a planted library was loaded\n", f);
        fclose(f);
    }
}
"""
PLANTED_NAMES = ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
                 "nvidia/cu13/lib/libnvrtc-builtins.so.13.0", "nvidia/cu13/lib/libnvjpeg.so.13",
                 "libnvrtc-builtins.so.13.0", "libnvrtc.so.13", "torchvision.libs/libnvjpeg.planted.so.13")


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory):
    """A shared object whose loading appends a line to $PLANTED_MARK."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a planted library")
    folder = tmp_path_factory.mktemp("planted")
    (folder / "planted.c").write_text(PLANTED_SOURCE)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "planted.so"), str(folder / "planted.c")],
                   check=True)
    return folder / "planted.so"


PROBE = textwrap.dedent("""
    # run with python -m from a folder holding planted libraries: sys.path[0] is that folder. torch is not
    # imported: its own loader walks sys.path for nvidia/*/lib and would open them itself
    import json, os, sys
    from hotloop import _C
    from hotloop.rtc import library_search, nvrtc_finder
    seen = {"sys_path_0": sys.path[0], "nvrtc": None, "nvjpeg": None, "torch": "torch" in sys.modules}
    try:
        seen["nvrtc"] = nvrtc_finder.find_nvrtc(driver_version=None).library().path  # opened, not only known
    except RuntimeError as exc:
        seen["nvrtc_error"] = str(exc)
    seen["nvjpeg_candidates"] = [c.path for c in library_search.nvjpeg_search() if not c.skipped]  # as gpu_decode
    try:
        seen["nvjpeg"] = _C.nvjpeg_load(seen["nvjpeg_candidates"])[0]
    except RuntimeError as exc:
        seen["nvjpeg_error"] = str(exc)
    try:  # a bare name: the dynamic linker's search, and NVRTC's builtins never looked for in "."
        _C.Nvrtc("libnvrtc.so.13")
    except RuntimeError:
        pass
    print(json.dumps(seen))
""")


def test_libraries_planted_in_the_current_directory_are_never_opened(planted_library, tmp_path):
    workdir = tmp_path / "work"
    for name in PLANTED_NAMES:
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(planted_library, workdir / name)
    (workdir / "probe_libraries.py").write_text(PROBE)
    mark = tmp_path / "mark"
    env = dict(os.environ, PLANTED_MARK=str(mark), HOTLOOP_CACHE_DIR=str(tmp_path / "cache"))
    for variable in ("HOTLOOP_NVRTC", "HOTLOOP_NVJPEG", "PYTHONPATH"):
        env.pop(variable, None)
    # the mark works: the planted library, opened on purpose, leaves it
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(planted_library)!r})"], env=env,
                   check=True)
    assert mark.read_text() == "a planted library was loaded\n"
    mark.unlink()
    done = subprocess.run([sys.executable, "-m", "probe_libraries"], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["sys_path_0"] == str(workdir) and not seen["torch"]  # python -m put the current directory first
    assert not mark.exists(), seen
    opened = [seen["nvrtc"], seen["nvjpeg"]] + seen["nvjpeg_candidates"]
    assert not [p for p in opened if p and p.startswith(str(workdir))], seen


@pytest.fixture
def site(tmp_path, monkeypatch):
    """One site-packages folder of the test's own, and nothing else where libraries are looked for."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    monkeypatch.setattr(library_search, "site_packages_dirs", lambda: [str(folder)])
    monkeypatch.setattr(library_search, "toolkit_lib_dirs", lambda: [])
    monkeypatch.setattr(library_search, "environment_lib_dir", lambda: None)
    for variable in ("HOTLOOP_NVRTC", "HOTLOOP_NVJPEG", "CUDA_HOME"):
        monkeypatch.delenv(variable, raising=False)
    return folder


def put(path, text="not a library"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_site_packages_folders_never_include_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", ".", str(tmp_path)] + sys.path)
    dirs = library_search.site_packages_dirs()
    assert dirs and str(tmp_path) not in dirs and "" not in dirs and all(os.path.isabs(d) for d in dirs)


def nvrtc_paths(skipped):
    return [c.path for c in nvrtc_finder.nvrtc_candidates(driver_version=None) if bool(c.skipped) == skipped]


@pytest.mark.parametrize("writable", ["file", "folder", "folder above"])
def test_an_nvrtc_others_can_write_is_never_tried(site, writable):
    good = put(site / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    bad = put(site / "nvidia/cu13/lib/libnvrtc.so.13")
    os.chmod({"file": bad, "folder": bad.parent, "folder above": bad.parent.parent}[writable], 0o777)
    assert nvrtc_paths(skipped=False) == [str(good)] and nvrtc_paths(skipped=True) == [str(bad)]
    skipped = [c for c in nvrtc_finder.nvrtc_candidates(driver_version=None) if c.skipped][0]
    assert skipped.skipped.startswith("not opened: ")
    assert "is writable by group and others (mode 777)" in skipped.skipped


def test_a_sticky_folder_others_can_write_does_not_refuse_what_lies_below(site):
    sticky = site / "nvidia"
    good = put(sticky / "cu13/lib/libnvrtc.so.13")
    os.chmod(sticky, 0o1777)  # as /tmp: others may add names, not replace ours
    assert nvrtc_paths(skipped=False) == [str(good)]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_an_nvrtc_another_user_owns_is_never_tried_unless_trusted(site, monkeypatch):
    theirs = put(site / "nvidia/cu13/lib/libnvrtc.so.13")
    builtins = put(site / "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.9")
    beside_builtins = put(site / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    os.chown(theirs, NOBODY, NOBODY)
    os.chown(builtins, NOBODY, NOBODY)  # NVRTC loads its builtins from its folder: they count too
    assert nvrtc_paths(skipped=False) == [] and nvrtc_paths(skipped=True) == [str(theirs), str(beside_builtins)]
    reasons = [c.skipped for c in nvrtc_finder.nvrtc_candidates(driver_version=None)]
    assert f"{theirs} is owned by nobody (uid 65534)" in reasons[0] and str(builtins) in reasons[1]
    monkeypatch.setenv(file_trust.TRUSTED_OWNERS_VARIABLE, "root,nobody")
    assert nvrtc_paths(skipped=False) == [str(theirs), str(beside_builtins)]


CHOSEN_SEARCH = {"HOTLOOP_NVRTC": lambda: [c.path for c in nvrtc_finder.nvrtc_candidates(driver_version=None)],
                 "HOTLOOP_NVJPEG": nvjpeg_library_candidates}


@pytest.mark.parametrize("variable", sorted(CHOSEN_SEARCH))
@pytest.mark.parametrize("writable", ["file", "folder"])
def test_a_chosen_library_others_can_write_is_an_error_naming_it(site, tmp_path, monkeypatch, variable, writable):
    chosen = put(tmp_path / "mine" / "libchosen.so")
    refused = {"file": chosen, "folder": chosen.parent}[writable]
    os.chmod(refused, 0o777 if writable == "folder" else 0o666)
    monkeypatch.setenv(variable, str(chosen))
    mode = "777" if writable == "folder" else "666"
    with pytest.raises(RuntimeError, match=f"{variable}={chosen} is not opened: {refused} is writable by group "
                                           rf"and others \(mode {mode}\)"):
        CHOSEN_SEARCH[variable]()
    os.chmod(refused, 0o755)
    assert CHOSEN_SEARCH[variable]()[0] == str(chosen)


def test_nvjpeg_is_looked_for_in_installed_places_in_order(site, tmp_path, monkeypatch):
    wheel = put(site / "nvidia/cu13/lib/libnvjpeg.so.13")
    torchvision_copy = put(site / "torchvision.libs/libnvjpeg.36e11081.so.13")
    torch_copy = put(site / "torch/lib/libnvjpeg.so.13")
    untrusted = put(site / "torchvision.libs/libnvjpeg.0badc0de.so.13")
    os.chmod(untrusted, 0o666)
    chosen = put(tmp_path / "mine" / "libnvjpeg.so.13")
    monkeypatch.setenv("HOTLOOP_NVJPEG", str(chosen))
    monkeypatch.setattr(library_search, "toolkit_lib_dirs", lambda: ["/opt/cuda-x/lib64", "/usr/local/cuda/lib64"])
    expected = [str(chosen), str(wheel), str(torchvision_copy), str(torch_copy),
                "/opt/cuda-x/lib64/libnvjpeg.so.13", "/usr/local/cuda/lib64/libnvjpeg.so.13"]
    assert nvjpeg_library_candidates() == expected  # no bare soname, no current directory, not the writable copy
    search = library_search.nvjpeg_search()
    assert [c.origin for c in search if not c.skipped] == ["HOTLOOP_NVJPEG", "pip nvidia-nvjpeg", "torchvision's copy",
                                                           "torch's copy", "CUDA toolkit", "CUDA toolkit"]
    assert [c.path for c in search if c.skipped] == [str(untrusted)]


def test_the_real_libraries_pass_the_checks():
    """What this machine's pip installed (root's or the user's site-packages) is found and not refused."""
    found = [c for c in nvrtc_finder.nvrtc_candidates(driver_version=None) if c.origin.startswith("pip ")]
    if not found:
        pytest.skip("no NVRTC wheel in site-packages")
    assert [c.skipped for c in found] == [None] * len(found)


@pytest.fixture
def planted_nvrtc(site, planted_library, tmp_path, monkeypatch):
    """The planted library as the only NVRTC of the site folder, its folder writable by all; the mark's path."""
    path = site / "nvidia/cu13/lib/libnvrtc.so.13"
    path.parent.mkdir(parents=True)
    shutil.copy(planted_library, path)
    os.chmod(path.parent, 0o777)
    monkeypatch.setenv("PLANTED_MARK", str(tmp_path / "mark"))
    monkeypatch.setenv("HOTLOOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(nvrtc_finder, "_found", {})
    return path, tmp_path / "mark"


def test_an_nvrtc_others_can_write_is_not_opened_when_found(planted_nvrtc):
    path, mark = planted_nvrtc
    with pytest.raises(RuntimeError, match="no usable NVRTC") as caught:
        nvrtc_finder.find_nvrtc(driver_version=None)
    assert f"{path} (pip nvidia-cuda-nvrtc): NVRTC {path} is not opened: {path.parent} is writable by group and " \
           "others (mode 777)" in str(caught.value)
    assert not mark.exists()
    os.chmod(path.parent, 0o755)  # the same library where no one else can write: opened (and found no NVRTC)
    with pytest.raises(RuntimeError, match="no usable NVRTC"):
        nvrtc_finder.find_nvrtc(driver_version=None)
    assert mark.read_text() == "a planted library was loaded\n"


def test_an_nvrtc_known_from_remembered_facts_is_checked_when_it_is_opened(planted_nvrtc):
    path, mark = planted_nvrtc
    nvrtc_facts.remember(str(path), (13, 0), [80, 90])  # as if it had been opened and asked before
    known = nvrtc_finder.find_nvrtc(driver_version=None)  # a cached start: the library is not opened
    assert known.path == str(path) and not known.opened and known.version == (13, 0)
    with pytest.raises(RuntimeError, match=f"NVRTC {path} is not opened: {path.parent} is writable by group"):
        known.compile(b"", "k.cu", [], True)  # the first compile opens it: refused
    assert not mark.exists()

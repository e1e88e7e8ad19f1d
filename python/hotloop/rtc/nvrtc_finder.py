"""Where NVRTC is, in the order hotloop tries it: $HOTLOOP_NVRTC, then NVIDIA's pip wheels in site-packages
(torch's own dependency) and torch's lib folder, then a conda environment's lib folder and a CUDA toolkit,
installed places only (NOTE [ Library search ]); and the one opened for this process.

Code compiled by an NVRTC newer than the driver may not load: a CUBIN needs a driver of at least its
CUDA major version, PTX one of at least its minor version. So NVRTCs of a newer major than the driver's
CUDA are left out, and one of the driver's own major comes first. Without a driver (a login node
filling the cache) the newest comes first.
"""
import glob
import os
import re
import threading
import typing

from .. import _C
from . import file_trust, library_search, nvrtc_facts

# (path under site-packages, the pip package that installs it), CUDA 13 first
WHEEL_LIBRARIES = (
    ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia-cuda-nvrtc"),
    ("nvidia/cuda_nvrtc/lib/libnvrtc.so.12", "nvidia-cuda-nvrtc-cu12"),
    ("nvidia/cuda_nvrtc/lib/libnvrtc.so.11.2", "nvidia-cuda-nvrtc-cu11"),
)
BUILTINS = "libnvrtc-builtins.so."  # the names NVRTC's folder loads from too (csrc/nvrtc.c): checked with it
INSTALL_HINT = ("install NVRTC with pip: `pip install nvidia-cuda-nvrtc-cu12` for a CUDA 12 torch or driver, "
                "`pip install nvidia-cuda-nvrtc` for CUDA 13; or point HOTLOOP_NVRTC at a libnvrtc.so")


class NvrtcCandidate(typing.NamedTuple):
    path: str
    origin: str  # "HOTLOOP_NVRTC", "pip nvidia-cuda-nvrtc-cu12", "CUDA toolkit"
    major: typing.Optional[int]  # the CUDA major version its file name says; None when it says none
    skipped: typing.Optional[str] = None  # why it is not tried, None when it is


class NvrtcSearch(typing.NamedTuple):
    candidates: list  # NvrtcCandidate, in the order they are tried (skipped ones last)
    looked: list  # every path or pattern looked at, for the message when none is found


def driver_cuda_version():
    """The CUDA version the driver supports (12080 for 12.8), or None without a driver."""
    return _C.cuda_driver_version()


def _major_of(path):
    """libnvrtc.so.12.4.127 -> 12; libnvrtc.so -> the major of the file it links to, or None."""
    for name in (os.path.basename(path), os.path.basename(os.path.realpath(path))):
        match = re.search(r"\.so\.(\d+)", name)
        if match:
            return int(match.group(1))
    return None


def _wheel_candidates(looked):
    found = []
    for folder in library_search.site_packages_dirs():
        for relative, package in WHEEL_LIBRARIES:
            path = os.path.join(folder, relative)
            looked.append(path)
            if os.path.isfile(path):
                found.append(NvrtcCandidate(path, f"pip {package}", _major_of(path)))
        pattern = os.path.join(folder, "torch", "lib", "libnvrtc*.so*")  # a torch that bundles its NVRTC
        if os.path.isdir(os.path.dirname(pattern)):
            looked.append(pattern)
            found += [NvrtcCandidate(path, "torch's copy", _major_of(path)) for path in sorted(glob.glob(pattern))
                      if "builtins" not in os.path.basename(path)]
    return found


def _toolkit_candidates(looked):
    found, seen = [], set()
    environment = library_search.environment_lib_dir()
    folders = ([(environment, "conda environment")] if environment else []) + [
        (folder, "CUDA toolkit") for folder in library_search.toolkit_lib_dirs()]
    for folder, origin in folders:
        pattern = os.path.join(folder, "libnvrtc.so*")
        looked.append(pattern)
        # libnvrtc.so, .so.12 and .so.12.4.127 are one library: its shortest name once
        for path in sorted(glob.glob(pattern), key=len):
            real = os.path.realpath(path)
            if real not in seen and os.path.isfile(path):
                seen.add(real)
                found.append(NvrtcCandidate(path, origin, _major_of(path)))
    return found


def _order_for_driver(candidates, driver_version):
    """(those to try, those skipped): the driver's own major first, then older ones, newest first;
    newer majors skipped. Without a driver: all, newest first."""
    def newest_first(c):
        return -(c.major or 0)

    if driver_version is None:
        return sorted(candidates, key=newest_first), []
    driver_major = driver_version // 1000
    usable = [c for c in candidates if c.major is None or c.major <= driver_major]
    skipped = [c._replace(skipped=f"NVRTC {c.major} is newer than the driver's CUDA "
                          f"{driver_major}.{driver_version % 1000 // 10}")
               for c in candidates if c.major is not None and c.major > driver_major]
    return sorted(usable, key=lambda c: (c.major != driver_major, newest_first(c))), skipped


def nvrtc_search(driver_version=..., checked: bool = True) -> NvrtcSearch:
    """Every NVRTC found, in the order it is tried, and where it was looked for. driver_version: the
    driver's CUDA version (12080) or None for none; by default the driver's, as _C says. checked=False
    leaves NOTE [ Trusted files ] to the caller: find_nvrtc checks a library only as it opens it."""
    if driver_version is ...:
        driver_version = driver_cuda_version()
    # RuntimeError where others can write it, when checked
    chosen = library_search.chosen_path("HOTLOOP_NVRTC", BUILTINS, check=checked)
    if chosen:  # the user's choice, with no fallback: a mistake in it must show
        return NvrtcSearch([NvrtcCandidate(chosen, "HOTLOOP_NVRTC", _major_of(chosen))], ["HOTLOOP_NVRTC=" + chosen])
    looked = ["HOTLOOP_NVRTC (unset)"]
    wheels, toolkits = _wheel_candidates(looked), _toolkit_candidates(looked)
    if checked:
        owners, passed = file_trust.library_owners(), set()
        wheels = [library_search.checked(c, owners, BUILTINS, passed) for c in wheels]
        toolkits = [library_search.checked(c, owners, BUILTINS, passed) for c in toolkits]
    untrusted = [c for c in wheels + toolkits if c.skipped]  # never tried, whatever their version
    wheels, skipped_wheels = _order_for_driver([c for c in wheels if not c.skipped], driver_version)
    toolkits, skipped_toolkits = _order_for_driver([c for c in toolkits if not c.skipped], driver_version)
    return NvrtcSearch(wheels + toolkits + skipped_wheels + skipped_toolkits + untrusted, looked)


def nvrtc_candidates(driver_version=...) -> list:
    """The NVRTCs found, in the order they are tried; those that will not be tried say why (skipped)."""
    return nvrtc_search(driver_version).candidates


_opened = {}  # path -> _C.Nvrtc: a library stays loaded for the life of the process anyway
_opened_lock = threading.Lock()


def open_nvrtc(path) -> "_C.Nvrtc":
    """The NVRTC at `path`, opened once per process; RuntimeError naming the path and why it failed."""
    path = os.fspath(path)
    with _opened_lock:
        if path not in _opened:
            _opened[path] = _C.Nvrtc(path)
        return _opened[path]


def open_trusted_nvrtc(path) -> "_C.Nvrtc":
    """open_nvrtc(path) where the library and its builtins pass NOTE [ Trusted files ]; else RuntimeError
    saying which check failed. The check is made here, as the library is opened, so that a cached start
    (which never opens NVRTC: NOTE [ Remembered NVRTC facts ]) does not pay for it."""
    why = library_search.refusal(path, companions=BUILTINS)
    if why:
        raise RuntimeError(f"NVRTC {path} is not opened: {why}. A library someone else could have written is "
                           "never opened (NOTE [ Trusted files ] in hotloop/rtc/file_trust.py)")
    return open_nvrtc(path)


def find_nvrtc(driver_version=...) -> "nvrtc_facts.KnownNvrtc":
    """The first NVRTC of the search that opens (or opened before: see NOTE [ Remembered NVRTC facts ],
    it is then opened at its first compile), found once per process. RuntimeError naming
    HOTLOOP_NVRTC when it is set and unusable; naming every place looked, and how to install NVRTC,
    when none opens."""
    if driver_version is ...:
        driver_version = driver_cuda_version()
    key = (os.environ.get("HOTLOOP_NVRTC"), driver_version)
    if key not in _found:
        _found[key] = _first_that_opens(nvrtc_search(driver_version, checked=False))
    return _found[key]


_found = {}  # (HOTLOOP_NVRTC, driver version) -> the KnownNvrtc found for it; failures are not kept


def _first_that_opens(search):
    """The first candidate known from its remembered facts, or that passes NOTE [ Trusted files ] and opens
    (open_trusted_nvrtc checks each as it opens it)."""
    tried = []
    for candidate in search.candidates:
        if candidate.skipped:
            continue
        try:
            return nvrtc_facts.known_nvrtc(candidate.path, open_trusted_nvrtc)
        except RuntimeError as exc:
            if candidate.origin == "HOTLOOP_NVRTC":
                raise RuntimeError(f"HOTLOOP_NVRTC={candidate.path} is not a usable NVRTC library: {exc}") from exc
            tried.append(f"  {candidate.path} ({candidate.origin}): {exc}")
    lines = ["no usable NVRTC (CUDA's run-time compiler, which compiles hotloop's kernels) was found"]
    if tried:
        lines += ["these failed to open:"] + tried
    skipped = [f"  {c.path} ({c.origin}): {c.skipped}" for c in search.candidates if c.skipped]
    if skipped:
        lines += ["these were left out:"] + skipped
    lines += ["looked at:"] + [f"  {place}" for place in search.looked]
    lines.append(INSTALL_HINT)
    raise RuntimeError("\n".join(lines))

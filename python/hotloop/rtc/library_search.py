"""Where hotloop looks for the CUDA libraries it opens by path (NVRTC, nvjpeg): installed places only, each
file checked before it is opened.

NOTE [ Library search ]
A library that is dlopen'ed runs its constructors on the host, so it is looked for only where software
is installed: at the path its HOTLOOP_* variable names (the user's choice, with no fallback for NVRTC),
then in this Python's site-packages folders (the venv's, the system's, the user's: where pip puts
NVIDIA's wheels), beside the torch this process imported and in torch's own lib folder, then in the
environment's lib folder (conda's) and a CUDA toolkit ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda,
/usr/local/cuda-*). Never on sys.path as such: under `python -m` and `python -c` it begins with '' (the
current directory), where anyone who can write the directory one runs in could plant
nvidia/cu13/lib/libnvrtc.so.13. Never by a bare name either, which the dynamic linker resolves through
LD_LIBRARY_PATH (where an empty entry is the current directory). Every file found must pass
NOTE [ Trusted files ] (file_trust.library_refusal) before it is opened; one that does not is listed as
skipped, with why, and a HOTLOOP_* path that does not is an error.

The CUDA driver (libcuda.so.1) and NVML (libnvidia-ml.so.1) are opened by soname from the dynamic
linker's own folders: the driver installs them there, torch opens the same sonames in the same process,
and a check of hotloop's would close nothing that torch's own load leaves open. Their HOTLOOP_LIBCUDA
and HOTLOOP_NVML_LIBRARY variables (tests' fakes) are the user's own choice; `hotloop doctor` warns
when others can write the file one names.
"""
import glob
import os
import re
import site
import sys
import typing

from . import file_trust

NVJPEG_SONAME = "libnvjpeg.so.13"  # the CUDA 13 library: hotloop's CUDA runtime is 13


class LibraryCandidate(typing.NamedTuple):
    path: str
    origin: str  # "HOTLOOP_NVJPEG", "pip nvidia-nvjpeg", "torchvision's copy", "CUDA toolkit"
    skipped: typing.Optional[str] = None  # why it is not opened, None when it may be


def site_packages_dirs() -> list:
    """This Python's site-packages folders (the venv's, the system's where the venv includes them, the
    user's), then the folder the torch this process imported lives in when it is none of those (never
    the current directory): each existing one once, in that order. torch is never imported here."""
    dirs = []
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # a virtualenv's old site.py lacks it
        pass
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    torch = sys.modules.get("torch")
    for folder in getattr(torch, "__path__", None) or []:
        parent = os.path.dirname(os.path.abspath(folder))
        if parent != os.getcwd():
            dirs.append(parent)
    return _existing_once(dirs)


def toolkit_lib_dirs() -> list:
    """$CUDA_HOME/lib64, $CUDA_PATH/lib64, /usr/local/cuda/lib64, then /usr/local/cuda-*/lib64, newest first."""
    dirs = [os.path.join(os.environ[v], "lib64") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    dirs.append("/usr/local/cuda/lib64")

    def version(path):  # /usr/local/cuda-12.4/lib64 -> (12, 4): the newest first
        return tuple(int(x) for x in re.findall(r"\d+", os.path.basename(os.path.dirname(path))))

    dirs += sorted(glob.glob("/usr/local/cuda-*/lib64"), key=version, reverse=True)
    return list(dict.fromkeys(dirs))


def environment_lib_dir():
    """<sys.prefix>/lib when this Python is a conda environment's (conda-meta beside it), else None."""
    if os.path.isdir(os.path.join(sys.prefix, "conda-meta")):
        return os.path.join(sys.prefix, "lib")
    return None


def _existing_once(dirs):
    seen, result = set(), []
    for d in dirs:
        if not d or not os.path.isabs(d):  # '' and relative entries mean the current directory
            continue
        d = os.path.normpath(d)
        if d not in seen and os.path.isdir(d):
            seen.add(d)
            result.append(d)
    return result


def refusal(path, owners=None, companions=None, passed=None):
    """file_trust.library_refusal of `path` and of the files beside it (or beside the file it links to)
    whose names begin with `companions`, which the library loads too (NVRTC's builtins). `passed`: the
    folders found good so far, shared across a search."""
    owners = file_trust.library_owners() if owners is None else owners
    passed = set() if passed is None else passed
    why = file_trust.library_refusal(path, owners, passed)
    if why or not companions:
        return why
    path = os.path.abspath(path)
    for folder in dict.fromkeys((os.path.dirname(path), os.path.dirname(file_trust.real_path(path)))):
        try:
            names = sorted(n for n in os.listdir(folder) if n.startswith(companions))
        except OSError:
            continue
        for name in names:
            why = file_trust.library_refusal(os.path.join(folder, name), owners, passed)
            if why:
                return why
    return None


def checked(candidate, owners=None, companions=None, passed=None):
    """`candidate` (a NamedTuple with `path` and `skipped`) with skipped set where it, or a file beside it
    whose name begins with `companions`, fails NOTE [ Trusted files ]."""
    if candidate.skipped:
        return candidate
    why = refusal(candidate.path, owners, companions, passed)
    return candidate._replace(skipped=f"not opened: {why}") if why else candidate


def chosen_path(variable: str, companions=None, check=True):
    """The absolute path $`variable` names, or None when unset. RuntimeError when it (or a file beside it
    whose name begins with `companions`) fails NOTE [ Trusted files ]: a library the user chose is never
    replaced by another without saying so. check=False leaves that check to the caller."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return None
    path = os.path.abspath(value)
    why = refusal(path, companions=companions) if check else None
    if why:
        raise RuntimeError(f"{variable}={value} is not opened: {why}. Only a library no one else can write is "
                           "opened (NOTE [ Trusted files ] in hotloop/rtc/file_trust.py): chmod go-w it and its "
                           f"folder, or copy it to a folder of your own and point {variable} there")
    return path


def nvjpeg_search() -> list:
    """Every nvjpeg found, as LibraryCandidate in the order tried (see NOTE [ Library search ]): those that
    fail NOTE [ Trusted files ] say why (skipped). The toolkit's paths are listed even where absent, so
    that a failure to open names them. RuntimeError when HOTLOOP_NVJPEG names a file refused."""
    found = []
    chosen = chosen_path("HOTLOOP_NVJPEG")
    if chosen:
        found.append(LibraryCandidate(chosen, "HOTLOOP_NVJPEG"))
    for folder in site_packages_dirs():
        wheel = os.path.join(folder, "nvidia", "cu13", "lib", NVJPEG_SONAME)
        if os.path.isfile(wheel):
            found.append(LibraryCandidate(wheel, "pip nvidia-nvjpeg"))
        # auditwheel renames bundled libraries with a hash: libnvjpeg.36e11081.so.13
        for copy in sorted(glob.glob(os.path.join(folder, "torchvision.libs", "libnvjpeg*.so*"))):
            found.append(LibraryCandidate(copy, "torchvision's copy"))
        for copy in sorted(glob.glob(os.path.join(folder, "torch", "lib", "libnvjpeg*.so*"))):
            found.append(LibraryCandidate(copy, "torch's copy"))
    environment = environment_lib_dir()
    if environment and os.path.isfile(os.path.join(environment, NVJPEG_SONAME)):
        found.append(LibraryCandidate(os.path.join(environment, NVJPEG_SONAME), "conda environment"))
    found += [LibraryCandidate(os.path.join(folder, NVJPEG_SONAME), "CUDA toolkit") for folder in toolkit_lib_dirs()]
    seen, result, owners, passed = set(), [], file_trust.library_owners(), set()
    for c in found:
        if c.path not in seen:
            seen.add(c.path)  # HOTLOOP_NVJPEG was checked above
            result.append(c if c.origin == "HOTLOOP_NVJPEG" else checked(c, owners, passed=passed))
    return result

"""The CUDA sources NVRTC compiles: where the kernels folder is, which sources C launches from, their bytes
and the options they are compiled with."""
import functools
import hashlib
import os
import pathlib

from .. import _C

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
HEADER_SUFFIXES = (".h", ".cuh")


def kernels_dir() -> pathlib.Path:
    """The kernels folder: installed as package data (hotloop/kernels/), or the source checkout's
    kernels/ when hotloop runs from python/ of a checkout."""
    for folder in (PACKAGE_DIR / "kernels", PACKAGE_DIR.parent.parent / "kernels"):
        if any(folder.glob("*.cu")):
            return folder
    raise RuntimeError(f"hotloop's CUDA sources are missing: no *.cu in {PACKAGE_DIR / 'kernels'} (an "
                       f"installed hotloop) nor in {PACKAGE_DIR.parent.parent / 'kernels'} (a source checkout); "
                       "reinstall hotloop")


def source_names() -> tuple:
    """The base names of the sources C loads kernels from ("amp", "optim", ...), as C lists them."""
    return tuple(_C.KERNEL_SOURCES)


def source_path(name: str, folder: pathlib.Path = None) -> pathlib.Path:
    path = (folder or kernels_dir()) / f"{name}.cu"
    if not path.is_file():
        raise ValueError(f"no kernel source {name!r}: {path} does not exist")
    return path


@functools.lru_cache(maxsize=None)
def headers_digest(folder: pathlib.Path) -> bytes:
    """sha256 over the name and bytes of every header of the folder, in sorted order: a source may
    include any of them, so a change to one changes every source's cache key. Read once per process."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.suffix in HEADER_SUFFIXES):
        data = path.read_bytes()
        digest.update(f"{path.name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.digest()


def compile_options(arch: int, cubin: bool, folder: pathlib.Path) -> list:
    """NVRTC's options for one target; the include path comes last (the cache key leaves it out).
    --fmad=true is nvcc's default, which the kernels rely on to match torch bit for bit."""
    target = f"-arch=sm_{arch}" if cubin else f"-arch=compute_{arch}"
    return ["-std=c++17", target, "--fmad=true", "-I" + os.fspath(folder)]


def options_for_key(options: list) -> list:
    """The options that decide the image: all but the include path, which differs between installs."""
    return [o for o in options if not o.startswith("-I")]

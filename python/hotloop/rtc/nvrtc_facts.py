"""An NVRTC known by what it said of itself (version, architectures), remembered in the cache folder, so
that a process whose kernels are all cached never opens NVRTC: the library is opened at its first compile.

NOTE [ Remembered NVRTC facts ]
Opening NVRTC (dlopen of a library of ~100 MB and its builtins) costs milliseconds that a cached start
should not pay: a cache look-up needs only the NVRTC's version (part of every key) and the
architectures it compiles for (which decide CUBIN or PTX). Those are kept beside the kernel images in
one small file per library path, valid while the library's size and modification time are those it
was read with: an upgraded or replaced library is opened and asked again. Files are read and written
as kernel images are (NOTE [ Kernel cache files ]); one that cannot be read, parsed or trusted counts
as none.
"""
import hashlib
import json
import os

from . import cache_files, file_trust, kernel_cache


def _facts_name(library_path: str) -> str:
    digest = hashlib.sha256(os.fsencode(os.path.abspath(library_path))).hexdigest()[:24]
    return f"nvrtc.{digest}.json"


def _stamp(library_path: str):
    """(size, modification time in ns) of the library, or None when it cannot be stat'ed."""
    try:
        st = os.stat(library_path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def remembered(library_path: str):
    """{"version": [major, minor], "archs": [...]} as this library said it last time, or None when it
    was never asked, has changed since, or the record cannot be read."""
    stamp = _stamp(library_path)
    if stamp is None:
        return None
    folder = os.fspath(kernel_cache.cache_folder())
    try:  # read as kernel images are: NOTE [ Trusted files ]
        owners = file_trust.trusted_owners()
        with cache_files.opened_folder(folder, owners) as folder_fd:
            facts = json.loads(cache_files.read_file(folder_fd, _facts_name(library_path), owners, folder))
    except (OSError, ValueError, cache_files.Refused):
        return None
    if (not isinstance(facts, dict) or facts.get("path") != os.path.abspath(library_path)
            or facts.get("stamp") != stamp):
        return None
    version, archs = facts.get("version"), facts.get("archs")
    if not (isinstance(version, list) and len(version) == 2 and isinstance(archs, list) and archs
            and all(isinstance(x, int) for x in version + archs)):
        return None
    return {"version": version, "archs": archs}


def remember(library_path: str, version, archs) -> None:
    """Keep what the opened library said; silently nothing where the cache folder cannot be written
    (the kernel cache warns about that folder itself)."""
    stamp = _stamp(library_path)
    if stamp is None:
        return
    record = {"path": os.path.abspath(library_path), "stamp": stamp, "version": list(version), "archs": list(archs)}
    folder = os.fspath(kernel_cache.cache_folder())
    try:  # written as kernel images are: NOTE [ Kernel cache files ]
        cache_files.make_folder(folder)
        with cache_files.opened_folder(folder, file_trust.trusted_owners()) as folder_fd:
            cache_files.write_file(folder_fd, _facts_name(library_path), json.dumps(record).encode())
    except (OSError, cache_files.Refused):
        pass


class KnownNvrtc:
    """An NVRTC library by its path, version and architectures, with the same `path`, `version`,
    `supported_archs()` and `compile()` as _C.Nvrtc; the library is opened (by `opener`) at the first
    compile only."""

    def __init__(self, path: str, version, archs, opener, opened=None):
        self.path = path
        self.version = tuple(version)
        self._archs = list(archs)
        self._opener = opener
        self._opened = opened

    def supported_archs(self) -> list:
        return list(self._archs)

    @property
    def opened(self) -> bool:
        """Whether the library itself has been opened in this process."""
        return self._opened is not None

    def library(self):
        """The opened _C.Nvrtc, opened now if it was not."""
        if self._opened is None:
            self._opened = self._opener(self.path)
        return self._opened

    def compile(self, *args, **kwargs):
        return self.library().compile(*args, **kwargs)

    def __repr__(self):
        return f"KnownNvrtc({self.path!r}, version={self.version}, opened={self.opened})"


def known_nvrtc(path: str, opener) -> KnownNvrtc:
    """The NVRTC at `path` from its remembered facts, unopened; else opened by `opener` now, asked, and
    remembered. Opening errors propagate (RuntimeError from _C.Nvrtc)."""
    facts = remembered(path)
    if facts is not None:
        return KnownNvrtc(path, facts["version"], facts["archs"], opener)
    library = opener(path)
    archs = library.supported_archs()
    remember(path, library.version, archs)
    return KnownNvrtc(path, library.version, archs, opener, opened=library)

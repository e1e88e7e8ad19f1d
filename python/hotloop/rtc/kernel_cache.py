"""The kernel cache: images NVRTC made, on disk under $HOTLOOP_CACHE_DIR (else $XDG_CACHE_HOME/hotloop,
else ~/.cache/hotloop) and in memory for this process.

NOTE [ Kernel cache files ]
An entry is one file: a header (magic, format version, payload length, sha256 of the payload), then the
payload. A writer writes a new temporary file of a random name in the same folder (O_EXCL, O_NOFOLLOW,
mode 0600), fsyncs it and renames it into place, so a reader sees a whole entry or none, processes that
store the same entry at once (DDP ranks, DataLoader workers) each leave a whole, good one, and a link
planted at any name is never followed. A file whose header or checksum is wrong is never returned:
the caller compiles again and the entry is overwritten. Processes compiling at once take a lock on
the folder around the look-up and the compile, so that one compiles and the others read its entry.
The folder is made 0700. Nothing is read from a folder, nor an entry, that fails NOTE [ Trusted files ]
(the checksum says an entry is whole, not who wrote it): the kernel is compiled into memory, with one
warning that says which check failed and how to mend it. A folder that cannot be created or written
leaves the kernels it lacks in memory, with one warning; what it holds is still read (a shared
read-only cache, docs/building.md).
"""
import contextlib
import hashlib
import logging
import os
import pathlib
import struct
import threading
import warnings

from . import cache_files, file_trust

_logger = logging.getLogger(__name__)

MAGIC = b"HLKC"  # hotloop kernel cache
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sIQ32s")  # magic, format version, payload length, sha256 of the payload


def cache_root() -> pathlib.Path:
    """$HOTLOOP_CACHE_DIR, else $XDG_CACHE_HOME/hotloop, else ~/.cache/hotloop."""
    if os.environ.get("HOTLOOP_CACHE_DIR"):
        return pathlib.Path(os.environ["HOTLOOP_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(os.environ["XDG_CACHE_HOME"]) / "hotloop"
    return pathlib.Path.home() / ".cache" / "hotloop"


def cache_folder() -> pathlib.Path:
    """Where kernel images are kept."""
    return cache_root() / "kernels"


def cache_key(source_name, source_bytes, headers_digest, nvrtc_version, arch, cubin, options) -> str:
    """sha256 (hex) of everything that decides an image: the source's name and bytes, its headers'
    digest, NVRTC's version, the architecture, CUBIN or PTX, and the options (without the include path)."""
    digest = hashlib.sha256()
    for part in (source_name, source_bytes, headers_digest, "%d.%d" % tuple(nvrtc_version), str(arch),
                 "cubin" if cubin else "ptx", "\0".join(options)):
        data = part.encode() if isinstance(part, str) else bytes(part)
        digest.update(struct.pack("<Q", len(data)))  # length-prefixed: no two part lists hash alike
        digest.update(data)
    return digest.hexdigest()


def entry_name(source_name, arch, cubin, key) -> str:
    """amp.sm_90.<key>.cubin, amp.compute_90.<key>.ptx: a person listing the folder sees what is there."""
    return f"{source_name}.{'sm' if cubin else 'compute'}_{arch}.{key}.{'cubin' if cubin else 'ptx'}"


def pack(payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def unpack(data: bytes):
    """The payload of a whole, good entry; None for anything else (short, foreign, damaged)."""
    if len(data) < HEADER.size:
        return None
    magic, version, length, checksum = HEADER.unpack_from(data)
    payload = data[HEADER.size:]
    if magic != MAGIC or version != FORMAT_VERSION or length != len(payload) or length == 0:
        return None
    if hashlib.sha256(payload).digest() != checksum:
        return None
    return payload


_warned = set()  # (folder, kind, cause): each trouble with a folder is said once per process


class KernelCache:
    """Images by key, in memory for this process and in `folder` on disk where it passes NOTE [ Trusted
    files ] (read) and can be written (stored)."""

    def __init__(self, folder: pathlib.Path):
        self.folder = pathlib.Path(folder)
        self.memory = {}  # key -> payload: a second device or call does not read the disk again
        self.disk_error = None  # why nothing is read from the folder or written to it, once found out
        self.read_only = None  # why nothing is written to it (a shared read-only cache, a full disk)
        self._lock = threading.Lock()  # one compile of an entry at a time in this process

    def path(self, name: str) -> pathlib.Path:
        return self.folder / name

    def lookup(self, name: str, key: str):
        """The payload kept under (name, key), or None; a damaged or untrusted file counts as none."""
        payload = self.memory.get(key)
        if payload is not None or self.disk_error is not None:
            return payload
        with self._opened_folder(create=False) as folder_fd:
            if folder_fd is None:
                return None
            try:
                data = cache_files.read_file(folder_fd, name, file_trust.trusted_owners(), self.path(name))
            except FileNotFoundError:
                return None
            except cache_files.Refused as refused:
                self._warn_once(("entry", refused.why), f"hotloop's kernel cache entry {refused}: it is not loaded, "
                                f"and the kernel is compiled again. {_ENTRY_FIX}")
                return None
            except OSError as exc:
                _logger.warning("kernel cache: cannot read %s (%s); compiling it again", self.path(name), exc)
                return None
        payload = unpack(data)
        if payload is None:
            _logger.warning("kernel cache: %s is damaged (bad header, length or checksum); compiling it again",
                            self.path(name))
            return None
        self.memory[key] = payload
        return payload

    def store(self, name: str, key: str, payload: bytes) -> None:
        """Keep `payload` in memory, and on disk where the folder can be used and written (else warn once)."""
        self.memory[key] = payload
        if self.disk_error is not None or self.read_only is not None:
            return
        with self._opened_folder(create=True) as folder_fd:
            if folder_fd is None:
                return
            try:
                cache_files.write_file(folder_fd, name, pack(payload))  # see NOTE [ Kernel cache files ]
            except OSError as exc:
                self._cannot_write(exc)

    def get_or_make(self, name: str, key: str, make):
        """(payload, True) when it was kept; else (make(), False), stored. `make` runs at most once
        per entry at a time, across threads and, through a lock on the folder, processes."""
        payload = self.lookup(name, key)
        if payload is not None:
            return payload, True
        with self._lock, self._folder_lock():
            payload = self.lookup(name, key)  # made meanwhile by another thread or process
            if payload is not None:
                return payload, True
            payload = make()
            self.store(name, key, payload)
            return payload, False

    @contextlib.contextmanager
    def _opened_folder(self, create: bool):
        """The folder's descriptor, checked (NOTE [ Trusted files ]), made first when `create`; None where
        there is none yet, or it is refused or unusable (then the folder is not used again, with a warning)."""
        fd = None
        if self.disk_error is None:
            try:
                if create:
                    cache_files.make_folder(os.fspath(self.folder))
                fd = cache_files.open_folder(os.fspath(self.folder), file_trust.trusted_owners())
            except cache_files.Refused as refused:
                self._refuse(str(refused), folder_fix(self.folder, refused.why))
            except OSError as exc:
                if create or not isinstance(exc, FileNotFoundError):  # none yet: nothing to read, nothing wrong
                    self._refuse(f"{self.folder} cannot be used ({exc})", OWN_FOLDER)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    @contextlib.contextmanager
    def _folder_lock(self):
        """An exclusive lock on <folder>/.lock, released by close or by the process's end; none when
        the folder cannot be written (the cache is then this process's memory alone)."""
        lock_fd = None
        if self.read_only is None:
            with self._opened_folder(create=True) as folder_fd:
                if folder_fd is not None:
                    try:
                        lock_fd = cache_files.open_lock(folder_fd)
                    except OSError as exc:
                        self._cannot_write(exc)
        try:
            if lock_fd is not None:
                import fcntl  # POSIX only, and only needed here

                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            yield
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def _refuse(self, what: str, fix: str):
        self.disk_error = what
        self._warn_once(("folder", what), f"hotloop's kernel cache folder {what}: nothing is loaded from it or "
                        f"stored in it, and kernels are compiled into memory for this process only. {fix}".rstrip())

    def _cannot_write(self, exc):
        self.read_only = exc
        self._warn_once(("write",), f"hotloop's kernel cache folder {self.folder} cannot be written ({exc}); kernels "
                        f"not already in it are compiled into memory for this process only. {OWN_FOLDER}")

    def _warn_once(self, what: tuple, message):
        """Warn of `what` (a kind of trouble and its cause) once per folder and process."""
        if (self.folder,) + what not in _warned:
            _warned.add((self.folder,) + what)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


OWN_FOLDER = "Set HOTLOOP_CACHE_DIR to a folder of your own on a local disk."
_ENTRY_FIX = ("Only you should be able to write your cache folder: check who can (ls -la on it) and remove "
              "files you did not make; the entry is replaced by the kernel compiled now where the folder "
              "can be written.")


def folder_fix(folder, why: str) -> str:
    """How to make a refused folder usable, for each check it failed."""
    fixes = []
    if "is writable by" in why:
        fixes.append(f"Make it yours alone (chmod 700 {folder}; a shared cache's owner: chmod -R go-w), or set "
                     "HOTLOOP_CACHE_DIR to a folder of your own on a local disk (some network filesystems show "
                     "every file as writable by all).")
    if "is owned by" in why:
        fixes.append("Set HOTLOOP_CACHE_DIR to a folder of your own; or, for a read-only cache an administrator "
                     f"filled (docs/building.md), trust its owner with {file_trust.TRUSTED_OWNERS_VARIABLE}.")
    return " ".join(fixes) or "Replace it with a folder, or set HOTLOOP_CACHE_DIR to a folder of your own."

"""The kernel cache: images NVRTC made, on disk under $HOTLOOP_CACHE_DIR (else $XDG_CACHE_HOME/hotloop,
else ~/.cache/hotloop) and in memory for this process.

NOTE [ Kernel cache files ]
An entry is one file: a header (magic, format version, payload length, sha256 of the payload), then the
payload. A writer writes a temporary file in the same folder and renames it into place, so a reader
sees a whole entry or none, and processes that store the same entry at once (DDP ranks, DataLoader
workers) each leave a whole, good one. A file whose header or checksum is wrong is never returned:
the caller compiles again and the entry is overwritten. Processes compiling at once take a lock on
the folder around the look-up and the compile, so that one compiles and the others read its entry.
A folder that cannot be created or written leaves the cache in memory, with one warning.
"""
import contextlib
import hashlib
import logging
import os
import pathlib
import struct
import threading
import warnings

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


_warned_folders = set()  # a folder that cannot be written is said once per process


class KernelCache:
    """Images by key, in memory for this process and in `folder` on disk when it can be written."""

    def __init__(self, folder: pathlib.Path):
        self.folder = pathlib.Path(folder)
        self.memory = {}  # key -> payload: a second device or call does not read the disk again
        self.disk_error = None  # why the folder cannot be used, once found out
        self._lock = threading.Lock()  # one compile of an entry at a time in this process

    def path(self, name: str) -> pathlib.Path:
        return self.folder / name

    def lookup(self, name: str, key: str):
        """The payload kept under (name, key), or None; a damaged file counts as none."""
        payload = self.memory.get(key)
        if payload is not None or self.disk_error is not None:
            return payload
        try:
            data = self.path(name).read_bytes()
        except FileNotFoundError:
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
        """Keep `payload` in memory, and on disk unless the folder cannot be written (then warn once)."""
        self.memory[key] = payload
        if self.disk_error is not None:
            return
        temporary = self.path(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as f:
                f.write(pack(payload))
            os.replace(temporary, self.path(name))  # atomic: see NOTE [ Kernel cache files ]
        except OSError as exc:
            self._disk_failed(exc)
            try:
                temporary.unlink()
            except OSError:
                pass

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
    def _folder_lock(self):
        """An exclusive lock on <folder>/.lock, released by close or by the process's end; none when
        the folder cannot be written (the cache is then this process's memory alone)."""
        fd = None
        if self.disk_error is None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path(".lock"), os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                self._disk_failed(exc)
        try:
            if fd is not None:
                import fcntl  # POSIX only, and only needed here

                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            if fd is not None:
                os.close(fd)

    def _disk_failed(self, exc):
        self.disk_error = exc
        if self.folder not in _warned_folders:
            _warned_folders.add(self.folder)
            warnings.warn(f"hotloop's kernel cache folder {self.folder} cannot be used ({exc}); kernels are "
                          "compiled into memory for this process only (set HOTLOOP_CACHE_DIR to a writable folder)",
                          RuntimeWarning, stacklevel=2)

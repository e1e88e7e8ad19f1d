"""The cache folder's files at the level of the operating system: the folder made 0700, opened and read only
where it and the file pass NOTE [ Trusted files ], written so that a link planted at any name is never
followed, and the folder's lock.

Every call takes the folder's descriptor (open_folder), so a name is always looked up in the folder that
was checked, never through a path that may have changed since.
"""
import contextlib
import errno
import os
import secrets

from . import file_trust

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """A cache folder or file that fails NOTE [ Trusted files ]: `path` and `why` (a phrase after it)."""

    def __init__(self, path, why):
        super().__init__(f"{path} {why}")
        self.path, self.why = path, why


def make_folder(folder) -> None:
    """Create `folder` and each missing folder above it with mode 0700; an existing one is left as it is."""
    missing = []
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        missing.append(folder)
        folder = os.path.dirname(folder)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made meanwhile by another process; a file there fails at open_folder
            pass


def open_folder(folder, owners) -> int:
    """A descriptor of `folder` (the caller closes it), which passed NOTE [ Trusted files ]. Refused when
    it fails them; FileNotFoundError when there is none; OSError when it cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as exc:
        # O_NOFOLLOW met a link: ELOOP, or ENOTDIR where O_DIRECTORY is checked first
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(folder):
            raise Refused(folder, "is a symbolic link, not a folder") from exc
        raise
    try:
        why = file_trust.refusal(os.fstat(fd), True, owners)
    except OSError:
        os.close(fd)
        raise
    if why:
        os.close(fd)
        raise Refused(folder, why)
    return fd


@contextlib.contextmanager
def opened_folder(folder, owners):
    """open_folder(folder, owners) for a `with` block, closed at its end."""
    fd = open_folder(folder, owners)
    try:
        yield fd
    finally:
        os.close(fd)


def read_file(folder_fd: int, name: str, owners, path_for_messages) -> bytes:
    """The bytes of `name` in the folder, which passed NOTE [ Trusted files ]. Refused when it fails
    them (a link, a fifo, another's file); FileNotFoundError when there is none."""
    try:
        # O_NONBLOCK: a fifo planted at the name is refused below instead of blocking the open
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=folder_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(path_for_messages, "is a symbolic link") from exc
        raise
    try:
        st = os.fstat(fd)
        why = file_trust.refusal(st, False, owners)
        if why:
            raise Refused(path_for_messages, why)
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def temporary_name(name: str) -> str:
    """A fresh name beside `name` for its temporary file: random, so none can be prepared for it."""
    return f".{name}.{secrets.token_hex(8)}.tmp"


def write_file(folder_fd: int, name: str, data: bytes) -> None:
    """Put `data` at `name` whole: a new temporary file (O_EXCL | O_NOFOLLOW, mode 0600: whatever is
    already at its name, a planted link included, makes the open fail and another name is drawn),
    written, fsync'ed and renamed over `name`, which replaces a link there instead of following it."""
    for _ in range(100):
        temporary = temporary_name(name)
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=folder_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name for {name} in 100 tries")
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except BaseException:
        try:
            os.unlink(temporary, dir_fd=folder_fd)
        except OSError:
            pass
        raise


def open_lock(folder_fd: int) -> int:
    """A descriptor of the folder's lock file `.lock`, created 0600; a link at that name is not
    followed (ELOOP)."""
    return os.open(".lock", os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600, dir_fd=folder_fd)

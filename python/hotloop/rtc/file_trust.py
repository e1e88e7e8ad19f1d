"""Whose files hotloop loads code from: the owner and mode checks that a kernel cache entry, its folder and
a library must pass before they are read or opened.

NOTE [ Trusted files ]
A kernel image runs in the user's CUDA context, beside the model's weights, gradients and data; a
library that is dlopen'ed runs its constructors on the host. Either is taken only from a file that no
one but the user, or an owner the user trusts, can have written:
- a file is a regular file and a folder a folder (not a link, a fifo, a device);
- its owner is the user, or one named in HOTLOOP_CACHE_TRUSTED_OWNERS (root when unset; a library
  may also be owned by whoever owns the Python installation, who already wrote every module imported);
- it is not writable by group or others. A POSIX ACL that lets another user write shows here too: the
  mode's group bits then carry the ACL's mask.
The cache's checks read an fstat of the descriptor that is then read (opened with O_NOFOLLOW), so what
is checked is what is loaded. A library's path is checked from the file up to /, since a folder above
it that others can write lets them swap what the path names (a sticky folder such as /tmp does not:
there only an entry's owner may move it). A checksum in a cache entry proves it is whole, not who
wrote it. A filesystem without Unix ownership (some network mounts show every file as one user's,
writable by all) fails the checks: the cache then stays in memory, with a warning that says so.
"""
import functools
import os
import stat
import sys

TRUSTED_OWNERS_VARIABLE = "HOTLOOP_CACHE_TRUSTED_OWNERS"


def trusted_owners() -> frozenset:
    """The uids whose cache files are read: this process's user, and those HOTLOOP_CACHE_TRUSTED_OWNERS
    names (comma-separated user names or uids; root when unset). ValueError for a name of no user."""
    return _owners_named(os.environ.get(TRUSTED_OWNERS_VARIABLE)) | {os.geteuid()}


@functools.lru_cache(maxsize=8)
def _owners_named(text) -> frozenset:
    if text is None:
        return frozenset({0})  # root is uid 0: no user database (NSS, possibly remote) is asked
    uids = set()
    for name in (part.strip() for part in text.split(",")):
        if name.isdigit():
            uids.add(int(name))
        elif name:
            import pwd

            try:
                uids.add(pwd.getpwnam(name).pw_uid)
            except KeyError:
                raise ValueError(f"{TRUSTED_OWNERS_VARIABLE}={text!r} names {name!r}, which is no user on this "
                                 "machine: expected comma-separated user names or uids") from None
    return frozenset(uids)


def library_owners() -> frozenset:
    """The uids whose libraries are opened: trusted_owners() and the owners of the Python installation
    this process runs (sys.prefix, sys.base_prefix), whose code is running already."""
    owners = set(trusted_owners())
    for prefix in {sys.prefix, sys.base_prefix}:
        try:
            owners.add(os.stat(prefix).st_uid)
        except OSError:
            pass
    return frozenset(owners)


def user_name(uid: int) -> str:
    """'nobody (uid 65534)', or the uid alone where no user has it."""
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def refusal(st: os.stat_result, folder: bool, owners: frozenset):
    """Why a file (folder=False) or folder of status `st` must not be trusted, as a phrase that follows
    its path ("is writable by group and others (mode 777)"), every check that failed; None when it
    passes NOTE [ Trusted files ]."""
    if not (stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)):
        return "is not a folder" if folder else "is not a regular file"
    failed = []
    if st.st_uid not in owners:
        failed.append(f"is owned by {user_name(st.st_uid)}: neither you ({user_name(os.geteuid())}) nor an owner "
                      f"{TRUSTED_OWNERS_VARIABLE} trusts")
    writers = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writers:
        failed.append(f"is writable by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):o})")
    return ", and ".join(failed) or None


def library_refusal(path, owners: frozenset = None, passed: set = None):
    """Why the library at `path` must not be opened, as "<path> <phrase>"; None when the file (after its
    links) and every folder above it, and above the link itself, pass NOTE [ Trusted files ]. A path
    that does not exist is refused only for its folders: opening it then fails on its own. `passed`: a
    set of folders already found good, which a search shares across its files (and adds to)."""
    owners = library_owners() if owners is None else owners
    passed = set() if passed is None else passed
    path = os.path.abspath(os.fspath(path))
    try:
        real, st = _resolved(path)
    except FileNotFoundError:
        real = os.path.realpath(path)
    except OSError as exc:
        return f"{path} cannot be checked ({exc.strerror})"
    else:
        why = refusal(st, False, owners)
        if why:
            return f"{real} {why}"
    folders = _folders_up(os.path.dirname(real))
    if real != path:  # the folder the link itself lies in, and those above it
        folders += _folders_up(os.path.realpath(os.path.dirname(path)))
    for folder in folders:
        if folder in passed:
            continue
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{folder} cannot be checked ({exc.strerror})"
        sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_uid in owners
        why = None if sticky else refusal(st, True, owners)  # sticky: others' entries there cannot replace ours
        if why:
            return f"{folder} {why}"
        passed.add(folder)
    return None


def real_path(path) -> str:
    """os.path.realpath(path), resolved by the kernel in one call where the file exists."""
    try:
        return _resolved(path)[0]
    except OSError:
        return os.path.realpath(path)


def _resolved(path):
    """(the path `path` resolves to, its status), from one descriptor: the kernel resolves the links at
    once, where os.path.realpath would lstat each part of the path."""
    fd = os.open(path, getattr(os, "O_PATH", os.O_RDONLY) | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc
            real = os.path.realpath(path)
        return real, st
    finally:
        os.close(fd)


def _folders_up(folder):
    """`folder` and each folder above it, to / (for an absolute, normalised `folder`)."""
    parts = folder.split("/")
    return ["/".join(parts[:n]) or "/" for n in range(len(parts), 0, -1)]

"""The kernel cache reads only files no one else could have written (NOTE [ Trusted files ]): entries another
user owns and folders others can write are refused and the kernel is compiled into memory, with a warning;
links planted at a temporary or lock name are never followed; a root-owned read-only cache is read, by
root and by another user, and the same folder made group-writable is not. The tests run as root (here and
in CI): another user's files are made with chown to nobody, another user's view with setpriv."""
import json
import os
import pathlib
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings

import pytest

from hotloop.rtc import cache_files, file_trust, images, kernel_cache, targets

SM_80 = targets.Target(80, True)
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def image_of(nvrtc, cache, tiny_kernels):
    """(KernelImage, [warning texts]) for tiny.cu on sm_80 through `cache`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = images.kernel_image(nvrtc, "tiny", SM_80, cache, tiny_kernels)
    return made, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def forge(path):
    """Put a whole, well-formed entry of random bytes at `path`: its checksum is right, its payload not ours."""
    path.write_bytes(kernel_cache.pack(random.randbytes(random.randrange(64, 4096))))
    return path.read_bytes()


@pytest.fixture
def compiled(nvrtc, tiny_kernels, fresh_cache):
    """(the image tiny.cu compiles to, its entry's path) in a fresh cache folder."""
    made = images.kernel_image(nvrtc, "tiny", SM_80, fresh_cache, tiny_kernels)
    assert not made.cached and made.image[:4] == b"\x7fELF"
    return made.image, fresh_cache.path(made.entry)


def test_the_folder_is_made_0700_and_entries_and_the_lock_0600(compiled, cache_dir):
    _, entry = compiled
    modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in (cache_dir, entry.parent, entry, entry.parent / ".lock")}
    assert modes == {cache_dir: 0o700, entry.parent: 0o700, entry: 0o600, entry.parent / ".lock": 0o600}


@needs_root
def test_an_entry_another_user_owns_is_refused_and_compiled_into_memory(nvrtc, tiny_kernels, compiled):
    image, entry = compiled
    forged = forge(entry)
    os.chown(entry, NOBODY, NOBODY)
    made, said = image_of(nvrtc, kernel_cache.KernelCache(entry.parent), tiny_kernels)
    assert not made.cached and made.image == image  # compiled again, the forged payload never returned
    assert len(said) == 1 and str(entry) in said[0] and "is owned by nobody (uid 65534)" in said[0]
    assert "not loaded" in said[0]
    # the folder is the user's own: the refused file is replaced by the kernel compiled now
    assert entry.read_bytes() != forged and kernel_cache.unpack(entry.read_bytes()) == image
    assert os.stat(entry).st_uid == os.geteuid()


@pytest.mark.parametrize("mode", [0o664, 0o646])
def test_an_entry_others_can_write_is_refused(nvrtc, tiny_kernels, compiled, mode):
    image, entry = compiled
    forge(entry)
    os.chmod(entry, mode)
    made, said = image_of(nvrtc, kernel_cache.KernelCache(entry.parent), tiny_kernels)
    assert not made.cached and made.image == image
    who = "group" if mode & 0o020 else "others"
    assert len(said) == 1 and f"is writable by {who} (mode {mode:o})" in said[0]


@pytest.mark.parametrize("owner", ["root", "nobody"])
def test_a_folder_of_mode_777_is_never_read_nor_written(nvrtc, tiny_kernels, compiled, owner):
    if owner == "nobody" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    image, entry = compiled
    folder = entry.parent
    forged = forge(entry)
    os.chmod(folder, 0o777)
    if owner == "nobody":
        for path in (folder, entry):
            os.chown(path, NOBODY, NOBODY)
    before = sorted(p.name for p in folder.iterdir())
    cache = kernel_cache.KernelCache(folder)
    made, said = image_of(nvrtc, cache, tiny_kernels)
    assert not made.cached and made.image == image and cache.disk_error is not None
    assert len(said) == 1 and "is writable by group and others (mode 777)" in said[0]
    assert f"chmod 700 {folder}" in said[0] and "compiled into memory" in said[0]
    assert ("is owned by nobody (uid 65534)" in said[0]) == (owner == "nobody")
    assert sorted(p.name for p in folder.iterdir()) == before and entry.read_bytes() == forged  # nothing written
    again, said_again = image_of(nvrtc, cache, tiny_kernels)
    assert again.cached and again.image == image and said_again == []  # from memory, warned once


def test_a_folder_that_is_a_link_is_refused(nvrtc, tiny_kernels, compiled, tmp_path):
    image, entry = compiled
    link = tmp_path / "linked"
    link.symlink_to(entry.parent, target_is_directory=True)
    made, said = image_of(nvrtc, kernel_cache.KernelCache(link), tiny_kernels)
    assert not made.cached and made.image == image
    assert len(said) == 1 and f"{link} is a symbolic link" in said[0]


def test_an_entry_that_is_a_link_is_refused_and_replaced_not_followed(nvrtc, tiny_kernels, compiled, tmp_path):
    image, entry = compiled
    elsewhere = tmp_path / "elsewhere"
    forged = forge(elsewhere)  # a whole entry, reached through a link
    entry.unlink()
    entry.symlink_to(elsewhere)
    made, said = image_of(nvrtc, kernel_cache.KernelCache(entry.parent), tiny_kernels)
    assert not made.cached and made.image == image
    assert len(said) == 1 and f"{entry} is a symbolic link" in said[0]
    assert not entry.is_symlink() and elsewhere.read_bytes() == forged  # the link replaced, its target untouched


def test_an_entry_that_is_a_fifo_is_refused_without_waiting(nvrtc, tiny_kernels, compiled):
    image, entry = compiled
    entry.unlink()
    os.mkfifo(entry)  # opening a fifo for reading would wait for a writer forever
    made, said = image_of(nvrtc, kernel_cache.KernelCache(entry.parent), tiny_kernels)
    assert not made.cached and made.image == image
    assert len(said) == 1 and f"{entry} is not a regular file" in said[0]


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_link_planted_at_the_temporary_name_is_not_followed(nvrtc, tiny_kernels, fresh_cache, tmp_path,
                                                             monkeypatch, target_exists):
    victim = tmp_path / "victim"
    text = f"the user's own file {random.random()}\n"
    if target_exists:
        victim.write_text(text)
    fresh_cache.folder.mkdir(parents=True, mode=0o700)
    planted, random_name = [], cache_files.temporary_name

    def predictable_first(name):  # as the name was before: known in advance, so a link can wait there
        if planted:
            return random_name(name)
        planted.append(f".{name}.planted.tmp")
        (fresh_cache.folder / planted[0]).symlink_to(victim)
        return planted[0]

    monkeypatch.setattr(cache_files, "temporary_name", predictable_first)
    made, said = image_of(nvrtc, fresh_cache, tiny_kernels)
    assert not made.cached and said == []
    assert kernel_cache.unpack(fresh_cache.path(made.entry).read_bytes()) == made.image  # stored under another name
    assert (fresh_cache.folder / planted[0]).is_symlink()
    assert (victim.read_text() == text) if target_exists else not victim.exists()


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_link_planted_at_the_lock_is_not_followed(nvrtc, tiny_kernels, fresh_cache, tmp_path, target_exists):
    victim = tmp_path / "victim"
    if target_exists:
        victim.write_text("the user's own file\n")
        os.chmod(victim, 0o600)
    fresh_cache.folder.mkdir(parents=True, mode=0o700)
    (fresh_cache.folder / ".lock").symlink_to(victim)
    made, said = image_of(nvrtc, fresh_cache, tiny_kernels)
    assert not made.cached and made.image[:4] == b"\x7fELF"
    assert len(said) == 1 and "cannot be written" in said[0] and "compiled into memory" in said[0]
    if target_exists:
        assert victim.read_text() == "the user's own file\n" and stat.S_IMODE(os.stat(victim).st_mode) == 0o600
    else:
        assert not victim.exists()


def test_a_filesystem_that_cannot_be_checked_leaves_the_cache_in_memory(nvrtc, tiny_kernels, compiled, monkeypatch):
    image, entry = compiled
    real_open = os.open

    def no_nofollow(path, flags, *args, **kwargs):  # as on a mount that does not support the flag
        if os.fspath(path) == os.fspath(entry.parent) and flags & os.O_NOFOLLOW:
            raise OSError(95, "Operation not supported", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_nofollow)
    cache = kernel_cache.KernelCache(entry.parent)
    made, said = image_of(nvrtc, cache, tiny_kernels)
    assert not made.cached and made.image == image and cache.disk_error is not None
    assert len(said) == 1 and "Operation not supported" in said[0] and "HOTLOOP_CACHE_DIR" in said[0]


def read_only(folder):
    for path in folder.iterdir():
        os.chmod(path, 0o444)
    os.chmod(folder, 0o555)


@needs_root
def test_a_read_only_folder_of_a_trusted_owner_is_read(nvrtc, tiny_kernels, compiled, monkeypatch):
    image, entry = compiled
    read_only(entry.parent)
    made, said = image_of(nvrtc, kernel_cache.KernelCache(entry.parent), tiny_kernels)  # root's own
    assert made.cached and made.image == image and said == []
    for path in (entry.parent, entry):  # a service user's, trusted by name
        os.chown(path, NOBODY, NOBODY)
    monkeypatch.setenv("HOTLOOP_CACHE_TRUSTED_OWNERS", "root,nobody")
    made, said = image_of(nvrtc, kernel_cache.KernelCache(entry.parent), tiny_kernels)
    assert made.cached and made.image == image and said == []
    monkeypatch.setenv("HOTLOOP_CACHE_TRUSTED_OWNERS", "root")
    made, said = image_of(nvrtc, kernel_cache.KernelCache(entry.parent), tiny_kernels)
    assert not made.cached and made.image == image
    assert len(said) == 1 and "is owned by nobody" in said[0] and "HOTLOOP_CACHE_TRUSTED_OWNERS" in said[0]
    os.chmod(entry.parent, 0o575)
    monkeypatch.setenv("HOTLOOP_CACHE_TRUSTED_OWNERS", "nobody")
    made, said = image_of(nvrtc, kernel_cache.KernelCache(entry.parent), tiny_kernels)
    assert not made.cached and len(said) == 1 and "is writable by group (mode 575)" in said[0]


def test_trusted_owners_are_named_by_user_or_uid(monkeypatch):
    monkeypatch.delenv("HOTLOOP_CACHE_TRUSTED_OWNERS", raising=False)
    assert file_trust.trusted_owners() == {0, os.geteuid()}
    monkeypatch.setenv("HOTLOOP_CACHE_TRUSTED_OWNERS", " nobody , 4242 ")
    assert file_trust.trusted_owners() == {NOBODY, 4242, os.geteuid()}
    monkeypatch.setenv("HOTLOOP_CACHE_TRUSTED_OWNERS", "nobody,no-such-user-here")
    with pytest.raises(ValueError, match="names 'no-such-user-here', which is no user on this machine"):
        file_trust.trusted_owners()


# another user's view: a root-owned shared cache read by nobody, as a cluster's users would read it (the
# look-up alone: nobody may not be able to open the NVRTC wheels of root's Python, and compiling into
# memory after a refusal is checked above)
READER = textwrap.dedent("""
    import json, sys, warnings
    from hotloop.rtc import kernel_cache
    folder, name = sys.argv[1], sys.argv[2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        payload = kernel_cache.KernelCache(folder).lookup(name, name.split(".")[2])
    print(json.dumps({"image": payload and payload.hex(), "said": [str(w.message) for w in caught]}))
""")


AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c"]


def as_nobody(args):
    done = subprocess.run(AS_NOBODY + [READER] + args, capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@needs_root
def test_a_root_owned_read_only_cache_is_read_by_another_user_and_not_once_group_writable(nvrtc, tiny_kernels):
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv here to run a reader as another user")
    if subprocess.run(AS_NOBODY + ["import hotloop.rtc.kernel_cache"], capture_output=True, cwd="/").returncode:
        pytest.skip("nobody cannot run this Python and hotloop here (a home folder only root may enter?)")
    shared = pathlib.Path(tempfile.mkdtemp(prefix="hotloop-shared-"))  # in /tmp, where nobody can reach it
    try:
        os.chmod(shared, 0o755)
        cache = kernel_cache.KernelCache(shared / "cache" / "kernels")
        made = images.kernel_image(nvrtc, "tiny", SM_80, cache, tiny_kernels)  # the administrator's compile
        subprocess.run(["chmod", "-R", "go-w,a+rX", str(shared)], check=True)
        read_only(cache.folder)
        seen = as_nobody([str(cache.folder), made.entry])
        assert bytes.fromhex(seen["image"]) == made.image and seen["said"] == []
        os.chmod(cache.folder, 0o575)
        seen = as_nobody([str(cache.folder), made.entry])
        assert seen["image"] is None
        assert len(seen["said"]) == 1 and "is writable by group (mode 575)" in seen["said"][0]
        os.chmod(cache.folder, 0o555)
        os.chmod(cache.path(made.entry), 0o664)
        seen = as_nobody([str(cache.folder), made.entry])
        assert seen["image"] is None and "is writable by group (mode 664)" in seen["said"][0]
    finally:
        shutil.rmtree(shared)

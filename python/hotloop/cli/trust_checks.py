"""doctor's checks that hotloop loads code only from files no one else could have written (NOTE [ Trusted
files ]): the kernel cache folder and its entries, the HOTLOOP_* library paths, and the libraries found.

Each check is (name, status, value, advice), as Doctor.add takes it. They only read: nothing is made,
changed or opened (no library is loaded here)."""
import os
import stat

from ..rtc import cache_files, file_trust, kernel_cache, library_search, nvrtc_finder

# the variables that name a library file hotloop opens; NVRTC's builtins beside it are loaded too
LIBRARY_VARIABLES = {"HOTLOOP_NVRTC": nvrtc_finder.BUILTINS, "HOTLOOP_NVJPEG": None, "HOTLOOP_LIBCUDA": None,
                     "HOTLOOP_NVML_LIBRARY": None}


def checks() -> list:
    return [cache_folder_check(), library_paths_check()]


def cache_folder_check():
    """WARN where the cache folder (or one of its entries, or the folder it lies in) fails the checks the
    cache makes before it reads; what the cache then does, and how to mend it."""
    name = "kernel cache trust"
    folder = kernel_cache.cache_folder()
    try:
        owners = file_trust.trusted_owners()
    except ValueError as exc:
        return name, "FAIL", str(exc), "name users that exist, or unset it"
    above = _folder_above_warning(kernel_cache.cache_root(), owners)
    if not folder.exists():
        if above:
            return name, "WARN", f"{folder} is not made yet; {above}", f"chmod 700 {kernel_cache.cache_root()}"
        return name, "PASS", f"{folder} not made yet (it is made 0700 at the first compile)"
    try:
        with cache_files.opened_folder(os.fspath(folder), owners) as folder_fd:
            refused = _refused_entries(folder_fd, owners)
    except cache_files.Refused as exc:
        return (name, "WARN", f"{exc}: nothing is loaded from it, kernels are compiled into memory",
                kernel_cache.folder_fix(folder, exc.why))
    except OSError as exc:
        return name, "WARN", f"{folder} cannot be read ({exc.strerror})", kernel_cache.OWN_FOLDER
    if refused:
        return (name, "WARN", f"{len(refused)} entries in {folder} are not loaded: {refused[0]}",
                "they were not written by hotloop for you: remove them (they are compiled again)")
    if above:
        return name, "WARN", f"{folder} is yours; {above}", f"chmod go-w {kernel_cache.cache_root()}"
    return name, "PASS", f"{folder}: no one else can write it or its entries"


def _folder_above_warning(root, owners):
    """A phrase when the folder that holds the kernels folder is writable by others (not sticky)."""
    try:
        st = os.stat(root)
    except OSError:
        return None
    why = file_trust.refusal(st, True, owners)
    if why and "writable" in why and not st.st_mode & stat.S_ISVTX:
        return (f"{root} {why}: others can put a folder of theirs in its place, which is then refused "
                "(kernels compile into memory)")
    return None


def _refused_entries(folder_fd, owners):
    """'<name> <why>' of each entry (not the lock) that would be refused."""
    refused = []
    for entry in sorted(os.listdir(folder_fd)):
        if entry == ".lock":
            continue
        try:
            st = os.stat(entry, dir_fd=folder_fd, follow_symlinks=False)
        except OSError:
            continue  # gone meanwhile
        why = file_trust.refusal(st, False, owners)
        if why:
            refused.append(f"{entry} {why}")
    return refused


def library_paths_check():
    """WARN for each HOTLOOP_* library path, and each NVRTC or nvjpeg found, that others could write; else
    the first NVRTC and nvjpeg tried, where each was found."""
    name = "library paths"
    problems, first, missing = [], [], []
    try:
        for variable, companions in LIBRARY_VARIABLES.items():
            value = os.environ.get(variable, "").strip()
            if value and "/" in value:  # else unset, or a soname the dynamic linker resolves
                why = library_search.refusal(os.path.abspath(value), companions=companions)
                problems += [f"{variable}={value}: {why}"] if why else []
                first += [f"{variable}={value}"] if not why else []
        searches = [("NVRTC", "HOTLOOP_NVRTC", nvrtc_finder.nvrtc_candidates),
                    ("nvjpeg", "HOTLOOP_NVJPEG", library_search.nvjpeg_search)]
        for library, variable, search in searches:
            if os.environ.get(variable):  # the user's choice is all that is tried: checked above
                continue
            found = search()
            problems += [f"{c.path} ({c.origin}) {c.skipped}" for c in found
                         if (c.skipped or "").startswith("not opened")]
            tried = [c for c in found if not c.skipped and os.path.exists(c.path)]
            first.append(f"{library} {tried[0].path} ({tried[0].origin})" if tried else f"no {library} found")
            missing += [] if tried else [library]
    except ValueError as exc:  # HOTLOOP_CACHE_TRUSTED_OWNERS names no user
        return name, "FAIL", str(exc), "name users that exist, or unset it"
    if problems:
        return (name, "WARN", "; ".join(problems), "a library others can write is never opened: chmod go-w the "
                "file and its folders, or install it where only you (or root) can write")
    return name, "PASS", "; ".join(first) + (": no one else can write them" if len(first) > len(missing) else "")

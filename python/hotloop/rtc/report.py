"""What `hotloop info` and `hotloop doctor` say about run-time compilation: the NVRTC found, the driver, the
cache folder, which kernel sources are already compiled there for each visible GPU, and where each library
hotloop opens by path was found or why it was left out. Reads only: nothing is compiled or opened."""
from .. import _C
from . import images, kernel_cache, library_search, nvrtc_finder


def nvrtc_report() -> dict:
    """{"path", "version" ("12.9"), "error"}: the NVRTC kernels would be compiled with, or why none."""
    try:
        nvrtc = nvrtc_finder.find_nvrtc()
    except RuntimeError as exc:
        return {"path": None, "version": None, "error": str(exc)}
    refused = None if nvrtc.opened else library_search.refusal(nvrtc.path, companions=nvrtc_finder.BUILTINS)
    if refused:  # known from remembered facts, unopened: its first compile would refuse it
        return {"path": None, "version": None, "error": f"NVRTC {nvrtc.path} would not be opened: {refused}"}
    return {"path": nvrtc.path, "version": "%d.%d" % nvrtc.version, "error": None}


def visible_devices() -> list:
    """(index, (major, minor)) of each GPU this process sees; [] without a driver or a GPU build."""
    if not hasattr(_C, "cuda_device_capability") or _C.cuda_unavailable_reason() is not None:
        return []
    return [(i, _C.cuda_device_capability(i)) for i in range(_C.cuda_device_count())]


def kernel_cache_report() -> dict:
    """{"folder", "devices": [{"device", "capability", "target", "sources": {source: cached}, "error"}],
    "error"}: for each visible GPU, whether each source is compiled in the cache for it."""
    report = {"folder": str(kernel_cache.cache_folder()), "devices": [], "error": None}
    devices = visible_devices()
    if not devices:
        return report
    try:
        nvrtc = nvrtc_finder.find_nvrtc()
    except RuntimeError as exc:
        report["error"] = str(exc).splitlines()[0]
        return report
    for index, capability in devices:
        entry = {"device": index, "capability": "%d.%d" % tuple(capability), "target": None, "sources": {},
                 "error": None}
        try:
            target = images.target_for_device(nvrtc, index)
            entry["target"] = str(target)
            images.check_driver_loads(nvrtc, target, nvrtc_finder.driver_cuda_version())
            entry["sources"] = images.cached_sources(index, nvrtc)
        except (RuntimeError, OSError, ValueError) as exc:
            entry["error"] = str(exc)
        report["devices"].append(entry)
    return report


def library_places() -> dict:
    """{"nvrtc": [...], "nvjpeg": [...]}: each file found, in the order tried, as {"path", "origin", "skipped"}
    (NOTE [ Library search ]); a search that failed (a HOTLOOP_* path refused) is one place whose path is None."""
    places = {}
    for name, search in (("nvrtc", nvrtc_finder.nvrtc_candidates), ("nvjpeg", library_search.nvjpeg_search)):
        try:
            places[name] = [{"path": c.path, "origin": c.origin, "skipped": c.skipped} for c in search()]
        except (RuntimeError, ValueError) as exc:
            places[name] = [{"path": None, "origin": None, "skipped": str(exc)}]
    return places


def library_place_lines(places: dict, used: dict) -> list:
    """(key, text) lines for `hotloop info`: where the library in use (used: {"nvrtc": path}) was found,
    and each one left out with why."""
    lines = []
    for name, label in (("nvrtc", "NVRTC"), ("nvjpeg", "nvjpeg")):
        for place in places.get(name, []):
            if place["path"] is not None and place["path"] == used.get(name):
                lines.append((f"{label} found as", place["origin"]))
            elif place["skipped"]:
                lines.append((f"{label} left out", f"{place['path'] or ''} {place['skipped']}".strip()))
    return lines

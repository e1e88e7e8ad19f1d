"""`python -m hotloop info`: what hotloop was built with and what this machine offers it."""
import os
import platform
import sys

from .. import _C
from .._version import __version__


def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")


def collect() -> dict:
    """Build and machine facts as a dict; works without torch and without a GPU."""
    from ..rtc import report as rtc  # reads the kernel cache, compiles nothing

    facts = {
        "hotloop": __version__,
        "build": _C.build_info(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cuda_unavailable_reason": _C.cuda_unavailable_reason(),
        "cuda_driver_version": _C.cuda_driver_version(),
        "cuda_devices": [],
        "torch": None,
        "torch_cuda": None,
        "nvjpeg": _nvjpeg(),
        "nvrtc": rtc.nvrtc_report(),
        "kernel_cache": rtc.kernel_cache_report(),
        "library_places": rtc.library_places(),
    }
    try:
        import torch
    except ImportError:
        return facts
    facts["torch"] = torch.__version__
    facts["torch_cuda"] = torch.version.cuda
    if facts["cuda_unavailable_reason"] is None and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            facts["cuda_devices"].append({
                "index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count,
                "jpeg_decoder": _jpeg_decoder(i) if facts["nvjpeg"]["path"] else None,
            })
    return facts


def _one_line(message) -> str:
    """nvjpeg_load's message (its first line ends "tried:", a line per path follows) as one line that keeps the
    paths and why each failed."""
    first, *tried = message.splitlines()
    tried = [line.strip() for line in tried if line.strip()]
    if not tried:
        return first.removesuffix("; tried:").removesuffix(" tried:")
    return f"{first} " + "; ".join(tried)


def _nvjpeg() -> dict:
    """Which nvjpeg gpu_decode would open (path, version), or why none loads."""
    try:
        from ..data.image.nvjpeg import nvjpeg_library_candidates  # hotloop.data needs torch
    except ImportError as exc:
        return {"path": None, "version": None, "error": str(exc)}
    try:
        path, version = _C.nvjpeg_load(nvjpeg_library_candidates())
    except RuntimeError as exc:
        return {"path": None, "version": None, "error": _one_line(str(exc))}
    return {"path": path, "version": ".".join(map(str, version)), "error": None}


def _jpeg_decoder(device) -> str:
    """The backend gpu_decode's "auto" takes on this GPU: its hardware JPEG decoders, else the next of
    auto's backends that opens, else the workers."""
    from ..data.image.gpu_decode import auto_backends
    from ..data.image.nvjpeg import nvjpeg_library_candidates

    refusals = []
    for backend in auto_backends():
        try:
            _C.JpegDecoder(nvjpeg_library_candidates(), device, backend, 1).close()
        except RuntimeError as exc:
            refusals.append(f"nvjpeg {backend}: {str(exc).splitlines()[0]}" if refusals
                            else f"no hardware JPEG decoder: {str(exc).splitlines()[0]}")
            continue
        return f"nvjpeg {backend}" + (f" ({'; '.join(refusals)})" if refusals else "")
    return f"workers ({'; '.join(refusals)})"


def cuda_version_text(version):
    return "none" if not version else f"{version // 1000}.{version % 1000 // 10}"


def main(args) -> int:
    facts = collect()
    if getattr(args, "json", False):
        import json

        print(json.dumps(facts, indent=2))
        return 0
    build = facts["build"]
    lines = [
        ("hotloop", facts["hotloop"]),
        ("built with CUDA", "yes: the driver API at run time, kernels by NVRTC on first use" if build["cuda"]
         else "no (HOTLOOP_CUDA=0)"),
        ("stable ABI (abi3)", "yes" if build["abi3"] else "no"),
        ("sanitizers", ", ".join(build["sanitizers"]) or "none"),
        ("python", f"{facts['python']} on {facts['platform']}"),
        ("CPU cores", str(facts["cpu_count"])),
        ("torch", facts["torch"] or "not installed"),
        ("torch built for CUDA", facts["torch_cuda"] or "no"),
        ("CUDA driver supports", cuda_version_text(facts["cuda_driver_version"])),
        ("hotloop can use CUDA", "yes" if facts["cuda_unavailable_reason"] is None
         else f"no: {facts['cuda_unavailable_reason']}"),
    ]
    nvjpeg = facts["nvjpeg"]
    lines.append(("nvjpeg (gpu_decode)", f"{nvjpeg['path']} {nvjpeg['version']}" if nvjpeg["path"]
                  else f"not found: {nvjpeg['error']}"))
    nvrtc, cache = facts["nvrtc"], facts["kernel_cache"]
    lines.append(("NVRTC (kernels)", f"{nvrtc['path']} {nvrtc['version']}" if nvrtc["path"]
                  else f"not found: {nvrtc['error'].splitlines()[0]}"))
    from ..rtc import report as rtc

    lines += rtc.library_place_lines(facts["library_places"], {"nvrtc": nvrtc["path"], "nvjpeg": nvjpeg["path"]})
    lines.append(("kernel cache", cache["folder"] + (f" ({cache['error']})" if cache["error"] else "")))
    for d in cache["devices"]:
        compiled = [s for s, cached in d["sources"].items() if cached]
        lines.append((f"kernels for cuda:{d['device']}", d["error"] or f"{d['target']}: {len(compiled)} of "
                      f"{len(d['sources'])} compiled ({', '.join(compiled) or 'none yet'})"))
    for d in facts["cuda_devices"]:
        lines.append((f"cuda:{d['index']}", f"{d['name']}, sm_{d['capability'].replace('.', '')}, "
                      f"{d['memory_gib']} GiB, {d['multiprocessors']} SMs; JPEG decode: {d['jpeg_decoder'] or 'workers'}"))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    return 0

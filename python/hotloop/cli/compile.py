"""`python -m hotloop compile`: fill the kernel cache ahead of time, for clusters whose nodes must not compile
(NVRTC compiles each kernel source for each GPU architecture; the first use then only reads the cache)."""
import argparse
import os
import sys
import time

from .. import _C

# with no GPU here (a login node): the data-centre and desktop GPUs of the last generations
DEFAULT_ARCHS = (75, 80, 86, 89, 90, 120)


def arch_list(text: str) -> list:
    """"80,90" or "8.0,9.0" -> [80, 90]"""
    archs = []
    for part in text.replace(";", ",").split(","):
        part = part.strip().lower().removeprefix("sm_").replace(".", "")
        if not part.isdigit() or int(part) < 10:
            raise argparse.ArgumentTypeError(f"expected compute capabilities such as 80,90 or 8.6, got {text!r}")
        archs.append(int(part))
    return archs


def add_arguments(parser):
    parser.add_argument("--arch", type=arch_list, default=None,
                        help="compute capabilities to compile for, e.g. 80,90 (default: the GPUs here, else "
                             + ",".join(map(str, DEFAULT_ARCHS)) + ")")
    parser.add_argument("--ptx", action="store_true",
                        help="PTX for compute_<arch> instead of CUBINs (what a GPU newer than NVRTC knows is given)")
    parser.add_argument("--nvrtc", metavar="PATH", help="the libnvrtc.so to compile with (default: as found)")


def visible_archs() -> list:
    """The architectures of the GPUs this process sees, each once; [] without a driver or GPU."""
    if not hasattr(_C, "cuda_device_capability"):
        return []
    archs = []
    for device in range(_C.cuda_device_count()):
        major, minor = _C.cuda_device_capability(device)
        archs.append(10 * major + minor)
    return sorted(set(archs))


def main(args) -> int:
    from ..rtc import images, kernel_sources, nvrtc_finder  # hotloop.rtc needs no torch

    try:
        if args.nvrtc:
            nvrtc = nvrtc_finder.open_trusted_nvrtc(os.path.abspath(args.nvrtc))
        else:
            nvrtc = nvrtc_finder.find_nvrtc()
    except RuntimeError as exc:
        print(f"hotloop compile: {exc}", file=sys.stderr)
        return 1
    archs = args.arch or visible_archs() or list(DEFAULT_ARCHS)
    cache = images.kernel_cache_for_now()
    print(f"NVRTC {'.'.join(map(str, nvrtc.version))} ({nvrtc.path}); kernels from {kernel_sources.kernels_dir()}")
    rows, failures = [], []
    start = time.perf_counter()
    for arch in archs:
        for source in kernel_sources.source_names():
            try:
                target = images.target_for_arch(nvrtc, arch, args.ptx)
                made = images.kernel_image(nvrtc, source, target, cache)
            except RuntimeError as exc:
                failures.append(f"{source} for sm_{arch}: {exc}")
                rows.append((source, f"sm_{arch}", "-", "FAILED", "-"))
                continue
            rows.append((source, f"sm_{arch}", str(target), "cached" if made.cached else "compiled",
                         f"{made.seconds:.2f}"))
    header = ("source", "GPU", "image", "result", "seconds")
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    where = f"{cache.folder}" if cache.disk_error is None else f"memory only ({cache.folder}: {cache.disk_error})"
    print(f"cache: {where}; {time.perf_counter() - start:.1f} s in all")
    for failure in failures:
        print(f"\nhotloop compile: {failure}", file=sys.stderr)
    return 1 if failures else 0

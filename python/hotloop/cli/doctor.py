"""`python -m hotloop doctor`: checks the driver, torch, each GPU, the PCIe link, power and the host; advises.

Each check is PASS, WARN or FAIL (SKIP when it does not apply) with one line of advice. The exit code
is 0 when everything passed, 1 with a warning, 2 with a failure. It only reads: no GPU setting is
ever changed (a power limit or persistence mode is advised, never set). Without a GPU it says so and
still checks the host.
"""
import dataclasses
import json
import os
import re
import sys
import time

from .. import _C, cuda_queues
from . import trust_checks
from ..memory.clock_reasons import SLOWDOWN_REASONS, reason_names

# PCIe data rate per lane and direction, GB/s, after line encoding
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
BANDWIDTH_BYTES = 256 << 20


@dataclasses.dataclass
class Check:
    name: str
    status: str  # PASS, WARN, FAIL, SKIP
    value: str
    advice: str = ""


def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print the checks and facts as JSON")


class Doctor:
    def __init__(self):
        self.checks = []
        self.facts = {}

    def add(self, name, status, value, advice=""):
        self.checks.append(Check(name, status, str(value), advice))

    # ---- driver and torch ----
    def driver(self):
        reason = _C.nvml_unavailable_reason()
        self.facts["nvml_unavailable_reason"] = reason
        if reason is not None:
            self.facts["nvml"] = None
            self.add("GPU", "SKIP", "no NVIDIA GPU or driver found", f"nothing to check on the GPU side ({reason})")
            return None
        system = _C.nvml_system()
        self.facts["nvml"] = system
        cuda = system["cuda_driver_version"]
        self.add("driver", "PASS", f"{system['driver_version']}, supports CUDA {_cuda_text(cuda)}, "
                 f"{system['device_count']} GPU(s)")
        return system

    def torch_versions(self, system):
        try:
            import torch
        except ImportError:
            self.add("torch", "WARN", "not installed", "pip install torch (the CUDA build matching your driver)")
            return None
        self.facts["torch"] = torch.__version__
        self.facts["torch_cuda"] = torch.version.cuda
        # cuDNN is loaded only where a GPU can use it: a CUDA build of torch under AddressSanitizer
        # aborts in that load (CI's sanitizer run, which has no GPU, saw it)
        gpu = torch.cuda.is_available()
        cudnn = torch.backends.cudnn.version() if gpu and torch.backends.cudnn.is_available() else None
        self.facts["cudnn"] = cudnn
        value = (f"{torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}, "
                 f"cuDNN {cudnn or ('none' if gpu else 'not loaded (no GPU)')}")
        if system is None:
            self.add("torch", "PASS", value)
            return torch
        if torch.version.cuda is None:
            self.add("torch", "FAIL", value, "this torch is a CPU build: install a CUDA build of torch")
            return torch
        major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
        need = major * 1000 + minor * 10
        have = system["cuda_driver_version"]
        if have is None:
            self.add("torch", "WARN", value, "the driver did not say which CUDA it supports")
        elif have // 1000 < major:
            self.add("torch", "FAIL", value + f"; driver supports CUDA {_cuda_text(have)} only",
                     f"update the NVIDIA driver to one for CUDA {major}.x, or install torch built for "
                     f"CUDA {have // 1000}.x")
        elif have < need:
            self.add("torch", "WARN", value + f"; driver supports CUDA {_cuda_text(have)}",
                     "runs by minor-version compatibility; PTX JIT of newer kernels may fail: update the driver")
        else:
            self.add("torch", "PASS", value + f"; driver supports CUDA {_cuda_text(have)}")
        if not torch.cuda.is_available():
            self.add("torch CUDA", "FAIL", "torch.cuda.is_available() is False although a GPU is there",
                     "check CUDA_VISIBLE_DEVICES and that the driver and torch match")
        return torch

    # ---- per GPU ----
    def gpus(self, system, torch):
        count = system["device_count"] if system else 0
        torch_cuda = torch is not None and torch.cuda.is_available()
        self.facts["gpus"] = []
        for i in range(count):
            info = _C.nvml_device_info(i)
            self.facts["gpus"].append(info)
            tag = f"gpu {i}"
            mem = info["memory"] or {}
            name = f"{info['name']}, {mem.get('total', 0) / 2**30:.0f} GiB"
            tindex = _torch_index(torch, info["uuid"], i) if torch_cuda else None
            if tindex is not None:
                major, minor = torch.cuda.get_device_capability(tindex)
                name += f", compute capability {major}.{minor} (torch cuda:{tindex})"
                arch = f"sm_{major}{minor}"
                archs = torch.cuda.get_arch_list()
                # PTX of compute_X is compiled by the driver for any device of capability X or newer
                ptx = [int(re.match(r"\d+", a[8:]).group()) for a in archs if re.match(r"compute_\d", a)]
                if arch in archs or any(p <= major * 10 + minor for p in ptx):
                    self.add(f"{tag} device", "PASS", name)
                else:
                    self.add(f"{tag} device", "FAIL", name + f"; torch has kernels for {', '.join(archs)}",
                             f"install a torch build that includes {arch}")
            else:
                self.add(f"{tag} device", "PASS", name)
            self.pcie(tag, i, info, torch if tindex is not None else None, tindex)
            if tindex is not None:
                self.jpeg_decode(tag, torch.device("cuda", tindex))
            self.power(tag, info)
            self.thermal(tag, info)
            pm = info["persistence_mode"]
            if pm is None:
                self.add(f"{tag} persistence", "SKIP", "not reported")
            else:
                self.add(f"{tag} persistence", "PASS" if pm else "WARN", "on" if pm else "off",
                         "" if pm else "ask the administrator to enable persistence mode (nvidia-smi -pm 1): "
                         "avoids driver re-initialisation at each start")
            ecc = info["ecc"]
            if ecc is None:
                self.add(f"{tag} ECC", "SKIP", "not supported")
            else:
                pending = " (change pending a reboot)" if ecc[0] != ecc[1] else ""
                self.add(f"{tag} ECC", "PASS", ("on" if ecc[0] else "off") + pending)
            mig = info["mig"]
            if mig is None:
                self.add(f"{tag} MIG", "SKIP", "not supported")
            else:
                self.add(f"{tag} MIG", "WARN" if mig[0] else "PASS", "on" if mig[0] else "off",
                         "MIG on: this process gets one slice of the GPU; training usually wants MIG off"
                         if mig[0] else "")
        if torch_cuda and torch.cuda.device_count() > 1:
            n = torch.cuda.device_count()
            missing = [(a, b) for a in range(n) for b in range(n) if a != b
                       and not torch.cuda.can_device_access_peer(a, b)]
            self.add("peer access", "WARN" if missing else "PASS",
                     f"{n} GPUs, " + (f"no peer access for {missing[:4]}" if missing else "all pairs"),
                     "without peer access NCCL goes through host memory: check the topology "
                     "(nvidia-smi topo -m) and IOMMU/ACS settings" if missing else "")

    def kernels(self, system):
        """NVRTC compiles the kernels at first use: which NVRTC and driver, the cache, what is compiled"""
        from ..rtc import report as rtc  # reads the kernel cache, compiles nothing

        nvrtc, cache = rtc.nvrtc_report(), rtc.kernel_cache_report()
        self.facts["nvrtc"], self.facts["kernel_cache"] = nvrtc, cache
        if nvrtc["path"] is None:
            cpu_torch = "torch" in self.facts and not self.facts.get("torch_cuda")
            advice = (nvrtc["error"].splitlines()[-1] if system or not cpu_torch else
                      "torch here is a CPU build: hotloop's GPU kernels are not used and need no NVRTC; install a CUDA "
                      "build of torch (pytorch.org) to use a GPU")
            self.add("kernels (NVRTC)", "FAIL" if system else "SKIP", "no NVRTC found" + ("" if system else ", no GPU"),
                     advice)
            return
        value = (f"NVRTC {nvrtc['version']} ({nvrtc['path']}), driver CUDA {_cuda_text(_C.cuda_driver_version())}, "
                 f"cache {cache['folder']}")
        failed = [f"gpu {d['device']}: {d['error']}" for d in cache["devices"] if d["error"]]
        missing = [d for d in cache["devices"] if not d["error"] and not all(d["sources"].values())]
        for d in cache["devices"]:
            value += f"; gpu {d['device']} {d['target']}: {sum(d['sources'].values())} of {len(d['sources'])} compiled"
        if failed or cache["error"]:
            self.add("kernels (NVRTC)", "FAIL", value, "; ".join(failed) or cache["error"])
        else:
            self.add("kernels (NVRTC)", "PASS", value, "the others compile at first use; `python -m hotloop compile` "
                     "compiles them ahead" if missing else "")

    def pcie(self, tag, index, info, torch, tindex):
        """links downshift when idle: read gen/width while copies run, then time a pinned copy"""
        link = info["pcie"]
        gbps = None
        if torch is not None:
            gbps, link = _pinned_bandwidth(torch, tindex, index, link)
        gen, gen_max, width, width_max = (link.get(k) for k in ("gen", "gen_max", "width", "width_max"))
        if gen is None or width is None:
            self.add(f"{tag} PCIe link", "SKIP", "not reported (SXM/NVLink-C2C or virtualised)")
        else:
            loaded = "under load" if torch is not None else "idle (no torch CUDA to load it)"
            short = (width_max is not None and width < width_max) or (gen_max is not None and gen < gen_max)
            status = "WARN" if short and torch is not None else "PASS"
            advice = ""
            if short and torch is not None:
                advice = ("the link runs below what it can: reseat the card in an x16 slot wired to the CPU, "
                          "check riser cables and the BIOS PCIe generation setting")
            elif short:
                advice = "idle links downshift; run doctor with a CUDA torch to measure under load"
            self.add(f"{tag} PCIe link", status, f"gen {gen} x{width} {loaded} (max gen {gen_max} x{width_max})",
                     advice)
        if gbps is not None:
            expected = PCIE_LANE_GBPS.get(link.get("gen") or 0, 0) * (link.get("width") or 0)
            value = f"{gbps:.1f} GB/s host-to-device, pinned, 256 MB"
            self.facts.setdefault("h2d_gbps", {})[tag] = gbps
            if expected:
                ratio = gbps / expected
                value += f" ({100 * ratio:.0f} % of the link's {expected:.1f} GB/s)"
                self.add(f"{tag} H2D bandwidth", "PASS" if ratio >= 0.6 else "WARN", value,
                         "" if ratio >= 0.6 else "well below the link: check the slot, NUMA placement "
                         "(run on the CPU next to the GPU) and IOMMU settings")
            else:
                self.add(f"{tag} H2D bandwidth", "PASS", value)

    def jpeg_decode(self, tag, device):
        """Which decoder hotloop.DataLoader(gpu_decode=True) takes on `device`: the JPEG engines where
        nvjpeg's hardware decoder opens there, else the next of auto's backends that opens, else the
        workers (NOTE [ Decoding beside the training step ] in data/image/gpu_decode.py)."""
        from ..data.image.decoder_opening import open_first
        from ..data.image.gpu_decode import auto_backends

        decoder, backend, refusals = open_first(device, auto_backends(), 1)
        threads = getattr(decoder, "threads", None)
        if decoder is not None:
            decoder.close()
        why = "; ".join(str(refusal) if k == 0 else f"nvjpeg {name}: {refusal}"
                        for k, (name, refusal) in enumerate(refusals))
        if backend == "hardware":
            self.add(f"{tag} JPEG decode", "PASS", "gpu_decode takes nvjpeg's JPEG engines (backend 'hardware')")
        elif backend == "hybrid":
            self.add(f"{tag} JPEG decode", "PASS", "gpu_decode takes backend 'hybrid': nvjpeg decodes Huffman "
                     f"codes on {threads} threads of the main process, the rest on the GPU; no JPEG engines "
                     f"here ({why})")
        else:
            self.add(f"{tag} JPEG decode", "PASS", f"gpu_decode takes backend 'cpu': the workers decode with PIL, "
                     f"the GPU crops, resizes and normalises; no JPEG engines here ({why})")

    def power(self, tag, info):
        draw, limit, default = info["power_mw"], info["power_limit_mw"], info["power_default_limit_mw"]
        if limit is None:
            self.add(f"{tag} power", "SKIP", "not reported")
            return
        value = f"{(draw or 0) / 1e3:.0f} W drawn, limit {limit / 1e3:.0f} W" + \
            (f" (default {default / 1e3:.0f} W)" if default else "")
        if default and limit < 0.95 * default:
            self.add(f"{tag} power", "WARN", value, f"the power limit is {100 * limit / default:.0f} % of the default: "
                     "ask the administrator to restore it (hotloop never changes it)")
        else:
            self.add(f"{tag} power", "PASS", value)

    def thermal(self, tag, info):
        temp, reasons = info["temperature_c"], info["reasons"] or 0
        names = reason_names(reasons)
        value = f"{temp} °C" if temp is not None else "temperature not reported"
        value += f", clock-event reasons: {', '.join(names) or 'none'}"
        if reasons & SLOWDOWN_REASONS or (temp is not None and temp >= 85):
            self.add(f"{tag} thermal", "WARN", value, "the GPU is hot or slowed down: check cooling and airflow")
        else:
            self.add(f"{tag} thermal", "PASS", value)

    # ---- host ----
    def host(self, system, torch):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        gpus = max(1, system["device_count"] if system else 1)
        workers = max(1, min(8, cores // gpus - 1))
        self.facts["cpu_cores"] = cores
        self.facts["advised_num_workers"] = workers
        if not system or not system["device_count"]:
            self.add("CPU cores", "PASS", f"{cores} usable, no GPU")
            return self.host_limits()
        self.add("CPU cores", "PASS" if cores // gpus >= 4 else "WARN", f"{cores} usable, {gpus} GPU(s)",
                 f"use num_workers={workers} per GPU" if cores // gpus >= 4 else
                 f"few cores per GPU: num_workers={workers}; decode on the GPU or pre-process the data set")
        self.host_limits()

    def host_limits(self):
        try:
            st = os.statvfs("/dev/shm")
            shm = st.f_frsize * st.f_blocks
            self.facts["dev_shm_bytes"] = shm
            ok = shm >= 1 << 30
            self.add("/dev/shm", "PASS" if ok else "WARN", f"{shm / 2**30:.1f} GiB",
                     "" if ok else "DataLoader workers pass batches through /dev/shm: give the container more "
                     "(docker run --shm-size=16g)")
        except OSError:
            self.add("/dev/shm", "WARN", "missing", "DataLoader workers need /dev/shm (shared memory)")
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            self.facts["open_files_limit"] = soft
            ok = soft >= 4096
            self.add("open-file limit", "PASS" if ok else "WARN", f"{soft} (hard {hard})",
                     "" if ok else "many workers share tensors through file descriptors: ulimit -n 65536")
        except (ImportError, OSError):
            pass

    def torch_settings(self, torch):
        if torch is None or not torch.cuda.is_available():
            return
        precision = torch.get_float32_matmul_precision()
        cudnn_tf32 = bool(torch.backends.cudnn.allow_tf32)
        major = torch.cuda.get_device_capability()[0]
        tf32_ok = major < 8 or precision != "highest"
        self.add("TF32 matmuls", "PASS" if tf32_ok else "WARN",
                 f"float32 matmul precision '{precision}', cuDNN TF32 {'on' if cudnn_tf32 else 'off'}",
                 "" if tf32_ok else "float32 matmuls skip the tensor cores: torch.set_float32_matmul_precision('high')"
                 " (or train with AMP)")
        queues = os.environ.get(cuda_queues.VARIABLE)
        wide = queues == cuda_queues.WIDEST
        by_us = " (set by hotloop at import)" if cuda_queues.set_by_hotloop else ""
        self.add("CUDA hardware queues", "PASS" if wide else "WARN", f"{queues or '8 (CUDA default)'}{by_us}",
                 "" if wide else "streams share fewer queues, and gpu_decode's work can wait behind the training "
                 f"step's (NOTE [ Hardware queues ] in hotloop/cuda_queues.py): {cuda_queues.VARIABLE}=32 "
                 "before CUDA starts, unless something else in the process needs fewer")
        bench = bool(torch.backends.cudnn.benchmark)
        self.add("cudnn.benchmark", "PASS", "on" if bench else "off",
                 "" if bench else "with fixed input shapes, torch.backends.cudnn.benchmark = True picks faster "
                 "convolution algorithms")

    def run(self):
        system = self.driver()
        torch = self.torch_versions(system)
        if system is not None:
            self.gpus(system, torch)
        self.kernels(system)
        for check in trust_checks.checks():  # the cache folder and the libraries: NOTE [ Trusted files ]
            self.add(*check)
        self.host(system, torch)
        self.torch_settings(torch)
        return self

    @property
    def exit_code(self):
        statuses = {c.status for c in self.checks}
        return 2 if "FAIL" in statuses else 1 if "WARN" in statuses else 0

    def to_dict(self):
        return {"exit_code": self.exit_code, "checks": [dataclasses.asdict(c) for c in self.checks],
                "facts": self.facts}


def _cuda_text(version):
    return "unknown" if not version else f"{version // 1000}.{version % 1000 // 10}"


def _torch_index(torch, uuid, nvml_index=None):
    """the torch device index of the NVML device with this UUID (CUDA_VISIBLE_DEVICES may reorder)"""
    for i in range(torch.cuda.device_count()):
        try:
            u = str(torch.cuda.get_device_properties(i).uuid)
        except Exception:
            break
        if uuid and u and uuid.endswith(u):
            return i
    # no UUIDs to match: the indices agree when nothing reorders or hides devices
    if nvml_index is not None and "CUDA_VISIBLE_DEVICES" not in os.environ \
            and nvml_index < torch.cuda.device_count():
        return nvml_index
    return None


def _pinned_bandwidth(torch, tindex, nvml_index, link):
    """Time host-to-device copies of 256 MB from pinned memory; read the link while they run."""
    device = torch.device("cuda", tindex)
    src = torch.empty(BANDWIDTH_BYTES, dtype=torch.uint8, pin_memory=True)
    src.fill_(0xA5)  # any non-zero pattern; the copy's speed does not depend on it
    dst = torch.empty(BANDWIDTH_BYTES, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    seen = dict(link)
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: the link trains up to speed
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
            end.record(stream)
            # the copies run now: this is when the link shows its real generation and width
            now = _C.nvml_device_info(nvml_index)["pcie"]
            for key in ("gen", "width"):
                if now.get(key) is not None and (seen.get(key) is None or now[key] > seen[key]):
                    seen[key] = now[key]
            end.synchronize()
            times.append(start.elapsed_time(end) / 4)
    times.sort()
    ms = times[len(times) // 2]
    del src, dst
    return BANDWIDTH_BYTES / (ms * 1e-3) / 1e9, seen


def format_checks(doctor):
    width = max(len(c.name) for c in doctor.checks)
    lines = []
    for c in doctor.checks:
        lines.append(f"[{c.status:<4}] {c.name:<{width}}  {c.value}")
        if c.advice:
            lines.append(f"       {'':<{width}}  -> {c.advice}")
    counts = {s: sum(c.status == s for c in doctor.checks) for s in ("PASS", "WARN", "FAIL", "SKIP")}
    lines.append(f"{counts['PASS']} passed, {counts['WARN']} warnings, {counts['FAIL']} failures, "
                 f"{counts['SKIP']} skipped")
    return "\n".join(lines)


def main(args) -> int:
    t0 = time.monotonic()
    doctor = Doctor().run()
    doctor.facts["seconds"] = round(time.monotonic() - t0, 2)
    if getattr(args, "json", False):
        print(json.dumps(doctor.to_dict(), indent=2))
    else:
        print(format_checks(doctor))
    sys.stdout.flush()
    return doctor.exit_code

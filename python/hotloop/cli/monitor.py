"""`python -m hotloop monitor`: an nvidia-smi -l like logger driven by the C samplers (the GPUs' and the
host's), with a summary at the end."""
import csv
import math
import signal
import sys
import time

from .. import _C
from ..memory.clock_reasons import reason_names
from ..memory.text import GiB
from ..memory.timeline import Timeline, host_records

COLUMNS = ["time", "gpu", "used_mib", "reserved_mib", "util_pct", "mem_util_pct", "power_w", "temp_c",
           "sm_mhz", "mem_mhz", "pcie_rx_mb_s", "pcie_tx_mb_s", "reasons", "jpeg_pct",
           # the host: the machine's available memory and swap in use; with --pid, that process tree's PSS
           "host_available_mib", "host_swap_used_mib", "tree_pss_mib", "tree_processes"]


def _positive(text):
    """A finite number > 0 (argparse says what was wrong otherwise)."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return value


_positive.__name__ = "positive number"  # argparse names the type in its message


def add_arguments(parser):
    parser.add_argument("--interval-ms", type=_positive, default=100.0, help="sampling and print period (default 100)")
    parser.add_argument("--device", type=int, action="append", help="NVML device index (repeatable; default all)")
    parser.add_argument("--csv", metavar="FILE", help="also write every row to this CSV file")
    parser.add_argument("--duration", type=_positive, metavar="S", help="stop after S seconds (default: until Ctrl-C)")
    parser.add_argument("--pid", type=_pid, help="also log the host memory (PSS) of this process and its descendants "
                        "(a training run and its DataLoader workers)")


def _pid(text):
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


_pid.__name__ = "process id"


def _value(raw, scale=1.0, digits=0):
    if raw is None or raw == _C.MONITOR_UNSUPPORTED:
        return ""
    return f"{raw * scale:.{digits}f}"


def _host_columns(host, pid):
    """the host columns from the host sampler's newest tick"""
    if host is None:
        return ["", "", "", ""]
    # the newest ticks, not the whole run's
    ticks = host_records(host.snapshot(since=time.monotonic() - 2e-3 * host.interval_ms)["host"])
    if not len(ticks):
        return ["", "", "", ""]
    h = ticks[-1]
    tree = [f"{h['tree_pss'] / 2**20:.0f}", str(h["processes"])] if pid is not None and h["processes"] else ["", ""]
    return [f"{h['available'] / 2**20:.0f}", f"{h['swap_used'] / 2**20:.0f}"] + tree


def _stamp(t):
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _row(t, index, tl):
    """one output row from the newest sample of each kind (GPU_COLUMNS values)"""
    used = reserved = ""
    if len(tl.memory):
        used, reserved = f"{tl.used[-1] / 2**20:.0f}", f"{tl.reserved[-1] / 2**20:.0f}"
    slow = tl.slow[-1] if len(tl.slow) else None
    pcie = tl.pcie[-1] if len(tl.pcie) else None
    return [_stamp(t), str(index), used, reserved,
            _value(slow["util_gpu"]) if slow is not None else "",
            _value(slow["util_memory"]) if slow is not None else "",
            _value(slow["power_mw"], 1e-3, 1) if slow is not None else "",
            _value(slow["temperature_c"]) if slow is not None else "",
            _value(slow["sm_clock_mhz"]) if slow is not None else "",
            _value(slow["memory_clock_mhz"]) if slow is not None else "",
            _value(pcie["rx_kb_per_s"], 1 / 1024, 0) if pcie is not None else "",
            _value(pcie["tx_kb_per_s"], 1 / 1024, 0) if pcie is not None else "",
            ",".join(reason_names(int(slow["reasons"]))) if slow is not None else "",
            _value(slow["util_jpeg"]) if slow is not None else ""]


GPU_COLUMNS = 14  # what _row gives: time, device, then the GPU's figures; the host's columns follow them


class _StopOnSignal:
    """SIGINT and SIGTERM end the logger at its next check, with the summary; a second one interrupts
    wherever it lands. Raising at the first would land anywhere too: inside the first row's lazy import
    of numpy it broke the import, or left Python to die of SIGINT at exit with nothing said."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.seen = False
        self.previous = {}

    def _handle(self, signum, frame):
        if self.seen:
            raise KeyboardInterrupt
        self.seen = True

    def install(self):
        for sig in self.SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # as a background job's SIGINT is: it stays so
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# how long the loop sleeps at most between looks at the stop flag: a signal only sets it
_STOP_CHECK_S = 0.05


def _pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _gpus(args):
    """The NVML devices to log: [] (the host alone, said on stderr) where NVML or a GPU is missing."""
    reason = _C.nvml_unavailable_reason()
    if reason is None and _C.nvml_system()["device_count"] == 0:
        reason = "NVML sees no GPU on this machine"
    if reason is not None:
        if args.device:
            print(f"hotloop monitor: --device given, but no GPU can be read ({reason})", file=sys.stderr)
            return None
        print(f"hotloop monitor: no GPU to watch ({reason}): logging the host alone, the GPU columns empty",
              file=sys.stderr)
        return []
    return args.device if args.device else list(range(_C.nvml_system()["device_count"]))


def main(args) -> int:
    devices = _gpus(args)
    if devices is None:
        return 2
    if args.pid is not None and not _pid_alive(args.pid):
        print(f"hotloop monitor: --pid {args.pid}: no such process; logging the machine's memory alone",
              file=sys.stderr)
    interval = args.interval_ms
    monitors = []
    for d in devices:
        try:
            # PCIe throughput blocks ~40 ms per reading: never ask for it faster than that
            monitors.append(_C.Monitor(d, interval, interval, max(interval, 100.0), 4096))
        except (ValueError, _C.NvmlError) as e:
            print(f"hotloop monitor: device {d}: {e}", file=sys.stderr)
            return 2
    writer = csv_file = None
    if args.csv:
        try:
            csv_file = open(args.csv, "w", newline="")
        except OSError as err:
            print(f"hotloop monitor: cannot write the --csv file {args.csv}: {err.strerror or err}", file=sys.stderr)
            return 2
        writer = csv.writer(csv_file)
        writer.writerow(COLUMNS)
    try:  # the host's columns: the machine, and with --pid that process's tree (NOTE [ Host sampling rate ])
        host = _C.HostSampler(max(interval, 10.0), max(interval, 10.0), 4096, args.pid is not None, 0.02,
                              args.pid or 0)
    except (OSError, ValueError):
        host = None
    line = "{:<12} {:>3} {:>9} {:>8} {:>5} {:>5} {:>8} {:>5} {:>6} {:>6} {:>8} {:>8} {:>5} {:>9} {:>8}  {}"
    header = line.format("time", "gpu", "used MiB", "rsvd MiB", "sm%", "mem%", "power W", "temp", "SM MHz",
                         "memMHz", "rx MB/s", "tx MB/s", "jpeg%", "avail MiB", "tree MiB", "clock-event reasons")
    t_start, wall_start = time.monotonic(), time.time()
    lines = 0
    status = 0
    pid_alive = args.pid is not None and _pid_alive(args.pid)
    stop = _StopOnSignal().install()
    try:
        for m in monitors:
            m.start()
        if host is not None:
            try:
                host.start()
            except OSError:
                host = None
        # --duration counts from when sampling began, not from the (possibly slow) set-up
        t_start, wall_start = time.monotonic(), time.time()
        end = None if args.duration is None else t_start + args.duration
        next_print = t_start + interval / 1000.0
        while not stop.seen:
            wake = next_print if end is None else min(next_print, end)
            time.sleep(max(0.0, min(wake - time.monotonic(), _STOP_CHECK_S)))
            if stop.seen or (end is not None and time.monotonic() >= end):
                break
            if time.monotonic() < wake:
                continue
            next_print += interval / 1000.0
            now = time.time()
            if lines % 20 == 0:
                print(header, flush=True)
            hosted = _host_columns(host, args.pid)
            if args.pid is not None and pid_alive and not _pid_alive(args.pid):
                pid_alive = False
                print(f"hotloop monitor: --pid {args.pid} exited; logging the machine's memory alone", file=sys.stderr)
            rows = [_row(now, d, Timeline(m.snapshot())) for d, m in zip(devices, monitors)]
            if not monitors:  # no GPU: the host's row, the GPU columns empty
                rows = [[_stamp(now)] + [""] * (GPU_COLUMNS - 1)]
            for row in rows:
                row = row + hosted
                print(line.format(*row[:12], row[13], row[14], row[16], row[12]), flush=True)  # the reasons last
                if writer:
                    writer.writerow(row)
            if csv_file:
                csv_file.flush()  # a full disk shows now, not at close
            lines += 1
    except KeyboardInterrupt:
        pass
    except OSError as err:
        if isinstance(err, BrokenPipeError) or csv_file is None:
            raise  # stdout's reader went away: the command line says so
        print(f"hotloop monitor: writing the --csv file {args.csv} failed: {err.strerror or err}", file=sys.stderr)
        status = 1
    finally:
        for m in monitors:
            m.stop()
        if host is not None:
            host.stop()
        stop.restore()
        if csv_file:
            try:
                csv_file.close()
            except OSError:
                pass  # said above
    if status:
        return status
    elapsed = time.monotonic() - t_start
    for d, m in zip(devices, monitors):
        s = m.snapshot()
        util = "-" if s["util_mean"] < 0 else f"{s['util_mean']:.0f}%"
        power = "-" if s["power_mean_w"] < 0 else f"{s['power_mean_w']:.0f}/{(s['power_max_mw'] or 0) / 1e3:.0f} W"
        temp = "-" if s["temperature_max_c"] is None else f"{s['temperature_max_c']} C"
        reasons = ", ".join(reason_names(s["reasons_seen"])) or "none"
        errors = f"; {s['error']['count']} NVML errors ({s['error']['text']})" if s["error"] else ""
        print(f"summary gpu {d}: {elapsed:.1f} s from {time.strftime('%H:%M:%S', time.localtime(wall_start))}, "
              f"{s['memory_samples']} samples, peak used {s['peak_used'] / GiB:.2f} GiB, util mean {util}, "
              f"power mean/max {power}, temp max {temp}, reasons {reasons}{errors}", flush=True)
    if host is not None and args.pid is not None:  # the machine's figures are in the rows; the tree's summed up
        s = host.snapshot()
        tree = (f", tree of pid {args.pid}: peak {s['peak_tree_pss'] / GiB:.2f} GiB (PSS) in {s['peak_processes']} "
                f"processes" if s["peak_tree_pss"] else f", pid {args.pid} not seen")
        print(f"summary host: available at least {s['min_available'] / GiB:.2f} of {s['total'] / GiB:.2f} GiB, "
              f"swap used at most {s['max_swap_used'] / GiB:.2f} GiB{tree}", flush=True)
    return 0

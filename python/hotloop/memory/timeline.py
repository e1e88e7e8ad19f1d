"""The monitor's samples as numpy arrays: what the C sampler kept, decoded."""
from .. import _C

def _dtypes():
    import numpy as np

    memory = np.dtype([("t", "<f8"), ("used", "<u8"), ("reserved", "<u8"), ("free", "<u8")])
    slow = np.dtype([("t", "<f8"), ("util_gpu", "<u4"), ("util_memory", "<u4"), ("power_mw", "<u4"),
                     ("temperature_c", "<u4"), ("sm_clock_mhz", "<u4"), ("memory_clock_mhz", "<u4"),
                     ("reasons", "<u8"), ("util_jpeg", "<u4"), ("unused", "<u4")])
    pcie = np.dtype([("t", "<f8"), ("rx_kb_per_s", "<u4"), ("tx_kb_per_s", "<u4")])
    assert (memory.itemsize, slow.itemsize, pcie.itemsize) == (
        _C.MONITOR_MEMORY_SAMPLE_BYTES, _C.MONITOR_SLOW_SAMPLE_BYTES, _C.MONITOR_PCIE_SAMPLE_BYTES)
    return memory, slow, pcie


def _host_dtypes():
    import numpy as np

    host = np.dtype([("t", "<f8"), ("tree_pss", "<u8"), ("tree_rss", "<u8"), ("tree_uss", "<u8"), ("tree_swap", "<u8"),
                     ("main_pss", "<u8"), ("main_rss", "<u8"), ("main_locked", "<u8"), ("available", "<u8"),
                     ("swap_used", "<u8"), ("processes", "<u4"), ("unreadable", "<u2"), ("whole", "<u2")])
    procs = np.dtype([("t", "<f8"), ("pid", "<i4"), ("ppid", "<i4"), ("rss", "<u8"), ("pss", "<u8"), ("uss", "<u8"),
                      ("swap", "<u8")])
    assert (host.itemsize, procs.itemsize) == (_C.HOST_SAMPLE_BYTES, _C.HOST_PROC_SAMPLE_BYTES)
    return host, procs


def host_records(raw):
    """The host sampler's packed per-tick records (snapshot()["host"]) as a numpy structured array."""
    import numpy as np

    return np.frombuffer(raw, dtype=_host_dtypes()[0])


class Timeline:
    """The kept samples as numpy arrays; times in seconds since the monitor started.

    memory: time, used, reserved, free (bytes); slow: slow_time, util_gpu (%), util_jpeg (% of the
    JPEG engines), power_w, temperature_c, sm_clock_mhz, reasons; pcie: pcie_time, pcie_rx_mb_s, pcie_tx_mb_s. Readings the
    device does not offer are NaN. `.memory`, `.slow`, `.pcie` hold the raw structured arrays.

    host (the host sampler's ticks): host_time, host_tree_pss (this process and its workers, PSS),
    host_main_pss, host_available, host_swap_used (bytes); `.host` and `.procs` (a record per process
    per tick: t, pid, ppid, rss, pss, uss, swap) hold the raw arrays.
    """

    def __init__(self, snapshot=None, t0=0.0, host=None):
        import numpy as np

        memory_dtype, slow_dtype, pcie_dtype = _dtypes()
        snapshot = snapshot or {"memory": b"", "slow": b"", "pcie": b""}
        self.memory = np.frombuffer(snapshot["memory"], dtype=memory_dtype)
        self.slow = np.frombuffer(snapshot["slow"], dtype=slow_dtype)
        self.pcie = np.frombuffer(snapshot["pcie"], dtype=pcie_dtype)
        self.time = self.memory["t"] - t0
        self.used = self.memory["used"]
        self.reserved = self.memory["reserved"]
        self.free = self.memory["free"]

        def readings(field, scale=1.0):
            raw = self.slow[field]
            return np.where(raw == _C.MONITOR_UNSUPPORTED, np.nan, raw.astype(np.float64) * scale)

        self.slow_time = self.slow["t"] - t0
        self.util_gpu = readings("util_gpu")
        self.util_jpeg = readings("util_jpeg")
        self.power_w = readings("power_mw", 1e-3)
        self.temperature_c = readings("temperature_c")
        self.sm_clock_mhz = readings("sm_clock_mhz")
        self.reasons = self.slow["reasons"]
        self.pcie_time = self.pcie["t"] - t0
        self.pcie_rx_mb_s = self.pcie["rx_kb_per_s"].astype(np.float64) / 1024.0
        self.pcie_tx_mb_s = self.pcie["tx_kb_per_s"].astype(np.float64) / 1024.0
        host_dtype, procs_dtype = _host_dtypes()
        host = host or {"host": b"", "procs": b""}
        self.host = np.frombuffer(host["host"], dtype=host_dtype)
        self.procs = np.frombuffer(host["procs"], dtype=procs_dtype)
        self.host_time = self.host["t"] - t0
        self.host_tree_pss = self.host["tree_pss"]
        self.host_main_pss = self.host["main_pss"]
        self.host_available = self.host["available"]
        self.host_swap_used = self.host["swap_used"]

    def __len__(self):
        return len(self.memory)

    def __repr__(self):
        return (f"Timeline({len(self.memory)} memory, {len(self.slow)} slow, {len(self.pcie)} pcie, "
                f"{len(self.host)} host samples)")

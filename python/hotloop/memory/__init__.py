"""hotloop.memory_monitor: monitor.py holds MemoryMonitor and the decorator; report.py the report
(text.py, plot.py its forms), advice.py what it advises, hooks.py the per-module hooks, ranks.py
every rank's figures under torch.distributed, timeline.py and clock_reasons.py what the C sampler's
samples mean. Imports no torch until used."""
from .monitor import MemoryMonitor, memory_monitor
from .report import MemoryReport, ModuleMemory
from .timeline import Timeline

__all__ = ["MemoryMonitor", "MemoryReport", "ModuleMemory", "Timeline", "memory_monitor"]

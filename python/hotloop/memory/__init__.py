"""hotloop.memory_monitor: monitor.py holds MemoryMonitor, decorator.py the decorator; report.py the
report (text.py, plot.py its forms), advice.py what it advises, hooks.py the per-module hooks, ranks.py
every rank's figures under torch.distributed, host.py the host's memory, timeline.py and
clock_reasons.py what the C samplers' samples mean; batch_size.py find_max_batch_size (batch_search.py
its search). Imports no torch until used."""
from .decorator import memory_monitor
from .monitor import MemoryMonitor
from .report import MemoryReport, ModuleMemory
from .timeline import Timeline

__all__ = ["MemoryMonitor", "MemoryReport", "ModuleMemory", "Timeline", "memory_monitor"]

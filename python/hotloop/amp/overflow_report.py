"""hotloop.GradScaler.overflow_report: which parameter's gradient was the first non-finite one in the
last skipped step, read from the report each check kernel writes per optimizer and device."""
import dataclasses

import torch

from .. import _C


@dataclasses.dataclass
class OverflowReport:
    """The first parameter whose gradient was non-finite in the last skipped step."""

    step: int  # the scaler's update count at that step (0 = before the first update)
    optimizer: int  # which optimizer, in the order the scaler first saw them
    param_index: int  # flat index over the optimizer's param_groups
    param_group: int
    index_in_group: int
    name: str | None
    shape: tuple
    dtype: torch.dtype
    overflows: int  # checks of this optimizer that found a non-finite gradient

    def __str__(self):
        who = f"parameter {self.param_index}" + (f" ({self.name})" if self.name else "")
        return (f"step {self.step}: the first non-finite gradient was {who}, group {self.param_group} "
                f"index {self.index_in_group}, shape {list(self.shape)}, {str(self.dtype).replace('torch.', '')}"
                f" (optimizer {self.optimizer}; {self.overflows} overflow(s) seen)")


def first(caches, names):
    """The OverflowReport of the latest skipped step over `caches` ({optimizer: the scaler's
    OptimizerCache}), naming parameters by `names` ({id(parameter): name}); None if none was skipped."""
    best = None
    for optimizer, cache in list(caches.items()):
        for report in cache.reports.values():  # one per device the optimizer's gradients live on
            report = report.tolist()
            param, step, count = (report[i] for i in (_C.AMP_REPORT_PARAM, _C.AMP_REPORT_STEP, _C.AMP_REPORT_COUNT))
            if count == 0 or param < 0:
                continue
            if best is None or step > best[0] or (step == best[0] and cache is best[2] and param < best[3]):
                best = (step, optimizer, cache, param, count)
    if best is None:
        return None
    step, optimizer, cache, param, count = best
    group, within, flat = 0, param, 0
    for gi, g in enumerate(optimizer.param_groups):
        if param < flat + len(g["params"]):
            group, within = gi, param - flat
            break
        flat += len(g["params"])
    p = cache.params[param] if param < len(cache.params) else None
    return OverflowReport(step=step, optimizer=cache.number, param_index=param, param_group=group,
                          index_in_group=within, name=names.get(id(p)) if p is not None else None,
                          shape=tuple(p.shape) if p is not None else (), dtype=p.dtype if p is not None else None,
                          overflows=count)

"""What hotloop's optimizers share: torch's fused-optimizer protocol (a GradScaler hands grad_scale and
found_inf to step()), float32-only param groups, the kernels' step tables, and the param-group keys a
pickle from an older torch may lack."""
import torch

from . import param_table
from .step_table import StepTables


class FusedOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True
    _name = "FusedOptimizer"

    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        self._tables = StepTables(self._name)

    def _group_defaults(self):
        """{param-group key: the value a group of an older pickle gets}"""
        return {}

    def add_param_group(self, param_group):
        """torch's, refusing up front what the kernel cannot update (TypeError): anything but float32."""
        param_table.check_group_dtypes(self._name, param_group)
        super().add_param_group(param_group)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._tables = StepTables(self._name)
        defaults = self._group_defaults()
        for group in self.param_groups:
            for key, value in defaults.items():
                group.setdefault(key, value)

    def _begin_step(self, closure, grad_scale, found_inf):
        """(the closure's loss or None, grad_scale, found_inf): the keyword arguments, else what a GradScaler
        set on the optimizer (``self.grad_scale``, ``self.found_inf``, torch's protocol)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        return loss, grad_scale, found_inf

    def _collect(self, gi, group):
        """The parameters of one group that have gradients, checked; raises before anything changes."""
        found = []
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if not param_table.param_and_grad_plain(p, g):
                param_table.check_param(self._name, (gi, pi), p)
            found.append(p)
        return found

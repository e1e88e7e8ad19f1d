"""What hotloop's optimizers share: torch's fused-optimizer protocol (a GradScaler hands grad_scale and
found_inf to step()), param groups of float32, float16 and bfloat16 parameters, the step itself (checks,
state, the kernels' tables, one C call per device), and the param-group keys a pickle from an older torch
may lack.

A step's host time is mostly reading tensors' attributes, a few per parameter. So a step first reads
each group's key (group_key.py: addresses, shapes, strides, dtypes and state identities, in one pass);
while it equals the key of the step that last checked everything, that step's checks, device grouping
and tables stand, and the step only launches. Otherwise every parameter is checked, missing state made,
the key read again and the tables written."""
import torch

from ..amp.tensor_table import runs_eagerly
from . import param_table, torch_cpu_step
from .group_key import group_key
from .step_table import StepTables, capturing


class FusedOptimizer(torch.optim.Optimizer):
    """The base of hotloop's optimizers. Each also subclasses the torch optimizer it replaces (Adam(
    FusedOptimizer, torch.optim.Adam)), so that code dispatching on type takes torch's path for it; this
    class comes first in the MRO and owns __init__, __setstate__, add_param_group and step, calling
    torch.optim.Optimizer's own __init__ and __setstate__ (torch's subclasses' ones would check their
    arguments for their own kernels and convert state in their own way)."""

    _step_supports_amp_scaling = True
    _name = "FusedOptimizer"

    def __init__(self, params, defaults):
        torch.optim.Optimizer.__init__(self, params, defaults)
        self._reset_caches()

    def _reset_caches(self):
        self._tables = StepTables(self._name)
        self._plans = {}  # param group index -> (key, [(device, params with gradients there)])
        self._torch_steps = set()  # (group index, device) whose checked plan torch's CPU kernel steps
        self._per_plan_of = {}  # id(a current plan's params list) -> (that list, {what: _per_plan's value})

    # what a subclass says about its kernel
    def _group_defaults(self):
        """{param-group key: the value a group of an older pickle gets}"""
        return {}

    def _state_keys(self, group):
        """the state tensors of a parameter of `group` that the kernel reads"""
        raise NotImplementedError

    def _hyper(self, group, device, capture):
        """the kernel's hyperparameters of `group` for the parameters on `device`, checked"""
        raise NotImplementedError

    def _check_capture(self, group, ps):
        """raise (refuse_in_capture) when a step of `ps` would make or convert state: a graph would replay it"""

    def _make_state(self, group, ps):
        """make whatever state of `ps` does not exist yet; returns what _launch takes as `made`"""
        raise NotImplementedError

    def _write_table(self, group, ps, dst):
        """the kernel's entries of `ps` into `dst` (after checking their state): (count, chunks, device)"""
        raise NotImplementedError

    def _entry_bytes(self):
        raise NotImplementedError

    def _launch(self, table, count, chunks, device, hyper, made, scale, found):
        raise NotImplementedError

    def _states_of(self, group, p):
        """the state tensors of `p` its update reads and writes (torch_cpu_step checks their layout)"""
        return [self.state[p][k] for k in self._state_keys(group) if k != "step"]

    def _torch_step(self, group, ps, hyper, made, scale, found):
        """step `ps` (CPU tensors) with torch's fused kernel; False when this step must stay hotloop's"""
        raise NotImplementedError

    def _per_plan(self, ps, what, make):
        """make(), made once per checked plan and `what`: while a step reuses the plan (`ps` is its list),
        the group's key held the identity and address of every state tensor, so what was read from them
        stands (the lists of state tensors torch's kernel takes, the table of their step counts)."""
        cached = self._per_plan_of.get(id(ps))
        if cached is None or cached[0] is not ps:
            cached = self._per_plan_of[id(ps)] = (ps, {})
        made = cached[1]
        if what not in made:
            made[what] = make()
        return made[what]

    def _state_lists(self, ps, names):
        """[[self.state[p][name] for p in ps] for name in names], once per checked plan (_per_plan)."""
        return self._per_plan(ps, names, lambda: [[self.state[p][name] for p in ps] for name in names])

    def _torch_takes(self, group, device, ps):
        """NOTE [ CPU steps of large tensors go to torch ] (torch_cpu_step.py)"""
        return device.type == "cpu" and torch_cpu_step.torch_takes(ps, [self._states_of(group, p) for p in ps])

    def add_param_group(self, param_group):
        """torch's, refusing up front what the kernel cannot update (TypeError): anything but float32, float16
        and bfloat16."""
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a set: torch's own error names it
            # read once, here: a generator (module.parameters()) would be empty when torch's turn came
            param_group["params"] = list(params)
        param_table.check_group_dtypes(self._name, param_group)
        super().add_param_group(param_group)

    def __setstate__(self, state):
        torch.optim.Optimizer.__setstate__(self, state)
        self._reset_caches()
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

    def _plan(self, gi, group, keys):
        """(key or None, [(device, params)]) of one group's step: the last checked step's while the group's
        key equals its key, else every parameter checked (key None: the state is made and the key read
        after every check of the step has passed)."""
        key = group_key(self.state, group["params"], keys)
        cached = self._plans.get(gi)
        if key is not None and cached is not None and cached[0] == key:
            return key, cached[1]
        return None, list(param_table.by_device(self._collect(gi, group)).items())

    @runs_eagerly  # addresses go to C: under torch.compile a graph break, as torch's own fused step takes
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """One optimizer step. ``grad_scale`` (one float32 on the parameters' device) divides every
        gradient inside the update; with a non-zero ``found_inf`` nothing changes. Without the keyword
        arguments the ones a GradScaler set on the optimizer (``self.grad_scale``, ``self.found_inf``, torch's
        protocol) are used. No host sync."""
        loss, grad_scale, found_inf = self._begin_step(closure, grad_scale, found_inf)

        # every check first: a bad parameter or argument raises before any state or parameter changes
        work = []
        for gi, group in enumerate(self.param_groups):
            keys = self._state_keys(group)
            key, plan = self._plan(gi, group, keys)
            calls = []
            for device, ps in plan:
                capture = capturing(device)
                if key is None and capture:
                    self._check_capture(group, ps)
                calls.append((device, ps, self._hyper(group, device, capture),
                              param_table.scaler_tensor(grad_scale, "grad_scale", device),
                              param_table.scaler_tensor(found_inf, "found_inf", device)))
            if calls:
                work.append((gi, group, keys, key, plan, calls))

        for gi, group, keys, key, plan, calls in work:
            made = {}
            if key is None:
                made = {device: self._make_state(group, ps) for device, ps in plan}
                key = group_key(self.state, group["params"], keys)
                if key is None:  # cannot happen once the state is made: never reuse what is not keyed
                    key = object()
                self._plans[gi] = (key, plan)
                self._per_plan_of.clear()  # what plans no step uses any more held goes too
                for device, ps in plan:
                    self._torch_steps.discard((gi, device))
                    if self._torch_takes(group, device, ps):
                        self._torch_steps.add((gi, device))
            for device, ps, hyper, scale, found in calls:
                if (gi, device) in self._torch_steps and self._torch_step(group, ps, hyper, made.get(device), scale,
                                                                          found):
                    continue
                table, count, chunks = self._tables.get((gi, device), key, device, len(ps) * self._entry_bytes(),
                                                        lambda dst: self._write_table(group, ps, dst))
                self._launch(table, count, chunks, device, hyper, made.get(device), scale, found)
        return loss

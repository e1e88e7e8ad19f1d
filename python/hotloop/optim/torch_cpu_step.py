"""Which CPU steps torch's own fused kernels take instead of hotloop's C, and the calls that hand them over.

NOTE [ CPU steps of large tensors go to torch ]
On the CPU an optimizer step is a pass over memory; what differs between hotloop's C and torch's fused
CPU kernels is the cost around the pass. torch dispatches each tensor on its own (a few microseconds
each), which hotloop's single C call over one table avoids: for many small tensors hotloop's step is the
faster one. For large tensors that cost vanishes, and another one shows: the step runs right after
torch's own ops (the backward pass, the scaler's), whose OpenMP threads keep spinning on the cores for
a while after each op; hotloop's pool threads then share those cores with them, torch's kernels run on
those very threads. So a parameter set whose tensors average at least LARGE_TENSOR_ELEMENTS elements
goes to torch's fused kernel, the rest to hotloop's C. Both update in float and round once on store;
their results agree within the rounding of the last bit (tests/optim compare each with torch).

torch's kernels take what torch.optim's fused step takes: a gradient of its parameter's dtype, and
contiguous tensors. torch's kernel skips a step only for found_inf == 1.0, where hotloop skips on any
non-zero value: found_inf, a CPU tensor here, is read first (which waits for nothing on a CPU), and a
skipped step calls no kernel. A first SGD step with momentum (buffers that take the gradient) stays
with hotloop's C, which made the buffers. torch.optim adds one to each step count with one dispatch
per tensor; StepCounter does it in one C call.
"""
import functools

import torch

from .. import _C
from ..amp import tensor_table

# below this mean size per tensor torch's per-tensor dispatch is a visible share of the pass
LARGE_TENSOR_ELEMENTS = 1 << 16


@functools.lru_cache(maxsize=None)
def torch_has_cpu_fused_kernels() -> bool:
    """torch's fused Adam/AdamW/SGD kernels run on the CPU (torch >= 2.4); probed once on 4 elements."""
    try:
        one = [torch.zeros(4)]
        torch._fused_sgd_(one, [torch.zeros(4)], [], weight_decay=0.0, momentum=0.0, lr=0.0, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False, grad_scale=None, found_inf=None)
        torch._fused_adamw_(one, [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4)], [],
                            [torch.zeros(())], lr=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8,
                            amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):
        return False
    return True


def torch_takes(params, states) -> bool:
    """True when torch's fused CPU kernel should step `params` (CPU tensors with gradients), whose state
    tensors are `states` (one list per parameter): large on average, and in the layout torch's kernel
    takes. Decided once per checked plan (fused.py), not per step."""
    if not params or not torch_has_cpu_fused_kernels():
        return False
    if sum(p.numel() for p in params) < LARGE_TENSOR_ELEMENTS * len(params):
        return False
    for p, state in zip(params, states, strict=True):
        g = p.grad
        if g.dtype is not p.dtype or not p.is_contiguous() or not g.is_contiguous():
            return False
        if any(t.dtype is not p.dtype or not t.is_contiguous() for t in state):
            return False
    return True


def skipped(found_inf) -> bool:
    """Whether a GradScaler's found_inf (a one-element tensor on the CPU, or None) skips the step: any
    non-zero value, as hotloop's own kernels read it (torch's skip only for 1.0). On the CPU reading it
    waits for nothing."""
    return found_inf is not None and found_inf.item() != 0


class StepCounter:
    """The step counts of a plan's parameters, added to as torch._foreach_add_(steps, 1) adds: in one C
    call over their table where they are one-element float32 CPU tensors (what torch's optimizers make),
    else by torch, which dispatches each (a microsecond or so per tensor). Made once per checked plan:
    the group's key holds each count's address."""

    def __init__(self, steps):
        self.steps = steps
        plain = steps and all(t.dtype is torch.float32 and t.numel() == 1 and t.device.type == "cpu" for t in steps)
        self._table = tensor_table.packed_bytes(steps) if plain else None

    def count(self):
        if self._table is None:
            torch._foreach_add_(self.steps, 1)
        else:
            _C.optim_count_steps(self._table)


def adam_step(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, counter, hyper, grad_scale, found_inf):
    """One Adam/AdamW step by torch's fused CPU kernel, the step counts (a StepCounter) moved as
    torch.optim moves them. `hyper`: Adam._hyper's AdamHyper."""
    if skipped(found_inf):
        return  # nothing changes, the step counts included
    h = hyper
    kernel = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    counter.count()
    kernel(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, max_exp_avg_sqs or [], counter.steps,
           lr=h.lr_tensor if h.lr_tensor is not None else h.lr, beta1=float(h.beta1), beta2=float(h.beta2),
           weight_decay=h.weight_decay, eps=h.eps, amsgrad=max_exp_avg_sqs is not None, maximize=h.maximize,
           grad_scale=grad_scale, found_inf=None)


def sgd_step(params, buffers, hyper, grad_scale, found_inf):
    """One SGD step (not a first step with momentum) by torch's fused CPU kernel. `hyper`: SGD._hyper's
    SGDHyper."""
    if skipped(found_inf):
        return
    h = hyper
    torch._fused_sgd_(params, [p.grad for p in params], buffers or [], weight_decay=float(h.weight_decay),
                      momentum=h.momentum, lr=h.lr_tensor if h.lr_tensor is not None else h.lr,
                      dampening=h.dampening, nesterov=h.nesterov, maximize=h.maximize, is_first_step=False,
                      grad_scale=grad_scale, found_inf=None)

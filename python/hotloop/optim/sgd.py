"""hotloop.optim.SGD: a drop-in for torch.optim.SGD(fused=True) (momentum, dampening, nesterov, weight decay,
maximize).

Same arguments, defaults, param_groups and state (``momentum_buffer`` per parameter with momentum, in its
dtype, none without; float32, float16 or bfloat16 parameters as hotloop.optim.Adam takes them), one C call per device, and the GradScaler's ``grad_scale`` / ``found_inf`` taken inside the
update as hotloop.optim.Adam takes them. The buffers of a first step take the gradient as it is, as
torch's; they are zero-filled when made, so a first step that found_inf skips leaves zeros (torch's are
uninitialised then), and the next step is not a first step.

The step can be captured in a CUDA graph after one step outside it (the buffers then exist; a first step
in a capture is refused), with ``lr`` a number (a constant of the graph) or a float32 tensor on the GPU.
"""
from typing import NamedTuple, Optional

import torch

from .. import _C
from . import param_table, torch_cpu_step
from .fused import FusedOptimizer
from .step_table import refuse_in_capture


class SGDHyper(NamedTuple):
    """One group's hyperparameters for the parameters on one device, named as _C.optim_sgd's keywords."""

    lr: float
    lr_tensor: Optional[torch.Tensor]  # read by the kernel when it runs; None: `lr`
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool


class SGD(FusedOptimizer, torch.optim.SGD):
    """torch.optim.SGD(fused=True), updated by hotloop's kernel; an instance of torch.optim.SGD.
    ``differentiable=True`` is refused."""

    _name = "SGD"

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *, maximize=False,
                 foreach=None, differentiable=False, fused=None):
        # torch's messages, so that code catching them keeps working
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if differentiable:
            raise ValueError("SGD: differentiable=True is not supported by hotloop's fused kernel")
        if foreach:
            raise ValueError("SGD: foreach and fused cannot both be True (hotloop's is fused)")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=None, differentiable=False, fused=True)
        super().__init__(params, defaults)

    def _group_defaults(self):
        return dict(nesterov=False, maximize=False, foreach=None, differentiable=False, fused=True)

    def _state_keys(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _hyper(self, group, device, capture):
        lr, lr_tensor = param_table.lr_args(group["lr"], device, capture)
        return SGDHyper(lr=lr, lr_tensor=lr_tensor, momentum=float(group["momentum"]),
                        dampening=float(group["dampening"]),
                        weight_decay=param_table.host_scalar(group["weight_decay"], "weight_decay", capture),
                        nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]))

    def _check_capture(self, group, ps):
        if group["momentum"] != 0 and any(self.state.get(p, {}).get("momentum_buffer") is None for p in ps):
            refuse_in_capture(self._name, "the momentum buffers are made at the first step, and making "
                              "them (and taking the gradient as the buffer) would be replayed")

    def _make_state(self, group, ps):
        """whether this is a first step (torch's rule: no parameter of the call has a buffer yet), after
        making the missing buffers"""
        if group["momentum"] == 0:
            return False
        first_step = all(self.state[p].get("momentum_buffer") is None for p in ps)
        for p in ps:
            if self.state[p].get("momentum_buffer") is None:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return first_step

    def _write_table(self, group, ps, dst):
        """The kernel's entries into `dst`, after checking the momentum buffers (only when the group's key
        changed: a new table); a bad one raises before any parameter changes."""
        bufs = None
        if group["momentum"] != 0:
            bufs = [self.state[p]["momentum_buffer"] for p in ps]
            for p, buf in zip(ps, bufs):
                param_table.check_state(self._name, p, buf, "momentum_buffer")
            bufs = param_table.pack(bufs)
        return _C.optim_sgd_table(param_table.pack(ps), param_table.pack([p.grad for p in ps]), bufs, dst)

    def _entry_bytes(self):
        return _C.OPTIM_SGD_ENTRY_BYTES

    def _torch_step(self, group, ps, hyper, made, scale, found):
        if made:  # a first step: the buffers take the gradient, hotloop's C does that
            return False
        bufs = self._state_lists(ps, ("momentum_buffer",))[0] if group["momentum"] != 0 else None
        torch_cpu_step.sgd_step(ps, bufs, hyper, scale, found)
        return True

    def _launch(self, table, count, chunks, device, hyper, made, scale, found):
        # made: _make_state's first_step, None when the step reused a checked plan (the buffers existed)
        h = hyper
        index = -1 if device.type == "cpu" else device.index
        _C.optim_sgd(table=table, count=count, total_chunks=chunks, device=index,
                     lr=h.lr, lr_tensor=h.lr_tensor, momentum=h.momentum, dampening=h.dampening,
                     weight_decay=h.weight_decay, nesterov=h.nesterov, maximize=h.maximize, first_step=bool(made),
                     grad_scale=scale, found_inf=found, stream=param_table.stream_of(device),
                     threads=param_table.threads_of(device))

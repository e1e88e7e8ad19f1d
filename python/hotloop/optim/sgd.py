"""hotloop.optim.SGD: a drop-in for torch.optim.SGD(fused=True) (momentum, dampening, nesterov, weight decay,
maximize).

Same arguments, defaults, param_groups and state (``momentum_buffer`` per parameter with momentum, none
without), one C call per device, and the GradScaler's ``grad_scale`` / ``found_inf`` taken inside the
update as hotloop.optim.Adam takes them. The buffers of a first step take the gradient as it is, as
torch's; they are zero-filled when made, so a first step that found_inf skips leaves zeros (torch's are
uninitialised then), and the next step is not a first step.

The step can be captured in a CUDA graph after one step outside it (the buffers then exist; a first step
in a capture is refused), with ``lr`` a number (a constant of the graph) or a float32 tensor on the GPU.
"""
import torch

from .. import _C
from . import param_table
from .fused import FusedOptimizer
from .step_table import capturing, refuse_in_capture


class SGD(FusedOptimizer):
    """torch.optim.SGD(fused=True), updated by hotloop's kernel; ``differentiable=True`` is refused."""

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

    def _write_table(self, ps, momentum, dst):
        """The kernel's entries into `dst`, after checking the momentum buffers (only when step_key changed:
        a new table); a bad one raises before any parameter changes."""
        bufs = None
        if momentum:
            bufs = [self.state[p]["momentum_buffer"] for p in ps]
            for p, buf in zip(ps, bufs):
                param_table.check_state(self._name, p, buf, "momentum_buffer")
            bufs = param_table.pack(bufs)
        return _C.optim_sgd_table(param_table.pack(ps), param_table.pack([p.grad for p in ps]), bufs, dst)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """One optimizer step; ``grad_scale`` and ``found_inf`` (or the ones a GradScaler set on the
        optimizer) as hotloop.optim.Adam.step takes them. No host sync."""
        loss, grad_scale, found_inf = self._begin_step(closure, grad_scale, found_inf)

        work = []  # every check first: nothing changes when one fails
        for gi, group in enumerate(self.param_groups):
            params = self._collect(gi, group)
            if not params:
                continue
            for device, ps in param_table.by_device(params).items():
                capture = capturing(device)
                lr, lr_tensor = param_table.lr_args(group["lr"], device, capture)
                hyper = (lr, lr_tensor, float(group["momentum"]), float(group["dampening"]),
                         param_table.host_scalar(group["weight_decay"], "weight_decay", capture),
                         bool(group["nesterov"]), bool(group["maximize"]))
                if capture and group["momentum"] != 0 and \
                        any(self.state.get(p, {}).get("momentum_buffer") is None for p in ps):
                    refuse_in_capture(self._name, "the momentum buffers are made at the first step, and making "
                                      "them (and taking the gradient as the buffer) would be replayed")
                work.append((gi, device, ps, hyper, param_table.scaler_tensor(grad_scale, "grad_scale", device),
                             param_table.scaler_tensor(found_inf, "found_inf", device)))

        for gi, device, ps, hyper, scale, found in work:
            momentum, first_step = hyper[2] != 0, False
            if momentum:
                # torch's rule: a first step when no parameter of the call has a buffer yet
                first_step = all(self.state[p].get("momentum_buffer") is None for p in ps)
                for p in ps:
                    if self.state[p].get("momentum_buffer") is None:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states = [self.state[p] for p in ps] if momentum else [None] * len(ps)
            key = param_table.step_key(ps, states, ("momentum_buffer",) if momentum else ())
            table, count, chunks = self._tables.get((gi, device), key, device, len(ps) * _C.OPTIM_SGD_ENTRY_BYTES,
                                                    lambda dst: self._write_table(ps, momentum, dst))
            _C.optim_sgd(table, count, chunks, -1 if device.type == "cpu" else device.index, *hyper, first_step,
                         scale, found, param_table.stream_of(device))
        return loss

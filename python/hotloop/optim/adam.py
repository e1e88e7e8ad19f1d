"""hotloop.optim.Adam and AdamW: drop-ins for torch.optim.Adam/AdamW(fused=True).

Same arguments and defaults, the same param_groups and the same state per parameter (``step`` a
float32 tensor on the parameter's device, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with
amsgrad, in the parameter's dtype), so checkpoints load both ways. Parameters may be float32, float16 or
bfloat16, with gradients of their dtype (float32 ones also take float16/bfloat16 gradients); every value is
updated in float and rounded once on store, as torch's fused kernels do. One C call per device updates every
parameter (the C reference on CPU tensors, vectorised and on torch.get_num_threads() threads; two kernel
launches on CUDA). With a GradScaler (``_step_supports_amp_scaling``)
the gradients are divided by ``grad_scale`` inside the update and never written back, and a non-zero
``found_inf`` leaves parameters, moments and step counts as they were; both are decided on the device.

The step can be captured in a CUDA graph whatever ``capturable`` says (the step counts, bias corrections,
grad_scale, found_inf and a tensor ``lr`` are read on the device): take one step outside the capture first,
so that the state exists and the kernels' table is uploaded (step_table.py says what a capture refuses).
A float ``lr`` is a constant of the graph, as in torch; pass a float32 tensor on the GPU to change it
between replays.
"""
from typing import NamedTuple, Optional

import torch

from .. import _C
from . import param_table, torch_cpu_step
from .fused import FusedOptimizer
from .step_table import refuse_in_capture


# the state tensors of a parameter the kernel reads, by amsgrad; the step count last (its checks are _state_of's)
_STATE_KEYS = {False: ("exp_avg", "exp_avg_sq", "step"), True: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")}


class AdamHyper(NamedTuple):
    """One group's hyperparameters for the parameters on one device, named as _C.optim_adam's keywords."""

    lr: float
    lr_tensor: Optional[torch.Tensor]  # read by the kernel when it runs; None: `lr`
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW
    maximize: bool


class Adam(FusedOptimizer, torch.optim.Adam):
    """torch.optim.Adam(fused=True), updated by hotloop's kernel; an instance of torch.optim.Adam. ``foreach``,
    ``fused`` and ``capturable`` are kept in param_groups for torch's sake; ``differentiable=True`` is
    refused."""

    _name = "Adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False):
        self._check_hyper(lr, betas, eps, weight_decay)
        if differentiable:
            raise ValueError(f"{self._name}: differentiable=True is not supported by hotloop's fused kernel")
        if foreach:
            raise ValueError(f"{self._name}: foreach and fused cannot both be True (hotloop's is fused)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=None, capturable=capturable, differentiable=False, fused=True,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)

    def _check_hyper(self, lr, betas, eps, weight_decay):
        # torch's messages, so that code catching them keeps working
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")

    def _group_defaults(self):
        return dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=True,
                    decoupled_weight_decay=self._name == "AdamW")

    def _state_keys(self, group):
        return _STATE_KEYS[bool(group["amsgrad"])]

    def _hyper(self, group, device, capture):
        beta1, beta2 = group["betas"]
        lr, lr_tensor = param_table.lr_args(group["lr"], device, capture)
        return AdamHyper(lr=lr, lr_tensor=lr_tensor, beta1=param_table.host_scalar(beta1, "betas[0]", capture),
                         beta2=param_table.host_scalar(beta2, "betas[1]", capture), eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]),
                         decoupled=bool(group["decoupled_weight_decay"]), maximize=bool(group["maximize"]))

    def _check_capture(self, group, ps):
        if not all(self._ready(p) for p in ps):
            refuse_in_capture(self._name, "a parameter's state is not made yet (or its step count is not a "
                              "float32 tensor on its device), and making it would be replayed")

    def _ready(self, p):
        """the state exists as the kernel reads it: nothing to make or move"""
        step = self.state.get(p, {}).get("step")
        return isinstance(step, torch.Tensor) and step.dtype is torch.float32 and step.device == p.device

    def _make_state(self, group, ps):
        amsgrad = bool(group["amsgrad"])
        for p in ps:
            self._state_of(p, amsgrad)

    def _state_of(self, p, amsgrad):
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = state["step"]
        if not isinstance(step, torch.Tensor):  # a checkpoint of old torch: a number
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        elif step.dtype is not torch.float32 or step.device != p.device:  # torch's non-fused layout: on the CPU
            state["step"] = step.to(device=p.device, dtype=torch.float32)

    def _write_table(self, group, ps, dst):
        """The kernel's entries into `dst`, after checking the state tensors (only when the group's key
        changed: a new table). A bad one raises here, before any parameter changes (states the step made
        for parameters that had none stay, as torch's would)."""
        amsgrad = bool(group["amsgrad"])
        states = [self.state[p] for p in ps]
        for p, state in zip(ps, states):
            for key in _STATE_KEYS[amsgrad][:-1]:
                param_table.check_state(self._name, p, state[key], key)
        pack = param_table.pack
        return _C.optim_adam_table(params=pack(ps), grads=pack([p.grad for p in ps]),
                                   exp_avgs=pack([s["exp_avg"] for s in states]),
                                   exp_avg_sqs=pack([s["exp_avg_sq"] for s in states]),
                                   max_exp_avg_sqs=pack([s["max_exp_avg_sq"] for s in states]) if amsgrad else None,
                                   steps=pack([s["step"] for s in states]), dst=dst)

    def _entry_bytes(self):
        return _C.OPTIM_ADAM_ENTRY_BYTES

    def _torch_step(self, group, ps, hyper, made, scale, found):
        amsgrad = bool(group["amsgrad"])
        exp_avgs, exp_avg_sqs, *max_exp_avg_sqs, steps = self._state_lists(ps, _STATE_KEYS[amsgrad])
        counter = self._per_plan(ps, "step counter", lambda: torch_cpu_step.StepCounter(steps))
        torch_cpu_step.adam_step(ps, exp_avgs, exp_avg_sqs, max_exp_avg_sqs[0] if amsgrad else None, counter,
                                 hyper, scale, found)
        return True

    def _launch(self, table, count, chunks, device, hyper, made, scale, found):
        h = hyper
        index = -1 if device.type == "cpu" else device.index
        _C.optim_adam(table=table, count=count, total_chunks=chunks, device=index,
                      lr=h.lr, lr_tensor=h.lr_tensor, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                      weight_decay=h.weight_decay, decoupled=h.decoupled, maximize=h.maximize, grad_scale=scale,
                      found_inf=found, stream=param_table.stream_of(device), threads=param_table.threads_of(device))


class AdamW(Adam, torch.optim.AdamW):
    """torch.optim.AdamW(fused=True), updated by hotloop's kernel: Adam with decoupled weight decay; an
    instance of torch.optim.AdamW (and so of torch.optim.Adam, as torch's AdamW is)."""

    _name = "AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True)

    def __setstate__(self, state):
        # torch's AdamW.__setstate__: whatever was pickled, an AdamW decouples its weight decay
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True

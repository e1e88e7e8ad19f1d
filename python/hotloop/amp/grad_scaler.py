"""hotloop.GradScaler: a drop-in for torch.amp.GradScaler with fused kernels and no host syncs.

Replace ``torch.amp.GradScaler(...)`` by ``hotloop.GradScaler(...)`` and nothing changes but speed: the
same methods, arguments, errors, scale trajectory and skipped steps (hysteresis=1, no min/max), and
state dicts that load both ways. Underneath, for all gradients of an optimizer at once (float32,
float16 and bfloat16 mixed, one launch, any number of tensors):

* a read-only *check* pass finds inf/NaN and the norm of the unscaled gradients, reduced in two fixed
  stages (one partial per 32768-element chunk, then one block adds them in chunk order), so the same
  gradients give bit-identical norms on every run;
* a one-thread *epilogue* computes the norm, torch's clip coefficient, the combined factors and the
  skip flag on the device;
* ``step`` hands torch's fused optimizers (``fused=True``) ``grad_scale`` and ``found_inf`` tensors, so
  they unscale, clip and skip inside their own kernel: check + optimizer, no host sync. Any other
  optimizer gets one read-write *apply* pass and then the skip decision as torch makes it (one
  ``.item()``);
* ``update`` grows or backs off the scale on the device (growth, backoff, hysteresis, min/max scale,
  growth tracker, skipped-step counter).

``clip_grad_norm_(optimizer, max_norm)`` replaces ``scaler.unscale_(optimizer)`` followed by
``torch.nn.utils.clip_grad_norm_(params, max_norm)`` in one line.

Per optimizer the table of gradient addresses is built, checked and uploaded once and reused while
the gradients stay where they are (a step compares their ``data_ptr()``\\ s), so a step costs a few
microseconds of Python per thousand tensors.
"""
import inspect
import math
import warnings
import weakref
from collections import defaultdict

import torch

from .. import _C
from . import device_grads, overflow_report, sharded
from .grad_checks import GradChecks, Pending
from .overflow_report import OverflowReport
from .scale_state import (OptState, ScaleState, check_factors, device_type, interval, number,
                          refresh_per_optimizer_state)
from .tensor_table import runs_eagerly

__all__ = ["GradScaler", "OptState", "OverflowReport"]

try:  # torch's own class, so that code checking isinstance(scaler, torch.amp.GradScaler) works with this scaler
    from torch.amp.grad_scaler import GradScaler as _TorchGradScaler
except ImportError:  # torch < 2.3 keeps it under torch.cuda.amp
    from torch.cuda.amp.grad_scaler import GradScaler as _TorchGradScaler


# NOTE [ A watched fused step ]
# A fused optimizer (_step_supports_amp_scaling) is always called, with found_inf, and skips inside its
# own kernel: no host sync, as torch's scaler does. Code that learns whether a step was skipped by
# replacing optimizer.step on the instance and watching whether it runs (Accelerate's
# AcceleratedOptimizer.step_was_skipped, which then holds the LR scheduler back) would read every
# skipped fused step as taken. So while optimizer.step is such an instance attribute, the scaler
# decides on the host as it does for any other optimizer: one .item() (the sync torch's scaler makes
# for a non-fused optimizer), and the optimizer is called only when the step is not skipped, which
# leaves its state as the kernel's own skip would. torch's LR schedulers also wrap optimizer.step on the
# instance, only to warn about call order (_wrapped_by_lr_sched): that wrapper alone adds no sync.


def _step_is_watched(optimizer):
    step = getattr(optimizer, "__dict__", {}).get("step")
    return step is not None and not getattr(step, "_wrapped_by_lr_sched", False)


class GradScaler(GradChecks, ScaleState, _TorchGradScaler):
    """A drop-in for :class:`torch.amp.GradScaler` with fused CUDA kernels and no host syncs.

    A subclass of torch's (``isinstance(scaler, torch.amp.GradScaler)`` holds) that overrides every
    method torch's defines; torch's ``__init__`` is not called, since this one sets every attribute
    torch's methods read, with torch's meanings: ``_scale`` (0-dim float32) and ``_growth_tracker``
    (0-dim int32) on the scale's device, created by the first ``scale()``, ``_per_optimizer_states``,
    ``_enabled``, the factors and interval, ``_init_scale``/``_init_growth_tracker``.

    Args are those of torch's GradScaler (same names and defaults), plus keyword-only:

    hysteresis (int, default 1): back off only after this many overflows since the last growth
        (Megatron-LM's rule; 1 is torch's behaviour).
    min_scale / max_scale (float, optional): bounds the scale never crosses.
    named_parameters (iterable of (name, Parameter), optional): names for :meth:`overflow_report`.
    process_group (torch.distributed.ProcessGroup, optional): the group over which each rank's
        optimizer holds only its shard of the gradients (a sharded optimizer of your own, plain-tensor
        gradients); see "Distributed training" below.

    Usage is torch's::

        scaler = hotloop.GradScaler()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # was: scaler.unscale_(opt); clip_grad_norm_(...)
        scaler.step(optimizer)
        scaler.update()

    Host syncs: none with a fused optimizer (``fused=True``), as with torch's scaler; one ``.item()``
    in ``step`` for any other optimizer (torch's scaler makes the same one), and for a fused one whose
    ``step`` something has replaced on the instance to see whether it runs (Accelerate's
    ``step_was_skipped``), which then runs only when the step is taken (see NOTE [ A watched fused
    step ]). Reading ``get_scale()``, ``skipped_steps``, ``state_dict()`` or ``overflow_report()`` waits
    for the device.

    torch.compile: a compiled function may call every method; ``scale`` is traced into the graph, the
    methods that reach hotloop's C extension run eagerly (a graph break, as torch's scaler takes one
    at its ``.item()``), with eager's results.

    Gradients: dense float32, float16 and bfloat16 ones (contiguous in some order of their
    dimensions) take the fused kernels, one launch per device; sparse ones, views with gaps and
    float64 ones take torch's ops, still without a host sync, and one skip decision covers both
    (an expand()ed gradient, whose elements overlap, is refused, as torch's unscale_ fails on it).
    Gradients of one optimizer may live on several GPUs (model or pipeline parallel): a found_inf per
    device, as torch keeps them.

    Distributed training: with DDP (replicated gradients, plain tensors) nothing changes and no
    collective is added: every rank already sees the same gradients and takes the same decision.
    Sharded gradients need every rank's share: the found-inf flag and the norm's partial sums are
    gathered across the ranks (one small collective per check, asynchronous, no host sync on NCCL)
    before the epilogue, so every rank skips the same steps and clips by the same coefficient, as torch's
    GradScaler and clip_grad_norm_ do on FSDP2's DTensors. How the scaler knows that gradients are
    sharded: DTensor gradients (FSDP2's ``fully_shard``) say so themselves; the scaler works on their
    local shards (``to_local()``), in place, and reduces over the device-mesh dimensions they are
    sharded on (a 1-D mesh, or HSDP's shard dimension). All of one optimizer's DTensor gradients must
    be sharded alike, and not mixed with plain ones (ValueError). For plain gradients that are each
    rank's shard (a sharded optimizer of your own) pass ``process_group=``: every optimizer's
    gradients are then reduced over that group, DTensor ones included. Groups of one rank add
    nothing. clip_grad_norm_ returns the norm of all ranks' gradients, as a plain tensor, the same on
    every rank. overflow_report() on each rank names that rank's own first non-finite gradient (None on
    a rank whose shards were all finite, though the step was skipped there too). A rank whose
    sharded optimizer holds no gradient still takes part and skips with the others.

    Differences from torch, all deliberate: unscale_ accepts float16 gradients (torch's refuses them):
    hotloop checks each value after unscaling, in float32, so a float16 gradient that would become
    inf once unscaled counts as an overflow and the step is skipped, where torch would write the inf
    and step; bfloat16 gradients work too. Device specs other than cuda and cpu are refused.
    clip_grad_norm_ returns float32 whatever the gradients' dtype, computed in float64 per chunk
    (torch's float32 norm of a large tensor can be off by ~1e-5). Arguments torch takes in silence and
    then misbehaves on (a NaN or non-positive backoff factor, a growth_interval that is not an int >= 1,
    a non-number) raise TypeError/ValueError here.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 hysteresis: int = 1, min_scale: float | None = None, max_scale: float | None = None,
                 named_parameters=None, process_group=None) -> None:
        # torch's __init__ is not called: it would warn a second time about a missing CUDA and set
        # nothing that is not set here
        kind = device_type(device)
        self._process_group = sharded.expect_process_group(process_group)
        self._device = kind
        self._enabled = enabled
        if kind == "cuda" and enabled:
            if not torch.cuda.is_available():  # any cuda spec (torch only checks "cuda" itself)
                warnings.warn("torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                              stacklevel=2)
                self._enabled = False
            elif _C.cuda_unavailable_reason() is not None:
                raise RuntimeError(f"hotloop.GradScaler(device='cuda'): {_C.cuda_unavailable_reason()}")
        interval("hysteresis", hysteresis)
        for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
            if bound is not None and math.isnan(number(name, bound)):
                raise ValueError(f"{name}: expected a number or None, got nan")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale})")
        self._hysteresis = int(hysteresis)
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._names = {}
        if named_parameters is not None:
            self.set_parameter_names(named_parameters)
        self._caches = weakref.WeakKeyDictionary()
        self._cache_count = 0
        self._updates = 0
        self._last_found_inf = None
        self._pending = {}  # id(optimizer) -> Pending
        if self._enabled:
            check_factors(growth_factor, backoff_factor, growth_interval)
            number("init_scale", init_scale)  # any value, NaN included, as torch takes it
            self._init_scale = init_scale
            self._scale = None
            self._growth_factor = growth_factor
            self._backoff_factor = backoff_factor
            self._growth_interval = growth_interval
            self._init_growth_tracker = 0
            self._growth_tracker = None
            self._amp_state = None  # int64 [skipped steps, hysteresis left] on the scale's device
            self._init_skipped = 0
            self._init_hysteresis = self._hysteresis
            self._per_optimizer_states = defaultdict(refresh_per_optimizer_state)

    # ---- torch's state machinery ----

    def _check_scale_growth_tracker(self, funcname):
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return (self._scale, self._growth_tracker)

    def _lazy_init_scale_growth_tracker(self, dev):
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._amp_state = torch.zeros(2, dtype=torch.int64, device=dev)
        self._amp_state[_C.AMP_STATE_SKIPPED] = self._init_skipped  # fills on the device: no sync
        self._amp_state[_C.AMP_STATE_HYSTERESIS] = self._init_hysteresis

    @staticmethod
    def _check_device(t):
        # torch scales a tensor on any device (a CPU loss with a "cuda" scaler too); hotloop's kernels
        # run on cuda and cpu only, so say so now rather than at the first step
        if t.device.type not in ("cuda", "cpu"):
            raise ValueError(f"scale: expected tensors on a cuda or cpu device, got one on {t.device}")

    def scale(self, outputs):
        """Multiply a tensor, or nested lists/tuples of tensors, by the scale factor (as torch's)."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            self._check_device(outputs)
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        stash = []

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                self._check_device(val)
                if len(stash) == 0:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(val.device)
                    stash.append({})
                scale = stash[0].get(val.device)
                if scale is None:
                    scale = stash[0][val.device] = self._scale.to(device=val.device, non_blocking=True, copy=True)
                return val * scale
            if isinstance(val, (list, tuple)) or hasattr(val, "__iter__"):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    # ---- torch's public methods ----

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def unscale_(self, optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, now (one launch for all dtypes).

        As torch: optional, at most once per optimizer between two update() calls, and not after
        step(). No host sync.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        with torch.no_grad():
            cache = self._grads(optimizer)
            found, _, _ = self._run_check(cache, True, _C.AMP_NORM_NONE, 0.0, -1.0, True)
            self._record(optimizer_state, found)
        optimizer_state["stage"] = OptState.UNSCALED

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach=None) -> torch.Tensor:
        """Unscale and clip the optimizer's gradients; the one-line replacement for
        ``scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)``.

        Returns the total norm of the *unscaled* gradients as a 0-dim float32 tensor on their device,
        without a host sync (2, inf or any p > 0). One read-only pass computes the norm and the
        inf/NaN check now; the factor min(max_norm / (norm + 1e-6), 1) / scale is applied in step():
        inside a fused optimizer's own kernel, or in one read-write pass before any other optimizer
        runs (so read the gradients after step() if you need their final values). A skipped step
        (inf/NaN found) leaves the gradients untouched. ``max_norm=inf`` measures without clipping.
        ``error_if_nonfinite=True`` waits for the device, as torch's does. ``foreach`` is accepted
        and ignored. With the scaler disabled this is torch.nn.utils.clip_grad_norm_ on the
        optimizer's parameters.
        """
        max_norm = float(max_norm)
        norm_type = float(norm_type)
        if math.isnan(max_norm) or max_norm < 0:
            raise ValueError(f"max_norm: expected a number >= 0 (inf to measure without clipping), got {max_norm}")
        if math.isnan(norm_type) or norm_type <= 0:
            raise ValueError(f"norm_type: expected a number > 0 or inf, got {norm_type}")
        if not self._enabled:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        self._check_scale_growth_tracker("clip_grad_norm_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        with torch.no_grad():
            self._apply_pending(optimizer)  # clipped twice: make the first one real
            cache = self._grads(optimizer)
            if not cache.devices and not cache.reduce_over:
                optimizer_state["found_inf_per_device"] = {}
                optimizer_state["stage"] = OptState.UNSCALED
                return torch.zeros((), dtype=torch.float32, device=self._scale.device)
            if norm_type == 2.0:
                mode, p = _C.AMP_NORM_L2, 2.0
            elif math.isinf(norm_type):
                mode, p = _C.AMP_NORM_INF, 0.0
            else:
                mode, p = _C.AMP_NORM_P, norm_type
            unscale = optimizer_state["stage"] is OptState.READY
            clip_to = max_norm if not math.isinf(max_norm) else -1.0
            found, auxes, final = self._run_check(cache, False, mode, p, clip_to, unscale)
            self._record(optimizer_state, found)
            if unscale or clip_to >= 0:
                self._pending[id(optimizer)] = Pending(cache.devices, auxes, final, unscale, clip_to >= 0)
            optimizer_state["stage"] = OptState.UNSCALED
            total_norm = final[_C.AMP_AUX_NORM]
        if error_if_nonfinite and not torch.isfinite(total_norm):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from "
                "`parameters` is non-finite, so it cannot be clipped. To disable "
                "this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`")
        return total_norm

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def finalize_grads_(self, optimizer) -> None:
        """Write the unscaled (and, after clip_grad_norm_, clipped) gradients now, in one read-write
        pass, rather than inside step(): for code that reads the optimizer's gradients between
        clip_grad_norm_ and step() (logging, a custom update). Nothing happens after unscale_ alone
        (its gradients are final already) or when nothing is pending; gradients of a step found to
        hold inf/NaN stay as they are. No host sync."""
        if self._enabled:
            with torch.no_grad():
                self._apply_pending(optimizer)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        retval = None
        # one .item() however many devices: their found_infs are added on the device first
        if not self._sum_found(optimizer_state["found_inf_per_device"].values()).item():
            retval = optimizer.step(*args, **kwargs)
        return retval

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def step(self, optimizer, *args, **kwargs):
        """Unscale (and clip, after clip_grad_norm_) the gradients and run ``optimizer.step(*args,
        **kwargs)`` unless a gradient held inf/NaN; returns its return value (None when skipped).

        Fused optimizers (``_step_supports_amp_scaling``) get ``grad_scale`` and ``found_inf`` device
        tensors and do the rest in their own kernel: no host sync. Other optimizers get one
        read-write pass, then one ``.item()`` decides whether to call them, as torch's scaler does.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            kwargs_ = kwargs
            has_grad_scaler_kwarg = "grad_scaler" in inspect.signature(optimizer.step).parameters
            if has_grad_scaler_kwarg:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning, stacklevel=2)
                self._apply_pending(optimizer)
                kwargs_.update({"grad_scaler": self})
            else:
                if optimizer_state["stage"] is OptState.READY:
                    self._check_inf_per_device(optimizer)
                found = optimizer_state["found_inf_per_device"]
                # torch's: the found_infs added on the scale's device (the optimizer moves it to each of its own)
                found_inf = self._sum_found(found.values())
                pending = self._pending.pop(id(optimizer), None)
                user_scale = getattr(optimizer, "grad_scale", None)
                if pending is not None:
                    # the optimizer divides by scale / clip: unscale and clip inside its kernel
                    grad_scale = pending.final[_C.AMP_AUX_GRAD_SCALE]
                    if user_scale is not None:
                        grad_scale = grad_scale * user_scale.to(grad_scale.device)
                elif optimizer_state["stage"] is OptState.UNSCALED:
                    grad_scale = user_scale
                else:
                    grad_scale = self._scale if user_scale is None else self._scale * user_scale
                optimizer.grad_scale = grad_scale
                optimizer.found_inf = found_inf
            retval = None
            # see NOTE [ A watched fused step ]
            if has_grad_scaler_kwarg or not _step_is_watched(optimizer) or not found_inf.item():
                retval = optimizer.step(*args, **kwargs_)
            optimizer_state["stage"] = OptState.STEPPED
            if not has_grad_scaler_kwarg:
                del optimizer.grad_scale
                del optimizer.found_inf
            return retval

        if optimizer_state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        else:
            with torch.no_grad():
                self._apply_pending(optimizer)
        if len(optimizer_state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def _check_inf_per_device(self, optimizer):
        """Find inf/NaN in the optimizer's (still scaled) gradients: one read-only pass."""
        self._check_scale_growth_tracker("_check_inf_per_device")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        with torch.no_grad():
            found, _, _ = self._run_check(self._grads(optimizer), False, _C.AMP_NORM_NONE, 0.0, -1.0, False)
            self._record(optimizer_state, found)
        return optimizer_state["found_inf_per_device"]

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's private hook, for code that calls it directly (torch's own tests do): multiply every
        gradient of `optimizer` by `inv_scale` in place and return {device: a copy of `found_inf`, set to
        1.0 where a gradient on that device held inf/NaN once multiplied}. Here every gradient takes the
        torch-ops path, since the kernels take a scale, not its inverse; unscale_ and step do not call
        this, so overriding it in a subclass changes nothing else."""
        cache = self._grads(optimizer)
        params = cache.params
        per_device = {}
        if not allow_fp16:
            for dg in cache.devices:
                if any(params[i].grad.dtype is torch.float16 for i in dg.dense_index + dg.others):
                    raise ValueError("Attempting to unscale FP16 gradients.")
        with torch.no_grad():
            for dg in cache.devices:
                indices = dg.dense_index + dg.others
                extra = device_grads.measure_these(
                    params, indices, torch.tensor(indices, dtype=torch.float32).to(dg.device), dg.device,
                    inv_scale.to(dg.device).reshape(()), True, _C.AMP_NORM_NONE, 0.0)
                found = found_inf.to(dg.device, copy=True)
                found.copy_(torch.maximum(found, extra[_C.AMP_EXTRA_FOUND]))
                per_device[dg.device] = found
        return per_device

    def _found_inf_per_device(self, optimizer):
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # ---- hotloop's extras ----

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because of inf/NaN so far: reads a device counter, so it waits for the device."""
        if not self._enabled:
            return 0
        return self._get_amp_state()[0]

    @property
    def found_inf(self):
        """The 0-dim float32 device tensor of the last check: 1.0 when that step is (to be) skipped.
        None before the first check. Reading its value waits for the device."""
        return self._last_found_inf

    def set_parameter_names(self, named_parameters) -> None:
        """Names for overflow_report(): an iterable of (name, parameter), e.g. model.named_parameters()."""
        self._names = {id(p): name for name, p in named_parameters}

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def overflow_report(self, named_parameters=None):
        """The first parameter whose gradient was non-finite in the last skipped step, as an
        OverflowReport (str() reads as a sentence), or None if no step was skipped. Waits for the device."""
        if not self._enabled:
            return None
        names = {id(p): n for n, p in named_parameters} if named_parameters is not None else self._names
        return overflow_report.first(self._caches, names)

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
import dataclasses
import inspect
import logging
import math
import warnings
import weakref
from collections import defaultdict

import torch

from .. import _C
from .._arguments import expect_count, expect_number
from . import device_grads, sharded
from .tensor_table import runs_eagerly

_logger = logging.getLogger(__name__)

__all__ = ["GradScaler", "OptState", "OverflowReport"]

try:  # torch's own enum and class, so that code comparing a stage with torch's OptState, or checking
    # isinstance(scaler, torch.amp.GradScaler), works with this scaler
    from torch.amp.grad_scaler import GradScaler as _TorchGradScaler
    from torch.amp.grad_scaler import OptState
except ImportError:  # torch < 2.3 keeps them under torch.cuda.amp
    from torch.cuda.amp.grad_scaler import GradScaler as _TorchGradScaler
    from torch.cuda.amp.grad_scaler import OptState


def _refresh_per_optimizer_state():
    # torch's two keys and nothing else: code (and torch's tests) compare this dict with torch's
    return {"stage": OptState.READY, "found_inf_per_device": {}}


# the aux slots that make up an extra partial, in the extra's slot order
_AUX_AS_EXTRA = [aux for _, aux in sorted([(_C.AMP_EXTRA_ACC, _C.AMP_AUX_ACC), (_C.AMP_EXTRA_FOUND, _C.AMP_AUX_FOUND),
                                           (_C.AMP_EXTRA_PARAM, _C.AMP_AUX_PARAM)])]


@dataclasses.dataclass
class _Pending:
    """What clip_grad_norm_ left for step() to do to one optimizer's gradients."""

    devices: list  # the DeviceGrads it measured
    auxes: list  # per device: the epilogue's factors as that device's apply pass reads them
    final: torch.Tensor  # the aux holding the norm and the grad_scale for a fused optimizer
    unscale: bool
    clip: bool


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


class _OptimizerCache:
    """Per optimizer: the flat parameter list, the gradient table and the overflow report."""

    __slots__ = ("groups_key", "params", "key", "devices", "reduce_over", "dtensors", "reports", "number",
                 "__weakref__")

    def __init__(self, number):
        self.groups_key = None
        self.params = []
        self.key = None
        self.devices = None  # DeviceGrads, in order of first appearance
        self.reduce_over = ()  # process groups the gradients are sharded over (none: not sharded)
        self.dtensors = False  # the gradients were DTensors: the table holds their local shards
        self.reports = {}  # device -> int64 overflow report, kept across rebuilds
        self.number = number


def _device_type(device):
    """'cuda' or 'cpu' for a device spec torch's GradScaler takes: 'cuda', 'cuda:1', 'cpu:0', 'CPU',
    torch.device('cuda', 1). As with torch, the spec says which kind of device, not where the scale
    lives: the scale goes to the device of the first tensor scale() is given."""
    if isinstance(device, torch.device):
        kind = device.type
    elif isinstance(device, str):
        kind = device.split(":", 1)[0].strip().lower()
    else:
        raise TypeError(f"device: expected a str or torch.device such as 'cuda' or 'cuda:1', got "
                        f"{type(device).__name__}")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device: expected a cuda or cpu device such as 'cuda', 'cuda:1' or 'cpu', got {device!r} "
                         f"(hotloop.GradScaler has kernels for these two)")
    return kind


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


def _threads(device):
    """CPU threads for a pass over gradients on `device`: torch's intra-op count, as torch's own CPU
    ops use (0 on CUDA, where C picks the grid)."""
    return torch.get_num_threads() if device.type == "cpu" else 0


def _number(name, value):
    return expect_number("GradScaler", name, value)


def _interval(name, value):
    return expect_count("GradScaler", name, value, least=1)


def _check_factors(growth_factor, backoff_factor, growth_interval):
    """torch's two checks (AssertionError, as torch raises), then what torch lets through in silence
    and then misbehaves on: a NaN factor, a backoff that zeroes or flips the scale, a growth interval
    that is not a positive int (torch fails at the first update, or never grows)."""
    _number("growth_factor", growth_factor)
    _number("backoff_factor", backoff_factor)
    if growth_factor <= 1.0:
        raise AssertionError("The growth factor must be > 1.0.")
    if backoff_factor >= 1.0:
        raise AssertionError("The backoff factor must be < 1.0.")
    if math.isnan(growth_factor):
        raise ValueError("growth_factor: expected a number > 1.0, got nan")
    if math.isnan(backoff_factor) or backoff_factor <= 0.0:
        raise ValueError(f"backoff_factor: expected a number in (0, 1), got {backoff_factor}")
    _interval("growth_interval", growth_interval)


class GradScaler(_TorchGradScaler):
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
        kind = _device_type(device)
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
        _interval("hysteresis", hysteresis)
        for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
            if bound is not None and math.isnan(_number(name, bound)):
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
        self._pending = {}  # id(optimizer) -> _Pending
        if self._enabled:
            _check_factors(growth_factor, backoff_factor, growth_interval)
            _number("init_scale", init_scale)  # any value, NaN included, as torch takes it
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
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

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

    # ---- the gradient table ----

    def _cache_for(self, optimizer):
        cache = self._caches.get(optimizer)
        if cache is None:
            cache = _OptimizerCache(self._cache_count)
            self._cache_count += 1
            self._caches[optimizer] = cache
        groups = optimizer.param_groups
        groups_key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if groups_key != cache.groups_key:
            params = []
            for g in groups:
                for p in g["params"]:
                    if not isinstance(p, torch.Tensor):
                        raise AssertionError(f"expected param to be torch.Tensor, got {type(p).__name__}")
                    params.append(p)
            cache.params = params
            cache.groups_key = groups_key
            cache.devices = None
        return cache

    def _grads(self, optimizer):
        """The optimizer's cache with its gradients split by device, rebuilt when a gradient moved,
        appeared or went (a step compares their data pointers) or the current stream changed."""
        cache = self._cache_for(optimizer)
        grads = [p.grad for p in cache.params]
        if cache.dtensors:  # a DTensor's data_ptr() is 0: its local shard's says where its values are
            grads = [sharded.local(g) for g in grads]
        key = self._key(grads)
        if cache.devices is None or key != cache.key:
            self._build(cache, key)
        else:
            for dg in cache.devices:  # partials are reused in stream order: keep them per stream
                if dg.device.type == "cuda" and torch.cuda.current_stream(dg.device).cuda_stream != dg.stream:
                    self._build(cache, key)
                    break
        return cache

    @staticmethod
    def _key(grads):
        try:  # None: no gradient; else where its values are
            return [g.data_ptr() if g is not None else None for g in grads]
        except RuntimeError:  # a sparse gradient has no data pointer (-1: read from the parameter at each use)
            return [None if g is None else (g.data_ptr() if g.layout is torch.strided else -1) for g in grads]

    def _build(self, cache, key):
        grads, reduce_over, dtensors = sharded.local_grads([p.grad for p in cache.params], self._process_group)
        split = device_grads.split(grads)  # raises before anything runs
        if dtensors:
            key = self._key(grads)
        devices = []
        for device, (dense, index, others) in split.items():
            report = cache.reports.get(device)
            if report is None:
                report = cache.reports[device] = torch.zeros(_C.AMP_REPORT_LEN, dtype=torch.int64, device=device)
                report[_C.AMP_REPORT_PARAM] = -1
            stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
            devices.append(device_grads.DeviceGrads(device, dense, index, others, stream, report))
        cache.devices = devices
        cache.reduce_over = reduce_over
        cache.dtensors = dtensors
        cache.key = key

    def _scale_on(self, device, copies):
        """The scale as a tensor on `device` (one copy per device per call, kept in `copies`)."""
        if self._scale.device == device:
            return self._scale
        scale = copies.get(device)
        if scale is None:
            # a copy to the CPU must have landed before the C reference reads it
            scale = copies[device] = self._scale.to(device, non_blocking=device.type == "cuda")
        return scale

    def _check(self, cache, dg, write, mode, p, max_norm, scale, with_table, extra, report):
        """Launch one device's check pass + epilogue (the epilogue alone without its table), folding in
        the `extra` partials (AMP_EXTRA_LEN floats each, or None); returns the fresh aux tensor."""
        aux = torch.empty(_C.AMP_AUX_LEN, dtype=torch.float32, device=dg.device)
        t = dg.table if with_table else None
        _C.amp_check(dg.device_index, t.table_ptr if t else 0, t.count if t else 0, t.total_chunks if t else 0,
                     t.partials_ptr if t else 0, scale.data_ptr() if scale is not None else 0, 1 if write else 0,
                     mode, p, max_norm, aux.data_ptr(), t.index_ptr if t else 0,
                     dg.report.data_ptr() if report else 0, self._updates,
                     extra.data_ptr() if extra is not None else 0,
                     extra.numel() // _C.AMP_EXTRA_LEN if extra is not None else 0, _threads(dg.device),
                     dg.stream)
        return aux

    def _run_check(self, cache, write, mode, p, max_norm, unscale):
        """The check over every device's gradients, and over every rank's shard of them when they are
        sharded. Returns (found_inf per device, per device the aux its apply pass reads, the aux with the
        norm and the fused optimizer's grad_scale). No host sync."""
        copies = {}
        params = cache.params
        # several devices, or shards on several ranks: each device's epilogue only gathers its share,
        # then one epilogue folds the shares (a local report stays with each rank's own first bad one)
        combine = len(cache.devices) > 1 and (mode != _C.AMP_NORM_NONE or cache.reduce_over)
        alone = not combine and not cache.reduce_over
        local = []
        for dg in cache.devices:
            scale = self._scale_on(dg.device, copies) if unscale else None
            inv = None
            if dg.others and scale is not None:
                inv = scale.double().reciprocal().float()  # FP64 reciprocal, as the kernels and torch take it
            extra = device_grads.measure(params, dg, inv, write, mode, p) if dg.others else None
            local.append(self._check(cache, dg, write, mode, p, max_norm if alone else -1.0, scale, True, extra,
                                     report=not combine))
        if alone:
            found = {dg.device: aux[_C.AMP_AUX_FOUND] for dg, aux in zip(cache.devices, local)}
            return found, local, local[0] if local else None
        if cache.devices:
            home, final = cache.devices[0], local[0]
        else:
            # no gradient on this rank (a sharded optimizer that owns none now): it still takes part,
            # with nothing found and nothing to add, so that the other ranks are not left waiting
            home, final = self._no_grads_home(), None
        home_scale = self._scale_on(home.device, copies) if unscale else None
        if combine:
            # the first device's epilogue folds every device's share into one norm, clip factor and skip
            # flag; every device applies those
            shares = torch.stack([self._share(aux).to(home.device) for aux in local])
            last = not cache.reduce_over
            final = self._check(cache, home, False, mode, p, max_norm if last else -1.0, home_scale, False, shares,
                                report=True)
        for i, group in enumerate(cache.reduce_over):
            # every rank folds every rank's share, in rank order: the same norm and skip flag on each
            last = i == len(cache.reduce_over) - 1
            share = self._share(final) if final is not None else self._nothing_found(home.device)
            final = self._check(cache, home, False, mode, p, max_norm if last else -1.0, home_scale, False,
                                sharded.gather(share, group), report=False)
        auxes = [final if dg is home else final.to(dg.device) for dg in cache.devices]
        # each device keeps its own found_inf, as torch's per-device ones; sharded, each is every rank's
        if not cache.reduce_over:
            found = {dg.device: aux[_C.AMP_AUX_FOUND] for dg, aux in zip(cache.devices, local)}
        elif cache.devices:
            found = {dg.device: aux[_C.AMP_AUX_FOUND] for dg, aux in zip(cache.devices, auxes)}
        else:
            found = {home.device: final[_C.AMP_AUX_FOUND]}
        return found, auxes, final

    def _no_grads_home(self):
        """Where a rank without gradients folds the other ranks' shares: the scale's device."""
        dev = self._scale.device
        stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
        return device_grads.DeviceGrads(dev, [], [], [], stream, None)

    @staticmethod
    def _nothing_found(device):
        share = torch.zeros(_C.AMP_EXTRA_LEN, dtype=torch.float32, device=device)
        share[_C.AMP_EXTRA_PARAM] = -1.0
        return share

    @staticmethod
    def _share(aux):
        """An epilogue's totals as an extra partial another epilogue folds in (AMP_EXTRA_LEN float32)."""
        return torch.stack([aux[i] for i in _AUX_AS_EXTRA])

    def _apply_pending(self, optimizer):
        """Bring gradients to their unscaled, clipped values (one read-write pass), unless skipped."""
        pending = self._pending.pop(id(optimizer), None)
        if pending is None:
            return
        cache = self._caches.get(optimizer)
        for dg, aux in zip(pending.devices, pending.auxes):
            t = dg.table
            if t is not None:
                _C.amp_apply(t.device_index, t.table_ptr, t.count, t.total_chunks, aux.data_ptr(),
                             1 if pending.unscale else 0, 1 if pending.clip else 0, t.stream, _threads(dg.device))
            if dg.others:
                device_grads.apply(cache.params, dg, aux, pending.unscale, pending.clip)

    def _record(self, optimizer_state, found):
        optimizer_state["found_inf_per_device"] = found
        if len(found) == 1:
            self._last_found_inf = next(iter(found.values()))
        elif found:
            self._last_found_inf = self._sum_found(found.values())

    def _sum_found(self, found):
        """The found_inf values added on the scale's device, as torch combines them (no host sync); one
        already there is itself (no addition launched: this runs every step)."""
        dev = self._scale.device
        found = list(found)
        if len(found) == 1 and found[0].device == dev:
            return found[0]
        return sum(f.to(dev, non_blocking=dev.type == "cuda") for f in found)

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
                self._pending[id(optimizer)] = _Pending(cache.devices, auxes, final, unscale, clip_to >= 0)
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
    def update(self, new_scale=None) -> None:
        """Update the scale on the device: back off when a step was skipped, grow after
        ``growth_interval`` clean steps in a row (as torch), with hysteresis and min/max when set."""
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [found_inf for state in self._per_optimizer_states.values()
                      for found_inf in state["found_inf_per_device"].values()]
        if new_scale is not None:
            if isinstance(new_scale, (float, int)) and not isinstance(new_scale, bool):
                self._scale.fill_(float(new_scale))
            else:
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                self._scale.copy_(new_scale)
            if found_infs:  # the scale was set by hand; still count a skipped step
                self._launch_update(found_infs, adjust=False)
        else:
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            self._launch_update(found_infs, adjust=True)
        if found_infs:
            self._last_found_inf = found_infs[0] if len(found_infs) == 1 else self._sum_found(found_infs)
        self._updates += 1
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._pending = {}

    def _launch_update(self, found_infs, adjust):
        dev = self._scale.device
        # gradients may live on other devices than the scale; a copy to the CPU must land before C reads it
        found_infs = [f.to(dev, non_blocking=dev.type == "cuda") for f in found_infs]
        if len(found_infs) > _C.AMP_MAX_FOUND:
            found_infs = [torch.stack(found_infs).sum()]
        stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
        _C.amp_update(dev.index if dev.type == "cuda" else -1, self._scale.data_ptr(),
                      self._growth_tracker.data_ptr(), self._amp_state.data_ptr(),
                      tuple(f.data_ptr() for f in found_infs), float(self._growth_factor),
                      float(self._backoff_factor), int(self._growth_interval), self._hysteresis,
                      float(self._min_scale) if self._min_scale is not None else 0.0,
                      float(self._max_scale) if self._max_scale is not None else math.inf,
                      1 if adjust else 0, stream)
        # keep the found tensors alive until the kernel has read them (stream order does the rest)
        self._update_inputs = found_infs

    def _get_scale_async(self):
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Waits for the device."""
        if self._enabled:
            return self._init_scale if (scale := self._get_scale_async()) is None else scale.item()
        return 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = _number("new_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = _number("new_factor", new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = _interval("new_interval", new_interval)

    def _get_growth_tracker(self) -> int:
        if self._enabled:
            return self._init_growth_tracker if self._growth_tracker is None else self._growth_tracker.item()
        return 0

    def is_enabled(self) -> bool:
        return self._enabled

    def _get_amp_state(self):
        if self._amp_state is None:
            return self._init_skipped, self._init_hysteresis
        values = self._amp_state.tolist()
        return values[_C.AMP_STATE_SKIPPED], values[_C.AMP_STATE_HYSTERESIS]

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def state_dict(self) -> dict:
        """torch's five entries (loadable by torch.amp.GradScaler), plus "hysteresis",
        "_hysteresis_tracker", "min_scale", "max_scale" only where they differ from the defaults."""
        if not self._enabled:
            return {}
        state = {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }
        if self._hysteresis != 1:
            state["hysteresis"] = self._hysteresis
            state["_hysteresis_tracker"] = self._get_amp_state()[1]
        if self._min_scale is not None:
            state["min_scale"] = self._min_scale
        if self._max_scale is not None:
            state["max_scale"] = self._max_scale
        return state

    @runs_eagerly  # see NOTE [ hotloop under torch.compile ]
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of torch.amp.GradScaler (settings it lacks are kept)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        # checked before anything changes; a NaN scale loads and stays NaN, as with torch
        _number("state_dict['scale']", state_dict["scale"])
        _check_factors(state_dict["growth_factor"], state_dict["backoff_factor"], state_dict["growth_interval"])
        tracker = state_dict["_growth_tracker"]
        if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
            raise TypeError(f"state_dict['_growth_tracker']: expected an int >= 0, got {tracker!r}")
        self._init_scale = state_dict["scale"]
        if self._scale is not None:
            self._scale.fill_(state_dict["scale"])
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._init_growth_tracker = state_dict["_growth_tracker"]
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(state_dict["_growth_tracker"])
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._max_scale = state_dict.get("max_scale", self._max_scale)
        self._init_hysteresis = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        if self._amp_state is not None:
            self._amp_state[_C.AMP_STATE_HYSTERESIS] = self._init_hysteresis

    def __getstate__(self):
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                     "of an iteration, or at the end after scaler.update().")
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_skipped"], state["_init_hysteresis"] = self._get_amp_state()
            state["_scale"] = None
            state["_growth_tracker"] = None
            state["_amp_state"] = None
        state["_caches"] = None
        state["_pending"] = {}
        state["_last_found_inf"] = None
        state.pop("_update_inputs", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._caches = weakref.WeakKeyDictionary()

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
        names = {id(p): n for n, p in named_parameters} if named_parameters is not None else self._names
        best = None
        if not self._enabled:
            return None
        for optimizer, cache in list(self._caches.items()):
            for report in cache.reports.values():  # one per device the optimizer's gradients live on
                report = report.tolist()
                param, step, count = (report[i] for i in (_C.AMP_REPORT_PARAM, _C.AMP_REPORT_STEP,
                                                          _C.AMP_REPORT_COUNT))
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

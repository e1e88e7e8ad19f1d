"""The gradient side of hotloop.GradScaler: per optimizer, its gradients' table (built once and reused
while the gradients stay where they are), the check pass and epilogue over every device (and every rank
of sharded gradients), and the apply pass clip_grad_norm_ leaves for step(). GradChecks is a base class
of GradScaler; it reads the scaler's ``_scale``, ``_updates`` and ``_process_group`` and keeps
``_caches``, ``_cache_count`` and ``_pending`` (the per-optimizer work clip_grad_norm_ left)."""
import dataclasses

import torch

from .. import _C
from . import device_grads, sharded

# the aux slots that make up an extra partial, in the extra's slot order
_AUX_AS_EXTRA = [aux for _, aux in sorted([(_C.AMP_EXTRA_ACC, _C.AMP_AUX_ACC), (_C.AMP_EXTRA_FOUND, _C.AMP_AUX_FOUND),
                                           (_C.AMP_EXTRA_PARAM, _C.AMP_AUX_PARAM)])]


@dataclasses.dataclass
class Pending:
    """What clip_grad_norm_ left for step() to do to one optimizer's gradients."""

    devices: list  # the DeviceGrads it measured
    auxes: list  # per device: the epilogue's factors as that device's apply pass reads them
    final: torch.Tensor  # the aux holding the norm and the grad_scale for a fused optimizer
    unscale: bool
    clip: bool


class OptimizerCache:
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


def threads(device):
    """CPU threads for a pass over gradients on `device`: torch's intra-op count, as torch's own CPU
    ops use (0 on CUDA, where C picks the grid)."""
    return torch.get_num_threads() if device.type == "cpu" else 0


class GradChecks:
    """The gradient tables and passes of GradScaler (see the module's docstring)."""

    def _cache_for(self, optimizer):
        cache = self._caches.get(optimizer)
        if cache is None:
            cache = OptimizerCache(self._cache_count)
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
        _C.amp_check(device=dg.device_index, table=t.table_ptr if t else 0, count=t.count if t else 0,
                     total_chunks=t.total_chunks if t else 0, partials=t.partials_ptr if t else 0,
                     scale=scale.data_ptr() if scale is not None else 0, write=write, mode=mode, p=p,
                     max_norm=max_norm, aux=aux.data_ptr(), param_index=t.index_ptr if t else 0,
                     report=dg.report.data_ptr() if report else 0, step=self._updates,
                     extra=extra.data_ptr() if extra is not None else 0,
                     n_extra=extra.numel() // _C.AMP_EXTRA_LEN if extra is not None else 0,
                     blocks=threads(dg.device), stream=dg.stream)
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
                _C.amp_apply(device=t.device_index, table=t.table_ptr, count=t.count, total_chunks=t.total_chunks,
                             aux=aux.data_ptr(), unscale=pending.unscale, clip=pending.clip, stream=t.stream,
                             threads=threads(dg.device))
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

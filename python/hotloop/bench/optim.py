"""Benchmark rows for hotloop.optim.AdamW: the whole scaler step (unscale + clip + AdamW + update) with
hotloop's optimizer against torch's fused AdamW, with torch's scaler and with hotloop's; the bytes the
step must move against the copy rate; host time per step.

The gradient sets are the scaler benchmark's (scaler.parameters_with_grads): float32 parameters with
float32 gradients shaped like GPT models, 1.3 B parameters (481 tensors) and 353 M (289 tensors), and
a 2,000-tensor model for the host time; MODEL_TINY with --quick or on the CPU. Then each optimizer's step
alone (AdamW, Adam with amsgrad, SGD with momentum; float32 and bfloat16 parameters; without and with a
scaler's grad_scale and found_inf; over that model and over 1,993 small tensors) against torch's fused
one: on the CPU, hotloop's C reference (vectorised, threaded) against torch's fused CPU kernels. As in scaler.py the
scale is 1.0, max_norm too large to bite and lr 1e-12, so that repeated steps keep the same values
(never time on zeros) while every pass still reads and writes what it would at an fp16 scale of 2**16.
The three ways of a step share the parameters and gradients (each optimizer has its own moments) and
are alternated in one run.
"""
import statistics

from .harness import Row
from .models import MODEL_1_3B, MODEL_353M, MODEL_TINY, transformer_shapes
from .scaler import MODEL_2000, count_syncs, parameters_with_grads, step_fns, unit_scalers

# what the floor must move per element: AdamW reads param, grad, exp_avg, exp_avg_sq (16 bytes) and
# writes param, exp_avg, exp_avg_sq (12 bytes); the scaler's read-only scan (norm and inf/NaN) reads
# the gradient once more (4 bytes)
FLOOR_BYTES_PER_ELEMENT = 16 + 12 + 4
LR = 1e-12


def _alternate(ctx, fns, warmup=3, reps=20, timer=None):
    """Median milliseconds of each of fns, run in turn after warm-up (harness.Context.compare for more
    than two ways of one job)."""
    if ctx.quick:
        warmup, reps = 1, 3
    return _alternate_reps(ctx, fns, reps, warmup, timer)


def _alternate_reps(ctx, fns, reps, warmup=1, timer=None):
    """_alternate with these repetitions, whatever --quick says"""
    timer = timer or ctx.time_ms
    for _ in range(warmup):
        for fn in fns:
            fn()
    ctx.sync()
    times = [[] for _ in fns]
    for _ in range(reps):
        for spent, fn in zip(times, fns):
            spent.append(timer(fn))
    return [statistics.median(spent) for spent in times]


def _optimizers(ctx, params, AdamW):
    """(hotloop.optim.AdamW, torch's fused AdamW for torch's scaler, torch's fused AdamW for hotloop's
    scaler), each with its own moments over the same parameters"""
    torch = ctx.torch
    return (AdamW(params, lr=LR), torch.optim.AdamW(params, lr=LR, fused=True),
            torch.optim.AdamW(params, lr=LR, fused=True))


def _steps(ctx, params, GradScaler, AdamW):
    """The three ways of a step, each run once (the optimizers' state is allocated outside the timing):
    hotloop's scaler + hotloop's AdamW, torch's scaler + torch's fused AdamW + clip_grad_norm_(foreach),
    hotloop's scaler + torch's fused AdamW."""
    torch = ctx.torch
    opt_ours, opt_theirs, opt_mixed = _optimizers(ctx, params, AdamW)
    ours, theirs = unit_scalers(ctx, GradScaler)
    mixed, _ = unit_scalers(ctx, GradScaler)
    hotloop_step, torch_step = step_fns(torch, ours, theirs, opt_ours, opt_theirs, params)
    mixed_step, _ = step_fns(torch, mixed, theirs, opt_mixed, opt_theirs, params)
    for step in (hotloop_step, torch_step, mixed_step):
        step()
    return (hotloop_step, torch_step, mixed_step), (opt_ours, opt_theirs)


def rows(ctx):
    torch = ctx.torch
    from ..amp import GradScaler
    from ..optim import AdamW

    small = ctx.quick or not ctx.is_cuda
    copy_gbps = ctx.copy_rate_gbps()
    sizes = [(MODEL_TINY, "tiny")] if small else [(MODEL_1_3B, "1.3 B"), (MODEL_353M, "353 M")]
    for (hidden, layers), label in sizes:
        params = parameters_with_grads(torch, transformer_shapes(hidden, layers), ctx.device)
        numel = sum(p.numel() for p in params)
        tag = f"{label} fp32 params+grads ({len(params)} tensors, {numel / 1e6:.0f} M)"
        steps, optimizers = _steps(ctx, params, GradScaler, AdamW)
        syncs = [count_syncs(ctx, step) for step in steps[:2]]
        ms, torch_ms, mixed_ms = _alternate(ctx, steps)
        sync_note = "" if syncs[0] is None else f"; host syncs per step: hotloop {syncs[0]}, torch {syncs[1]}"
        yield Row("optim", f"unscale+clip+AdamW+update, {tag}", ms, torch_ms, "ms",
                  note="hotloop: GradScaler.clip_grad_norm_ + step(hotloop.optim.AdamW); torch: amp.GradScaler."
                       "unscale_ + clip_grad_norm_(foreach) + step(AdamW(fused=True))" + sync_note)
        yield Row("optim", f"hotloop's scaler: hotloop AdamW vs torch fused AdamW, {tag}", ms, mixed_ms, "ms",
                  note="torch column: hotloop.GradScaler.clip_grad_norm_ + step(torch.optim.AdamW(fused=True)), "
                       "what hotloop's optimizer replaces")
        device_ms, device_torch_ms = _alternate(ctx, steps[:2], timer=ctx.device_time_ms)
        yield Row("optim", f"device time of the whole step (host ahead), {tag}", device_ms, device_torch_ms, "ms",
                  note="the same steps, each queued behind a sleep kernel: what the GPU spends when the host runs "
                       "ahead of it, as in a loop whose backward pass is still running; the rows above add the "
                       "host time the device waits for")
        gb = numel * FLOOR_BYTES_PER_ELEMENT / 1e9
        rate, torch_rate = gb / (device_ms * 1e-3), gb / (device_torch_ms * 1e-3)
        yield Row("optim", f"step bytes over device time, {label} ({FLOOR_BYTES_PER_ELEMENT} B an element)", rate,
                  torch_rate, "GB/s",
                  note=f"the floor's {gb:.2f} GB both ways (AdamW reads p, g, m, v: 16 B, writes p, m, v: 12 B; "
                       f"the scaler's scan reads g: 4 B); copy rate here {copy_gbps:.0f} GB/s, so at best "
                       f"{gb / copy_gbps * 1e3:.3g} ms; hotloop {rate / copy_gbps:.0%}, torch "
                       f"{torch_rate / copy_gbps:.0%} of it")
        del params, steps, optimizers
        if ctx.is_cuda:
            torch.cuda.empty_cache()

    yield from _host_rows(ctx, GradScaler, AdamW)
    yield from _step_rows(ctx)


# each optimizer's step alone: (name, keyword arguments), each over float32 and bfloat16 parameters, without
# and with a GradScaler's grad_scale and found_inf
STEP_CASES = [("AdamW", {}), ("Adam", {"amsgrad": True}), ("SGD", {"momentum": 0.9})]
STEP_DTYPES = ("float32", "bfloat16")
# many small tensors: a GPT-like model of 1,993 tensors, ~11 M elements on the CPU
MODEL_MANY_SMALL = (64, 166)


def _step_sets(ctx):
    """(label, shapes) of the parameter sets the step rows run over"""
    small = ctx.quick or not ctx.is_cuda
    big = [(MODEL_TINY if small else MODEL_353M, "tiny" if small else "353 M")]
    return [(label, transformer_shapes(*model)) for model, label in big + [(MODEL_MANY_SMALL, "many small")]]


def _step_rows(ctx):
    """The optimizer step alone, hotloop's against torch's fused one of the same class and dtype (on the CPU
    its fused CPU kernels), over the same parameters and gradients (each with its own state, made by a
    first step outside the timing), alternated in one run. With a scaler, both take grad_scale = 1.0 and
    found_inf = 0.0 as a GradScaler hands them over (the optimizer's grad_scale and found_inf attributes):
    torch's CPU kernel then writes the unscaled gradient back, which at a scale of 1.0 changes nothing.
    On the CPU, torch's OpenMP threads spin for a while after each of its parallel ops (libgomp's default
    OMP_WAIT_POLICY), so the cores that hotloop's pool wakes onto right after torch's step are busy; run with
    OMP_WAIT_POLICY=passive to see each side without the other's threads in the way. That is also why, on the
    CPU, hotloop hands a set of large tensors to torch's own fused kernel (NOTE [ CPU steps of large tensors go
    to torch ]): the rows of such a set then compare that hand-over's cost with torch's own step."""
    torch = ctx.torch
    from .. import optim
    from ..optim import torch_cpu_step

    where = "CPU, torch.get_num_threads() = %d" % torch.get_num_threads() if not ctx.is_cuda else str(ctx.device)
    # more repetitions than --quick's 3 on the CPU: each step takes milliseconds, and a busy host is noisy
    reps = 9 if ctx.quick and not ctx.is_cuda else 20
    for label, shapes in _step_sets(ctx):
        base = parameters_with_grads(torch, shapes, ctx.device)
        numel = sum(p.numel() for p in base)
        for dtype_name in STEP_DTYPES:
            dtype = getattr(torch, dtype_name)
            params = base
            if dtype is not torch.float32:
                params = [torch.nn.Parameter(p.detach().to(dtype)) for p in base]
                for p, b in zip(params, base):
                    p.grad = b.grad.to(dtype)
            for name, kwargs in STEP_CASES:
                for scaled in (False, True):
                    ours = getattr(optim, name)(params, lr=LR, **kwargs)
                    theirs = getattr(torch.optim, name)(params, lr=LR, fused=True, **kwargs)
                    if scaled:
                        for opt in (ours, theirs):
                            opt.grad_scale = torch.ones((), device=ctx.device)
                            opt.found_inf = torch.zeros((), device=ctx.device)
                    ours.step()
                    theirs.step()
                    ms, torch_ms = _alternate_reps(ctx, [ours.step, theirs.step], reps, warmup=1 if ctx.quick else 3)
                    args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
                    by_torch = not ctx.is_cuda and torch_cpu_step.torch_takes(params, [[]] * len(params))
                    scaler = " + grad_scale, found_inf" if scaled else ""
                    yield Row("optim", f"{name}({args}).step(){scaler}, {label} {dtype_name} params "
                              f"({len(params)} tensors, {numel / 1e6:.0f} M)", ms, torch_ms, "ms",
                              note=f"hotloop.optim.{name} against torch.optim.{name}(fused=True); {where}"
                                   + ("; hotloop hands this set to torch's kernel" if by_torch else ""))
                    del ours, theirs
            del params
        del base
        if ctx.is_cuda:
            torch.cuda.empty_cache()


def _host_rows(ctx, GradScaler, AdamW):
    """Host (CPU) time per step for many tensors: the Python and launch cost, the device synchronized
    before and after each timed call."""
    torch = ctx.torch
    small = ctx.quick or not ctx.is_cuda
    hidden, layers = MODEL_TINY if small else MODEL_2000
    params = parameters_with_grads(torch, transformer_shapes(hidden, layers), ctx.device)
    tag = f"{'tiny' if small else '2,000-tensor'} model ({len(params)} tensors)"
    (hotloop_step, torch_step, _), (opt_ours, opt_theirs) = _steps(ctx, params, GradScaler, AdamW)
    ms, torch_ms = ctx.compare(hotloop_step, torch_step, timer=ctx.host_time_ms)
    yield Row("optim", f"host time unscale+clip+AdamW+update, {tag}", ms, torch_ms, "ms",
              note="CPU time per step, not waiting for the device; hotloop: its scaler + hotloop.optim.AdamW; "
                   "torch: its scaler + clip_grad_norm_(foreach) + AdamW(fused=True)")
    ms, torch_ms = ctx.compare(opt_ours.step, opt_theirs.step, timer=ctx.host_time_ms)
    yield Row("optim", f"host time AdamW.step() alone, {tag}", ms, torch_ms, "ms",
              note="hotloop.optim.AdamW against torch.optim.AdamW(fused=True), no scaler")
    del params, opt_ours, opt_theirs
    if ctx.is_cuda:
        torch.cuda.empty_cache()

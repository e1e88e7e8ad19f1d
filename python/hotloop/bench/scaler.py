"""Benchmark rows for hotloop.GradScaler against torch.amp.GradScaler: unscale+clip, scan/apply bandwidth, a full fused-AdamW step, host time.

Transformer-shaped float32 gradient sets (models.transformer_shapes): 1.3 B parameters (481 tensors),
353 M (289 tensors) and a 2,000-tensor model; MODEL_TINY with --quick or on the CPU. The scale is 1.0
and max_norm too large to bite, so that repeated runs keep the same values (never time on zeros)
while every pass still reads and writes what it would in training. Each timed call ends with the
scaler's update(), both ways, as a training step does: the next call then starts a new step.
"""
import statistics
import warnings

from .harness import Row
from .models import MODEL_1_3B, MODEL_353M, MODEL_TINY, transformer_shapes

MODEL_2000 = (320, 166)  # 1 + 12 * 166 = 1,993 tensors, ~220 M elements
MAX_NORM = 1e30


def parameters_with_grads(torch, shapes, device):
    """float32 parameters of these shapes, each holding a random float32 gradient (never zeros)"""
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, device=device).normal_())
        p.grad = torch.randn(shape, device=device)
        params.append(p)
    return params


def count_syncs(ctx, fn):
    """host syncs torch reports during fn (torch.cuda.set_sync_debug_mode), or None on the CPU"""
    torch = ctx.torch
    if not ctx.is_cuda:
        return None
    ctx.sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    ctx.sync()
    # only torch's per-call warning counts (the first set_sync_debug_mode also warns that the mode is
    # a prototype; that one is not a sync)
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def _repeated(fn, times):
    """fn run `times` times back to back: the host prepares call i+1 while the device runs call i,
    as in a training loop, so the bandwidth rows measure the device and not the launch gap"""
    def run():
        for _ in range(times):
            fn()
    return run


def _apply_pass_ms(ctx, scaler, opt, reps):
    """Milliseconds of hotloop's apply pass alone (finalize_grads_) in `reps` steps back to back; each
    step's clip_grad_norm_ (the read pass that leaves the apply pending) and update() run outside
    the timing events, so the device time between them is the apply pass's."""
    torch = ctx.torch
    spans = []
    for _ in range(reps):
        scaler.clip_grad_norm_(opt, MAX_NORM)
        if ctx.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            scaler.finalize_grads_(opt)
            end.record()
            spans.append((start, end))
        else:
            spans.append(ctx.time_ms(lambda: scaler.finalize_grads_(opt)))
        scaler.update()
    if not ctx.is_cuda:
        return sum(spans)
    ctx.sync()
    return sum(start.elapsed_time(end) for start, end in spans)


def unit_scalers(ctx, GradScaler):
    """(hotloop's, torch's) scaler at scale 1.0 that never grows, lazily initialised on the device"""
    torch = ctx.torch
    ours = GradScaler(ctx.device.type, init_scale=1.0, growth_interval=10**9)
    theirs = torch.amp.GradScaler(ctx.device.type, init_scale=1.0, growth_interval=10**9)
    for scaler in (ours, theirs):
        scaler.scale(torch.ones((), device=ctx.device))
    return ours, theirs


def _clip_fns(torch, ours, theirs, opt, params):
    """unscale + clip, each way: hotloop's clip_grad_norm_ plus the apply pass step() runs for a
    non-fused optimizer (finalize_grads_); torch's unscale_ + clip_grad_norm_(foreach)"""
    def hotloop_clip():
        ours.clip_grad_norm_(opt, MAX_NORM)
        ours.finalize_grads_(opt)
        ours.update()

    def torch_clip():
        theirs.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        theirs.update()

    return hotloop_clip, torch_clip


def step_fns(torch, ours, theirs, opt_ours, opt_theirs, params):
    """a whole scaler step, each way, as a training loop with clipping writes it"""
    def hotloop_step():
        ours.clip_grad_norm_(opt_ours, MAX_NORM)
        ours.step(opt_ours)
        ours.update()

    def torch_step():
        theirs.unscale_(opt_theirs)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        theirs.step(opt_theirs)
        theirs.update()

    return hotloop_step, torch_step


def _model(ctx, big):
    if ctx.quick or not ctx.is_cuda:
        return MODEL_TINY, "tiny"
    return big, {MODEL_1_3B: "1.3 B", MODEL_353M: "353 M", MODEL_2000: "2,000-tensor"}[big]


def rows(ctx):
    torch = ctx.torch
    from ..amp import GradScaler

    sizes = [MODEL_1_3B, MODEL_353M] if not (ctx.quick or not ctx.is_cuda) else [MODEL_TINY]
    ceiling = ctx.copy_rate_gbps()  # what the passes' bandwidth is held against: a copy's, measured here
    for size in sizes:
        (hidden, layers), label = _model(ctx, size)
        params = parameters_with_grads(torch, transformer_shapes(hidden, layers), ctx.device)
        grads = [p.grad for p in params]
        numel = sum(g.numel() for g in grads)
        tag = f"{label} fp32 grads ({len(params)} tensors, {numel / 1e6:.0f} M)"
        opt = torch.optim.SGD(params, lr=0.0)
        ours, theirs = unit_scalers(ctx, GradScaler)
        hotloop_clip, torch_clip = _clip_fns(torch, ours, theirs, opt, params)
        ms, torch_ms = ctx.compare(hotloop_clip, torch_clip)
        yield Row("scaler", f"unscale+clip, {tag}", ms, torch_ms, "ms",
                  note="hotloop: clip_grad_norm_ + apply; torch: unscale_ + clip_grad_norm_(foreach)")

        def hotloop_scan():
            ours.clip_grad_norm_(opt, MAX_NORM)
            ours.update()  # a few microseconds of one thread: counted against hotloop

        def torch_scan():
            torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)

        reps = 1 if ctx.quick or not ctx.is_cuda else 10
        ms, torch_ms = ctx.compare(_repeated(hotloop_scan, reps), _repeated(torch_scan, reps))
        ms, torch_ms = ms / reps, torch_ms / reps
        gb = numel * 4 / 1e9
        yield Row("scaler", f"scan (norm+inf/NaN) read GB/s, {label}", gb / (ms * 1e-3), gb / (torch_ms * 1e-3),
                  "GB/s", note=f"hotloop {gb / (ms * 1e-3) / ceiling:.0%} of the copy rate here ({ceiling:.0f} GB/s); "
                               f"torch: get_total_norm(foreach); {reps} calls back to back per timing")

        coef = torch.ones((), device=ctx.device)

        def torch_apply():
            torch._foreach_mul_(grads, coef)

        ms, torch_ms = ctx.compare(lambda: _apply_pass_ms(ctx, ours, opt, reps),
                                   lambda: ctx.time_ms(_repeated(torch_apply, reps)), timer=lambda measure: measure())
        ms, torch_ms = ms / reps, torch_ms / reps
        yield Row("scaler", f"apply (read+write) GB/s, {label}", 2 * gb / (ms * 1e-3), 2 * gb / (torch_ms * 1e-3),
                  "GB/s", note=f"hotloop {2 * gb / (ms * 1e-3) / ceiling:.0%} of the copy rate here ({ceiling:.0f} GB/s); "
                               "torch: _foreach_mul_; hotloop: finalize_grads_ timed alone")

        if size is sizes[0]:
            yield from _full_step_rows(ctx, params, tag, GradScaler)
        del params, grads, opt
        if ctx.is_cuda:
            torch.cuda.empty_cache()

    yield from _host_rows(ctx, GradScaler)


def _full_step_rows(ctx, params, tag, GradScaler):
    """unscale + clip + AdamW step + update: fused (no sync for either) and foreach (torch syncs once)."""
    torch = ctx.torch
    for kind in ("fused", "foreach"):
        opt_ours = torch.optim.AdamW(params, lr=1e-12, **{kind: True})
        opt_theirs = torch.optim.AdamW(params, lr=1e-12, **{kind: True})
        ours, theirs = unit_scalers(ctx, GradScaler)
        hotloop_step, torch_step = step_fns(torch, ours, theirs, opt_ours, opt_theirs, params)
        hotloop_step()
        torch_step()  # optimizer state allocated outside the counted step
        if kind == "fused":
            yield from _fused_alone_row(ctx, opt_ours, opt_theirs, ours, tag)
        syncs = (count_syncs(ctx, hotloop_step), count_syncs(ctx, torch_step))
        ms, torch_ms = ctx.compare(hotloop_step, torch_step)
        sync_note = "n/a on CPU" if syncs[0] is None else f"host syncs per step: hotloop {syncs[0]}, torch {syncs[1]}"
        yield Row("scaler", f"unscale+clip+{kind} AdamW step+update, {tag}", ms, torch_ms, "ms", note=sync_note)
        del opt_ours, opt_theirs
        if ctx.is_cuda:
            torch.cuda.empty_cache()


def _fused_alone_row(ctx, opt_ours, opt_theirs, ours, tag):
    """What a fused AdamW step costs by itself with grad_scale/found_inf (what hotloop hands it) and
    without (what torch's path runs after unscale_): torch's fused kernel writes the unscaled
    gradients back when it gets a grad_scale, one more pass over the gradients."""
    torch = ctx.torch
    grad_scale = torch.full((), ours.get_scale(), device=ctx.device)
    found_inf = torch.zeros((), device=ctx.device)

    def with_scale():
        opt_ours.grad_scale, opt_ours.found_inf = grad_scale, found_inf
        opt_ours.step()
        del opt_ours.grad_scale, opt_ours.found_inf

    ms, torch_ms = ctx.compare(with_scale, opt_theirs.step)
    yield Row("scaler", f"fused AdamW step alone: with grad_scale+found_inf vs without, {tag}", ms, torch_ms, "ms",
              note="the floor under hotloop's full step (torch's kernel stores grads when given grad_scale)")


def _host_rows(ctx, GradScaler):
    """Host (CPU) time per step for many tensors: the Python and launch cost, not the GPU's."""
    torch = ctx.torch
    (hidden, layers), label = _model(ctx, MODEL_2000)
    params = parameters_with_grads(torch, transformer_shapes(hidden, layers), ctx.device)
    tag = f"{label} model ({len(params)} tensors)"
    opt = torch.optim.AdamW(params, lr=1e-12, fused=True)
    opt_theirs = torch.optim.AdamW(params, lr=1e-12, fused=True)
    ours, theirs = unit_scalers(ctx, GradScaler)
    hotloop_clip, torch_clip = _clip_fns(torch, ours, theirs, opt, params)
    ms, torch_ms = ctx.compare(hotloop_clip, torch_clip, timer=ctx.host_time_ms)
    yield Row("scaler", f"host time unscale+clip, {tag}", ms, torch_ms, "ms",
              note="CPU time per call, not waiting for the device")

    hotloop_step, torch_step = step_fns(torch, ours, theirs, opt, opt_theirs, params)
    ms, torch_ms = ctx.compare(hotloop_step, torch_step, timer=ctx.host_time_ms)
    alone = statistics.median(ctx.host_time_ms(opt_theirs.step) for _ in range(3 if ctx.quick else 10))
    yield Row("scaler", f"host time unscale+clip+fused AdamW+update, {tag}", ms, torch_ms, "ms",
              note=f"CPU time per step; of which torch's fused AdamW.step alone: {alone:.3g} ms")
    del params, opt, opt_theirs
    if ctx.is_cuda:
        torch.cuda.empty_cache()

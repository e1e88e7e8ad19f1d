"""Benchmark rows for hotloop.ops: the non-finite check against torch's foreach check-and-unscale."""

from ..amp import ops
from .harness import Row
from .models import MODEL_353M, MODEL_TINY, transformer_shapes


def rows(ctx):
    torch = ctx.torch

    hidden, layers = MODEL_TINY if (ctx.quick or not ctx.is_cuda) else MODEL_353M
    shapes = transformer_shapes(hidden, layers)
    grads = [torch.randn(s, device=ctx.device) for s in shapes]
    numel = sum(g.numel() for g in grads)
    found = torch.zeros(1, device=ctx.device)
    one = torch.ones(1, device=ctx.device)

    def ours():
        ops.non_finite_check(grads)

    def theirs():
        # what torch.amp.GradScaler runs to find inf/NaN (it also multiplies by 1.0 here, in place)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)

    ms, torch_ms = ctx.compare(ours, theirs)
    label = f"non_finite_check, {len(grads)} fp32 tensors, {numel / 1e6:.0f} M elements"
    yield Row("ops", label, ms, torch_ms, "ms", note="torch: _amp_foreach_non_finite_check_and_unscale_")
    gbps = numel * 4 / (ms * 1e-3) / 1e9
    yield Row("ops", "non_finite_check read bandwidth", gbps, numel * 4 / (torch_ms * 1e-3) / 1e9, "GB/s",
              note="bytes read once over time (torch also writes them)")

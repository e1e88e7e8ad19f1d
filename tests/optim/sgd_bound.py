"""How far hotloop's SGD may be from torch's fused SGD after some steps, and which parameters torch's
vectorized CUDA path rounds one way: for the SGD tests and the CUDA-graph capture tests."""
import torch


def param_bound(steps, lr, ref):
    """Per element |ours - torch's| after `steps` steps: the gradients are the same, and each step may
    round the parameter, the decayed gradient and the buffer differently by an ulp or so (ours in float
    with an fma or up to three roundings each, as torch's CUDA kernel; torch's CPU kernel up to three times
    in float; both with float32 lr, momentum and 1 - dampening, each within 2**-25 of the double: inside
    the same ulp allowance); the
    buffer's rounding is carried by later steps with weight momentum / (1 - momentum) <= 10 here."""
    return steps * 2.0**-22 * (ref.abs() + 16 * lr * 10)


def rounded_one_way_by_torch(params, scaled):
    """The indices of the parameters whose every element torch's fused CUDA SGD rounds the same way. Under
    a grad_scale, its vectorized path (a chunk of a multiple of 4 elements, all tensors 16-byte aligned)
    rounds p - lr * g per lane: one rounding (fma) in lane 3 of each 4, two (the product rounded first) in
    lanes 0-2, where every other path takes the fma (measured on the H200, torch 2.11: each lane matched
    one form in all 16,384 of its elements, of 65,536; nvcc's contraction of one line, which hotloop does
    not copy). With torch's 65,536-element chunks, a tensor of numel % 4 != 0 never takes that path."""
    return {i for i, p in enumerate(params) if not scaled or p.numel() % 4 != 0}


def assert_close_to_torch(ours, ref, ours_params, ref_params, steps, lr):
    for i, (p, q) in enumerate(zip(ours_params, ref_params, strict=True)):
        bound = param_bound(steps, lr, q.detach())
        err = (p.detach() - q.detach()).abs()
        assert bool((err <= bound).all()), f"param {i}: worst {float((err / bound).max())} of the bound"
        so, sr = ours.state.get(p, {}), ref.state.get(q, {})
        assert set(so) == set(sr)
        if "momentum_buffer" in so:
            # each step rounds a sum of terms up to about 8 (gradients of 5 sigma and more) up to three
            # times on each side (ours: momentum * buf, (1 - dampening) * g, their sum), 2**-24 * 8 each,
            # and the buffer carries that with weight 1 / (1 - momentum); seen: 1.25e-6 at 0.9
            atol = 6 * 2.0**-24 * 8 / (1 - ours.param_groups[0]["momentum"])
            torch.testing.assert_close(so["momentum_buffer"], sr["momentum_buffer"], rtol=1e-5, atol=atol)

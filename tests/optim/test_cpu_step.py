"""The C reference's CPU step (csrc/optim_cpu.c): its 8-wide AVX2 path gives the bits of its scalar path (NOTE
[ The C reference's vector path ]), float16/bfloat16 conversions and NaNs included, for every dtype pair a
table may hold, and a step split across threads gives the bits of one thread's."""
import copy

import pytest
import torch

from ..seeding import derived_seed
from . import c_calls

# (parameter and state dtype, gradient dtype): what csrc/optim.c lets through
PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
         (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)]
ADAM = [dict(amsgrad=False), dict(amsgrad=True, maximize=True, decoupled=False, weight_decay=0.05),
        dict(amsgrad=False, weight_decay=0.0)]
SGD = [dict(), dict(nesterov=False, dampening=0.25, maximize=True), dict(first_step=True, weight_decay=0.0)]
N = 16 * 18 + 8 + 5  # 16 at a time (AVX-512), 8 (AVX2), then a scalar tail: each path the CPU has


def spread(n, gen, lo=-9, hi=3):
    """values of magnitudes 10**lo .. 10**hi, both signs: normal and subnormal halves, and their rounding"""
    mag = 10.0 ** (torch.rand(n, generator=gen) * (hi - lo) + lo)
    return mag * torch.sign(torch.randn(n, generator=gen))


def bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def as_one_element_tensors(t):
    return [t[i:i + 1].clone() for i in range(t.numel())]


# a GradScaler's power-of-two scale (the vector paths multiply by its exact reciprocal, NOTE [ Dividing by a power
# of two ]) and a clip-folded one that is not (they divide)
SCALES = [64.0, 48.3]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("steps", [3.0, 1e5])  # after 1e5 steps 1 - beta2**t rounds to 1: bc2_sqrt is a power of two
@pytest.mark.parametrize("kwargs", ADAM)
@pytest.mark.parametrize("dtype,grad_dtype", PAIRS)
def test_adam_vector_path_gives_the_scalar_paths_bits(dtype, grad_dtype, kwargs, steps, scale):
    """One tensor of N elements (8 at a time, then a tail) against the same elements as N one-element tensors
    (each takes the scalar path): every bit of parameters and moments, NaN and inf gradients included."""
    gen = torch.Generator().manual_seed(derived_seed())
    p = spread(N, gen, -6, 1).to(dtype)
    g = (spread(N, gen) * 64).to(grad_dtype)
    g[3], g[17], g[N - 2] = float("nan"), float("inf"), -float("inf")
    kwargs = dict(kwargs)  # the parametrized dict is shared by the runs
    amsgrad = kwargs.pop("amsgrad")
    state = {"exp_avg": spread(N, gen, -8, 0).to(dtype), "exp_avg_sq": spread(N, gen, -9, 1).abs().to(dtype),
             "step": torch.tensor(steps)}
    if amsgrad:
        state["max_exp_avg_sq"] = spread(N, gen, -9, 1).abs().to(dtype)
    scalar_params = as_one_element_tensors(p)
    scalar_states = [{k: (v[i:i + 1].clone() if v.dim() else v.clone()) for k, v in state.items()} for i in range(N)]
    scale = torch.tensor(scale)
    c_calls.adam([p], [g], [state], grad_scale=scale, amsgrad=amsgrad, **kwargs)
    c_calls.adam(scalar_params, as_one_element_tensors(g), scalar_states, grad_scale=scale, amsgrad=amsgrad, **kwargs)
    assert torch.equal(bits(p), bits(torch.cat(scalar_params)))
    for key in state:
        if key != "step":
            assert torch.equal(bits(state[key]), bits(torch.cat([s[key] for s in scalar_states]))), key
    assert float(state["step"]) == steps + 1


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("kwargs", SGD)
@pytest.mark.parametrize("dtype,grad_dtype", PAIRS)
def test_sgd_vector_path_gives_the_scalar_paths_bits(dtype, grad_dtype, kwargs, scale):
    gen = torch.Generator().manual_seed(derived_seed())
    p = spread(N, gen, -6, 1).to(dtype)
    g = (spread(N, gen) * 64).to(grad_dtype)
    g[5], g[N - 1] = float("nan"), float("inf")
    buf = spread(N, gen, -8, 0).to(dtype)
    scalar_params, scalar_bufs = as_one_element_tensors(p), as_one_element_tensors(buf)
    scale = torch.tensor(scale)
    c_calls.sgd([p], [g], [buf], grad_scale=scale, **kwargs)
    c_calls.sgd(scalar_params, as_one_element_tensors(g), scalar_bufs, grad_scale=scale, **kwargs)
    assert torch.equal(bits(p), bits(torch.cat(scalar_params)))
    assert torch.equal(bits(buf), bits(torch.cat(scalar_bufs)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_give_one_threads_bits(dtype):
    """Tensors of several chunks (32768 elements) and small ones between them, stepped on one thread and on
    three: the same bits, and each step count taken once."""
    gen = torch.Generator().manual_seed(derived_seed())
    shapes = [(5 * 32768 + 3,), (7,), (4 * 32768,), (1,), (65537,)]
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    states = [{"exp_avg": torch.randn(s, generator=gen).to(dtype),
               "exp_avg_sq": torch.rand(s, generator=gen).to(dtype), "step": torch.tensor(float(i))}
              for i, s in enumerate(shapes)]
    params2, states2 = [p.clone() for p in params], copy.deepcopy(states)
    c_calls.adam(params, grads, states, threads=1)
    c_calls.adam(params2, grads, states2, threads=3)
    for p, q in zip(params, params2, strict=True):
        assert torch.equal(p, q)
    for s, s2, i in zip(states, states2, range(len(shapes)), strict=True):
        assert float(s2["step"]) == float(s["step"]) == i + 1
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s[key], s2[key])
    bufs = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    params2, bufs2 = [p.clone() for p in params], [b.clone() for b in bufs]
    c_calls.sgd(params, grads, bufs, threads=1)
    c_calls.sgd(params2, grads, bufs2, threads=4)
    assert all(torch.equal(a, b) for a, b in zip(params + bufs, params2 + bufs2, strict=True))


def test_threads_must_be_positive():
    p = [torch.randn(3)]
    with pytest.raises(ValueError, match="threads: expected >= 1"):
        c_calls.sgd(p, [torch.randn(3)], None, threads=0)

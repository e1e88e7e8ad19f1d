"""float16 and bfloat16 parameters (issue 36): the moments and buffers in the parameter's dtype as torch's fused
optimizers keep them, each step against torch's fused step of the same dtype from the same state, a param group
that mixes dtypes, and on the GPU the kernel against the C reference and torch's CUDA kernel."""
import pytest
import torch

import hotloop.optim

from ..seeding import derived_seed, seeded_generator
from . import c_calls
from .conftest import assert_mostly_identical, fresh_state

HALVES = [torch.float16, torch.bfloat16]
SHAPES = [(1,), (555,), (65537,), (3, 7)]
CASES = [
    ("AdamW", dict(lr=1e-2)),
    ("Adam", dict(lr=1e-2, amsgrad=True, maximize=True)),
    ("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("SGD", dict(lr=1e-2, momentum=0.8, dampening=0.1)),
]


def state_keys(name, kwargs):
    if name == "SGD":
        return ["momentum_buffer"]
    return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kwargs.get("amsgrad") else [])


def ulp(x):
    """the spacing of x's dtype at |x|: the gap to the next representable value away from zero"""
    a = x.abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))).float() - a.float())


def assert_within_one_ulp(a, b, what):
    """every element of a within one unit in the last place (of its dtype, at the larger magnitude) of b's"""
    err = (a.float() - b.float()).abs()
    bound = torch.maximum(ulp(a), ulp(b))
    bad = err > bound
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} elements beyond one ulp, worst {float(err.max())}"


def make(name, kwargs, dtypes, device, seed):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dt) for s, dt in zip(SHAPES, dtypes, strict=True)]
    ours_params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    ref_params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    ours = getattr(hotloop.optim, name)(ours_params, **kwargs)
    ref = getattr(torch.optim, name)(ref_params, fused=True, **kwargs)
    return ours, ref, ours_params, ref_params


def set_grads(ours_params, ref_params, gen):
    for p, q in zip(ours_params, ref_params, strict=True):
        g = torch.randn(p.shape, generator=gen).to(p.dtype).to(p.device)
        p.grad, q.grad = g.clone(), g.clone()


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("name,kwargs", CASES)
def test_half_step_is_the_float32_step_rounded_once(name, kwargs, dtype):
    """torch's opmath rule, bit for bit: a step of half parameters, gradients and state gives the float32 step
    of their widened values, each result rounded once to the dtype (ours in float32 is torch's CUDA arithmetic,
    checked against torch in test_adam/test_sgd). Five steps, the float32 side restarted each time from the
    half values."""
    gen = torch.Generator().manual_seed(derived_seed())
    half = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    wide = [torch.nn.Parameter(p.detach().float()) for p in half]
    ours, ours32 = getattr(hotloop.optim, name)(half, **kwargs), getattr(hotloop.optim, name)(wide, **kwargs)
    keys = state_keys(name, kwargs)
    for step in range(5):
        for p, w in zip(half, wide, strict=True):
            p.grad = (torch.randn(p.shape, generator=gen) * 4).to(dtype)
            w.grad = p.grad.float()
        ours.step()
        ours32.step()
        for i, (p, w) in enumerate(zip(half, wide, strict=True)):
            assert torch.equal(p.detach(), w.detach().to(dtype)), f"step {step} param {i}"
            for key in keys:
                assert ours.state[p][key].dtype == dtype
                assert torch.equal(ours.state[p][key], ours32.state[w][key].to(dtype)), f"step {step} param {i} {key}"
                ours32.state[w][key].copy_(ours.state[p][key])
            w.detach().copy_(p.detach())


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("name,kwargs", CASES)
def test_steps_match_torch_fused_on_cpu(name, kwargs, dtype):
    """Ten steps against torch's fused CPU step of the same dtype, each from torch's state (copied into ours
    after the comparison, as torch's own optimizer tests resync with their TensorTracker) and within the
    tolerance those tests use (assert_close's default for the dtype); the state in the parameter's dtype. Not
    bit for bit: ours is torch's CUDA arithmetic (kernels/optim_math.h: (1 - beta) inside an fma on a float32
    beta, the moments' fmas), torch's CPU kernel another float arithmetic, so the two float results differ by
    a few float ulps (a few hundred for exp_avg_sq: 1 - float32(beta2) differs from float32(1 - beta2) by
    1.3e-5 of itself) and round to different half values where they straddle a rounding boundary: rarely, so
    at least 98 % of the elements of each kind are bit-identical (a wrong formula misses that by far)."""
    seed = derived_seed()
    ours, ref, ours_params, ref_params = make(name, kwargs, [dtype] * len(SHAPES), "cpu", seed)
    gen = torch.Generator().manual_seed(seed + 1)
    keys = state_keys(name, kwargs)
    same, total = {}, 0
    for step in range(10):
        set_grads(ours_params, ref_params, gen)
        ours.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours_params, ref_params, strict=True)):
            assert p.dtype == dtype
            pairs = [("param", p.detach(), q.detach())] + [(k, ours.state[p][k], ref.state[q][k]) for k in keys]
            for key, a, b in pairs:
                assert a.dtype == b.dtype == dtype, key
                torch.testing.assert_close(a, b, msg=lambda m: f"step {step} param {i} {key}: {m}")
                same[key] = same.get(key, 0) + int((a == b).sum())
                a.copy_(b)
            total += p.numel()
            if name != "SGD":
                assert ours.state[p]["step"].dtype == torch.float32
                assert float(ours.state[p]["step"]) == float(ref.state[q]["step"]) == step + 1
    for key, n in same.items():
        assert n >= 0.98 * total, f"{key}: {n} of {total} elements bit-identical"


@pytest.mark.parametrize("name,kwargs", [CASES[0], CASES[2]])
def test_a_group_of_mixed_dtypes(name, kwargs):
    """float32, float16 and bfloat16 parameters in one param group (torch's fused optimizers group them by
    dtype): each keeps its state in its own dtype and steps as torch's; float32 within float32 rounding."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
    ours, ref, ours_params, ref_params = make(name, kwargs, dtypes, "cpu", derived_seed())
    set_grads(ours_params, ref_params, seeded_generator(7))
    ours.step()
    ref.step()
    for i, (p, q, dt) in enumerate(zip(ours_params, ref_params, dtypes, strict=True)):
        assert p.dtype == dt and all(ours.state[p][k].dtype == dt for k in state_keys(name, kwargs))
        # float32 within its rounding, the halves within the tolerance of torch's own tests (see above)
        tolerance = dict(rtol=2.0**-20, atol=0) if dt is torch.float32 else {}
        torch.testing.assert_close(p.detach(), q.detach(), **tolerance, msg=lambda m: f"param {i}: {m}")


@pytest.mark.parametrize("dtype", HALVES)
def test_state_of_another_dtype_is_refused(dtype):
    p = torch.nn.Parameter(torch.randn(6, dtype=dtype))
    p.grad = torch.randn(6, dtype=dtype)
    opt = hotloop.optim.AdamW([p])
    opt.step()
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].float()
    before = p.detach().clone()
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=f"state 'exp_avg' must be a {name} tensor"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("dtype", HALVES)
def test_c_table_refuses_mismatched_dtypes(dtype):
    """The C entry point checks what Python checks: a half parameter's gradient and moments of its dtype."""
    p = torch.randn(8, dtype=dtype)
    states = [{"exp_avg": torch.zeros(8, dtype=dtype), "exp_avg_sq": torch.zeros(8), "step": torch.tensor(0.0)}]
    with pytest.raises(TypeError, match="exp_avg_sqs: tensor 0: expected"):
        c_calls.adam([p], [torch.randn(8, dtype=dtype)], states)
    states[0]["exp_avg_sq"] = torch.zeros(8, dtype=dtype)
    with pytest.raises(TypeError, match="grads: tensor 0: expected"):
        c_calls.adam([p], [torch.randn(8)], states)


def half_state(params, amsgrad, dtype):
    return [{k: (v.to(dtype) if k != "step" else v) for k, v in s.items()} for s in fresh_state(params, amsgrad)]


@pytest.mark.gpu
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("dtype", HALVES)
def test_kernel_matches_c_reference(dtype, amsgrad):
    """Half parameters and moments: the kernel against the C reference on CPU copies. The moments bit for bit
    (the same float operations, rounded once on store); the parameters within one ulp of their dtype, and
    equal but for a few: only powf in the bias corrections may differ between CUDA and glibc, by an ulp of
    float, which moves a parameter's rounding only where it straddles a boundary."""
    params = [torch.randn(s).to(dtype) for s in SHAPES]
    grads = [(torch.randn(s) * 256).to(dtype) for s in SHAPES]
    states = half_state(params, amsgrad, dtype)
    d_params, d_grads = [p.cuda() for p in params], [g.cuda() for g in grads]
    d_states = [{k: v.cuda() for k, v in s.items()} for s in states]
    scale, found = torch.tensor(256.0), torch.tensor(0.0)
    call = dict(grad_scale=scale, found_inf=found, amsgrad=amsgrad, lr=1e-2)
    c_calls.adam(params, grads, states, **call)
    c_calls.adam(d_params, d_grads, d_states, **dict(call, grad_scale=scale.cuda(), found_inf=found.cuda()))
    torch.cuda.synchronize()
    differ = 0
    for p, q in zip(params, d_params, strict=True):
        assert_within_one_ulp(q.cpu(), p, "param")
        differ += int((q.cpu() != p).sum())
    assert differ <= 1e-3 * sum(p.numel() for p in params)
    for s, t in zip(states, d_states, strict=True):
        for k in s:
            assert torch.equal(t[k].cpu(), s[k]), k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALVES)
def test_sgd_kernel_matches_c_reference(dtype):
    params = [torch.randn(s).to(dtype) for s in SHAPES]
    grads = [(torch.randn(s) * 64).to(dtype) for s in SHAPES]
    bufs = [torch.rand_like(p) for p in params]
    d_params, d_grads, d_bufs = [p.cuda() for p in params], [g.cuda() for g in grads], [b.cuda() for b in bufs]
    c_calls.sgd(params, grads, bufs, grad_scale=torch.tensor(64.0))
    c_calls.sgd(d_params, d_grads, d_bufs, grad_scale=torch.tensor(64.0, device="cuda"))
    torch.cuda.synchronize()
    for a, b in zip(d_params + d_bufs, params + bufs, strict=True):
        assert torch.equal(a.cpu(), b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("name,kwargs", CASES)
def test_steps_match_torch_fused_on_gpu(name, kwargs, dtype):
    """Twenty steps against torch's fused CUDA step of the same dtype, the same float arithmetic rounded once
    on store: bit-identical but where nvcc contracted torch's source otherwise than optim_math.h guesses
    (conftest.assert_mostly_identical: at most 1e-4 of the elements), and all within torch's own
    tolerance for the dtype."""
    seed = derived_seed()
    ours, ref, ours_params, ref_params = make(name, kwargs, [dtype] * len(SHAPES), "cuda", seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(20):
        set_grads(ours_params, ref_params, gen)
        ours.step()
        ref.step()
    keys = state_keys(name, kwargs)
    assert_mostly_identical(ours, ref, ours_params, ref_params, keys)
    for p, q in zip(ours_params, ref_params, strict=True):
        torch.testing.assert_close(p.detach(), q.detach())
        for key in keys:
            assert ours.state[p][key].dtype == dtype
            torch.testing.assert_close(ours.state[p][key], ref.state[q][key])

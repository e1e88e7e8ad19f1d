"""hotloop.optim.Adam/AdamW against torch's fused Adam/AdamW: 200 steps under each one's GradScaler with inf/NaN
injected, state dicts both ways, the C reference over float16/bfloat16 gradients, and bad input."""
import copy

import numpy as np
import pytest
import torch

import hotloop.optim
from hotloop.amp import GradScaler

from ..seeding import derived_seed
from . import c_calls
from .adam_bound import AdamBound, state_of
from .conftest import (DEVICES, INJECT, SHAPES, STEPS, assert_mostly_identical, assert_same_tensors, fresh_state,
                       shapes_for)

CASES = [
    ("AdamW", {}),
    ("AdamW", dict(lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True)),
    ("AdamW", dict(maximize=True, eps=1e-6)),
    ("Adam", {}),
    ("Adam", dict(weight_decay=0.05, amsgrad=True)),
    ("Adam", dict(weight_decay=0.05, decoupled_weight_decay=True)),
]


def bias_correction_error(t, beta1, beta2):
    """Relative error of an update at step t from float32 betas in the bias corrections (ours, as torch's
    CUDA kernel: 1 - f32(beta)^t) against double ones (torch's CPU kernel): |d(beta^t)| = t beta^(t-1) |dbeta|,
    relative to 1 - beta^t, and half of that through bc2's square root."""
    d1, d2 = abs(float(np.float32(beta1)) - beta1), abs(float(np.float32(beta2)) - beta2)
    return t * beta1 ** (t - 1) * d1 / (1 - beta1**t) + t * beta2 ** (t - 1) * d2 / (2 * (1 - beta2**t))


def param_bound(steps, lr, ref, betas=(0.9, 0.999)):
    """Per element |ours - torch's| after `steps` steps of the same float arithmetic but for where each side
    rounds the parameter's decay and update: at most one float32 ulp each (2**-22 relative, with some room)
    of the parameter and of an update of at most 8 * lr (|m_hat| / sqrt(v_hat) <= (1 - beta1) /
    sqrt((1 - beta2)(1 - beta1^2 / beta2)) = 7.3 for the default betas), plus what float32 betas move the
    bias corrections by (bias_correction_error)."""
    bc = max(bias_correction_error(t, *betas) for t in range(1, steps + 1))
    return steps * (2.0**-22 * ref.abs() + (2.0**-22 + bc) * 8 * lr)


def make_pair(name, kwargs, device, seed):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes_for(device)]
    ours_params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    ref_params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    ours = getattr(hotloop.optim, name)(ours_params, **kwargs)
    ref = getattr(torch.optim, name)(ref_params, fused=True, **kwargs)
    return ours, ref, ours_params, ref_params


def snapshot(opt, params):
    return [p.detach().clone() for p in params] + [t.clone() for p in params for t in opt.state[p].values()]


def assert_close_to_torch(ours, ref, ours_params, ref_params, steps, lr):
    """After a few steps from the same state (checkpoint tests): parameters within param_bound, moments
    within what one step's roundings give, ours up to 3 times, torch's CPU kernel up to 4 times, both in
    float with float32 betas: 8 * 2**-24 relative of the new moment, plus (1 - beta) times the beta's
    float32 representation error on the gradient's term; 2**-20 relative of the larger element covers that.
    And ours takes the gradient's term with 1 - f32(beta) (torch's CUDA arithmetic), off by
    |f32(beta) - beta| g (g^2), which is at most |f32(beta) - beta| / (1 - beta) of the new moment for
    exp_avg_sq (v' >= (1 - beta2) g^2), and for exp_avg at most that of (1 - beta1) |g|: with
    1 / (1 - beta1) more room. The roundings are of the terms, not of their sum: exp_avg's two terms
    may cancel (an N(0, 1) gradient against the moment left m' at 1 % of either, CI seed 1344804070),
    so its scale is |m'| + (1 - beta1) |g| (the last step's gradient, still in p.grad), which bounds
    both terms; exp_avg_sq's terms are both positive. All times the steps."""
    beta1, beta2 = ref.param_groups[0]["betas"]
    beta_err = {"exp_avg": abs(float(np.float32(beta1)) - beta1) / (1 - beta1) ** 2,
                "exp_avg_sq": abs(float(np.float32(beta2)) - beta2) / (1 - beta2)}
    beta_err["max_exp_avg_sq"] = beta_err["exp_avg_sq"]
    for i, (p, q) in enumerate(zip(ours_params, ref_params, strict=True)):
        bound = param_bound(steps, lr, q.detach(), (beta1, beta2))
        err = (p.detach() - q.detach()).abs()
        assert bool((err <= bound).all()), f"param {i}: worst {float((err / bound).max())} of the bound"
        so, sr = ours.state[p], ref.state[q]
        assert set(so) == set(sr)
        assert so["step"].dtype == sr["step"].dtype == torch.float32
        assert float(so["step"]) == float(sr["step"])
        grad_term = (1 - beta1) * p.grad.abs() if p.grad is not None else 0.0
        for key in so:
            if key != "step":
                scale = torch.maximum(so[key].abs(), sr[key].abs())
                scale = (scale + grad_term if key == "exp_avg" else scale).amax()
                torch.testing.assert_close(so[key], sr[key], rtol=0,
                                           atol=float(steps * (2.0**-20 + beta_err[key]) * scale),
                                           msg=f"param {i} {key}")


def bound_for(ref, device, rel_g=0.0):
    """AdamBound for `ref`'s one param group, against torch's kernel on `device`"""
    g = ref.param_groups[0]
    return AdamBound(g["params"], g["lr"], *g["betas"], g["eps"], g["weight_decay"],
                     g.get("decoupled_weight_decay", False) or isinstance(ref, torch.optim.AdamW), g["amsgrad"],
                     torch_on_cuda=device == "cuda", rel_g=rel_g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,kwargs", CASES)
def test_matches_torch_under_grad_scaler(name, kwargs, device):
    """hotloop.GradScaler drives ours, torch.amp.GradScaler torch's fused one, on the same gradients:
    the same skipped steps, which change nothing, the same scale, parameters within param_bound."""
    seed = derived_seed()
    ours, ref, ours_params, ref_params = make_pair(name, kwargs, device, seed)
    ours_scaler = GradScaler(device, init_scale=2.0**12, growth_interval=25)
    ref_scaler = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=25)
    gen = torch.Generator().manual_seed(seed + 1)
    bound = bound_for(ref, device)
    skipped = 0
    for step in range(STEPS):
        sources = [torch.randn(s, generator=gen).to(device) for s in shapes_for(device)]
        if step in INJECT:
            t, e, value = INJECT[step]
            flat = sources[t].view(-1)
            flat[flat.numel() // 2 if e == "mid" else e] = value
        before = snapshot(ours, ours_params), snapshot(ref, ref_params)
        ref_before = state_of(ref, ref_params)
        for opt, scaler, params in ((ours, ours_scaler, ours_params), (ref, ref_scaler, ref_params)):
            opt.zero_grad()
            loss = sum((p * s).sum() for p, s in zip(params, sources, strict=True))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert ours_scaler.get_scale() == ref_scaler.get_scale(), f"step {step}"
        if step in INJECT:
            skipped += 1
            assert_same_tensors(snapshot(ours, ours_params), before[0])
            assert_same_tensors(snapshot(ref, ref_params), before[1])
        else:  # torch's fused step wrote the unscaled gradients back
            bound.step(step + 1 - skipped, [q.grad for q in ref_params], ref_before, state_of(ref, ref_params))
    assert float(ours.state[ours_params[0]]["step"]) == STEPS - skipped
    assert float(ref.state[ref_params[0]]["step"]) == STEPS - skipped
    bound.check(ours, ref, ours_params, ref_params)
    if device == "cuda":
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kwargs.get("amsgrad") else [])
        assert_mostly_identical(ours, ref, ours_params, ref_params, keys)


@pytest.mark.parametrize("name,kwargs", CASES[:2] + CASES[4:5])
def test_state_dict_loads_both_ways(name, kwargs):
    """ours -> torch's fused and non-fused and back: the same layout, and the next steps agree."""
    ours, ref, ours_params, ref_params = make_pair(name, kwargs, "cpu", derived_seed())
    for _ in range(3):
        for opt, params in ((ours, ours_params), (ref, ref_params)):
            for p in params:
                p.grad = torch.ones_like(p) * 0.5 + torch.rand_like(p)
        grads = [p.grad.clone() for p in ours_params]
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        ours.step()
        ref.step()
    saved, ref_saved = ours.state_dict(), ref.state_dict()
    assert saved["param_groups"] == ref_saved["param_groups"]
    for k, st in saved["state"].items():
        rst = ref_saved["state"][k]
        assert set(st) == set(rst)
        for key in st:
            assert st[key].dtype == rst[key].dtype and st[key].shape == rst[key].shape
            assert st[key].device == rst[key].device

    # ours -> torch's (fused, and foreach that keeps step on the CPU) -> ours
    for torch_kwargs in (dict(fused=True), dict(foreach=True)):
        params_t = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
        params_o = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
        their = getattr(torch.optim, name)(params_t, **kwargs, **torch_kwargs)
        their.load_state_dict(copy.deepcopy(saved))
        back = getattr(hotloop.optim, name)(params_o, **kwargs)
        back.load_state_dict(copy.deepcopy(their.state_dict()))
        for p in params_o:
            assert back.state[p]["step"].dtype == torch.float32
        grads = [torch.randn_like(p) for p in ours_params]
        for params, opt in ((params_t, their), (params_o, back)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
        assert_close_to_torch(back, their, params_o, params_t, 4, kwargs.get("lr", 1e-3))
        assert float(back.state[params_o[0]]["step"]) == 4.0


call_adam = c_calls.adam


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_c_reference_half_gradients(grad_dtype, amsgrad):
    """float16/bfloat16 gradients give bit for bit what their float32 values give: the kernel widens
    them exactly and never writes them."""
    params = [torch.randn(s) for s in SHAPES[:5]]
    grads = [(torch.randn(s) * 100).to(grad_dtype) for s in SHAPES[:5]]
    grads_before = [g.clone() for g in grads]
    states = fresh_state(params, amsgrad)
    params2, states2 = [p.clone() for p in params], copy.deepcopy(states)
    scale = torch.tensor(64.0)
    call_adam(params, grads, states, grad_scale=scale, amsgrad=amsgrad)
    call_adam(params2, [g.float() for g in grads], states2, grad_scale=scale, amsgrad=amsgrad)
    assert_same_tensors(params, params2)
    for s, s2 in zip(states, states2, strict=True):
        assert_same_tensors(list(s.values()), list(s2.values()))
    assert_same_tensors(grads, grads_before)


def test_c_reference_skip_and_unscale():
    """found_inf != 0: nothing written; grad_scale s gives what the gradients divided by s give."""
    params = [torch.randn(s) for s in SHAPES[:4]]
    grads = [torch.randn(s) * 1024 for s in SHAPES[:4]]
    states = fresh_state(params, True)
    before = [p.clone() for p in params], copy.deepcopy(states)
    call_adam(params, grads, states, grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(1.0), amsgrad=True)
    assert_same_tensors(params, before[0])
    for s, s2 in zip(states, before[1], strict=True):
        assert_same_tensors(list(s.values()), list(s2.values()))
    # 1024 is a power of two: dividing inside the update is exact, so the two agree bit for bit
    params2, states2 = [p.clone() for p in params], copy.deepcopy(states)
    call_adam(params, grads, states, grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0), amsgrad=True)
    call_adam(params2, [g / 1024 for g in grads], states2, amsgrad=True)
    assert_same_tensors(params, params2)
    assert not any(torch.equal(p, q) for p, q in zip(params, before[0], strict=True))
    assert all(float(s["step"]) == float(s0["step"]) + 1 for s, s0 in zip(states, before[1], strict=True))


def test_c_reference_lr_tensor():
    """A float32 lr tensor is read where the number is not: bit for bit what its value as a number gives."""
    params = [torch.randn(s) for s in SHAPES[:4]]
    grads = [torch.randn(s) for s in SHAPES[:4]]
    states = fresh_state(params, False)
    params2, states2 = [p.clone() for p in params], copy.deepcopy(states)
    lr = torch.tensor(3e-3)
    call_adam(params, grads, states, lr=-5.0, lr_tensor=lr)
    call_adam(params2, grads, states2, lr=float(lr))
    assert_same_tensors(params, params2)
    assert not any(torch.equal(p, q) for p, q in zip(params, [torch.zeros_like(p) for p in params], strict=True))


def two_groups(bad):
    good = torch.nn.Parameter(torch.randn(10))
    good.grad = torch.randn(10)
    return good, [{"params": [good]}, {"params": [bad]}]


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_bad_input_raises_before_any_work(name):
    cls = getattr(hotloop.optim, name)

    def check(bad, exc, match, **step_kwargs):
        good, groups = two_groups(bad)
        before = good.detach().clone()
        opt = cls(groups, lr=0.1)
        with pytest.raises(exc, match=match):
            opt.step(**step_kwargs)
        assert torch.equal(good.detach(), before) and len(opt.state) == 0

    expected = "expected a float32, float16 or bfloat16 parameter"
    for dtype in (torch.float64, torch.complex64, torch.int64):
        with pytest.raises(TypeError, match=expected):
            cls([torch.ones(4, dtype=dtype)])
        with pytest.raises(TypeError, match=expected):
            cls([torch.nn.Parameter(torch.ones(4))]).add_param_group({"params": [torch.ones(3, dtype=dtype)]})
    # a parameter whose dtype changed after construction is caught at the step
    p = torch.nn.Parameter(torch.randn(4))
    good, groups = two_groups(p)
    before = good.detach().clone()
    opt = cls(groups, lr=0.1)
    p.data = p.data.double()
    p.grad = torch.randn(4, dtype=torch.float64)
    with pytest.raises(TypeError, match=expected):
        opt.step()
    assert torch.equal(good.detach(), before) and len(opt.state) == 0
    # a half parameter takes a gradient of its own dtype only (torch's fused optimizers' rule)
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None  # torch >= 2.10 refuses another dtype's gradient unless told
    p.grad = torch.randn(4, dtype=torch.float16)
    check(p, TypeError, "expected a bfloat16 gradient")
    p = torch.nn.Parameter(torch.randn(5, 3))
    p.grad = torch.randn(5, 3).to_sparse()
    check(p, TypeError, "sparse")
    p = torch.nn.Parameter(torch.randn(5, 4))
    p.grad = torch.randn(4, 5).t()
    check(p, ValueError, "laid out as its parameter")
    ok = torch.nn.Parameter(torch.randn(4))
    ok.grad = torch.randn(4)
    check(ok, TypeError, "grad_scale: expected a float32", grad_scale=torch.tensor(2.0, dtype=torch.float64))
    check(ok, TypeError, "grad_scale: expected None or a float32", grad_scale=2.0)
    check(ok, ValueError, "grad_scale: expected one element", grad_scale=torch.ones(2))
    check(ok, ValueError, "grad_scale: expected a tensor on cpu", grad_scale=torch.ones((), device="meta"))
    check(ok, TypeError, "found_inf: expected a float32", found_inf=torch.tensor(0, dtype=torch.int32))


def test_arguments_and_defaults_match_torch():
    import inspect
    for name in ("Adam", "AdamW"):
        ours = inspect.signature(getattr(hotloop.optim, name).__init__).parameters
        ref = inspect.signature(getattr(torch.optim, name).__init__).parameters
        assert list(ours) == list(ref)
        assert [v.default for v in ours.values()] == [v.default for v in ref.values()]
    assert hotloop.optim.AdamW._step_supports_amp_scaling
    with pytest.raises(ValueError, match="Invalid learning rate"):
        hotloop.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_c_reference(grad_dtype, amsgrad):
    """The CUDA kernel against the C reference on CPU copies: the same float operations and fmas (IEEE,
    none contracted), so equal up to powf of the bias corrections (CUDA's and glibc's may differ in the
    last bit, and then bc1 or bc2_sqrt by an ulp or two): the update moves by 2**-22 of itself, which
    2**-21 of the parameter covers (|update| <= 8 lr << |p|); the moments do not depend on it. With
    amsgrad the kernel reads lr from a device tensor and the C reference is given that tensor's float32
    value as a number, the lr both kernels then use (torch's reads *lr_ptr, and rounds a number lr to
    float32 too); the kernel is also passed a wrong number, which it must ignore."""
    params = [torch.randn(s) for s in SHAPES]
    grads = [(torch.randn(s) * 256).to(grad_dtype) for s in SHAPES]
    states = fresh_state(params, amsgrad)
    d_params, d_grads = [p.cuda() for p in params], [g.cuda() for g in grads]
    d_states = [{k: v.cuda() for k, v in s.items()} for s in states]
    scale, found = torch.tensor(256.0), torch.tensor(0.0)
    lr_tensor = torch.tensor(1e-2)
    call_adam(params, grads, states, grad_scale=scale, found_inf=found, amsgrad=amsgrad, lr=float(lr_tensor))
    lr = dict(lr=123.0, lr_tensor=lr_tensor.cuda()) if amsgrad else dict(lr=float(lr_tensor))
    call_adam(d_params, d_grads, d_states, grad_scale=scale.cuda(), found_inf=found.cuda(), amsgrad=amsgrad, **lr)
    torch.cuda.synchronize()
    for p, q in zip(params, d_params, strict=True):
        torch.testing.assert_close(q.cpu(), p, rtol=2.0**-21, atol=0)
    for s, t in zip(states, d_states, strict=True):
        for k in s:
            torch.testing.assert_close(t[k].cpu(), s[k], rtol=2.0**-21, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,kwargs", [CASES[0], ("Adam", dict(amsgrad=True, maximize=True))])
def test_matches_torch_with_clipping(name, kwargs, device):
    """hotloop's clip_grad_norm_ hands ours grad_scale = scale / clip coefficient (the gradients stay
    scaled); torch's unscale_, clip_grad_norm_ and fused step write them twice. Same skips, same scale,
    parameters within param_bound (the factor folded in rounds the gradient once instead of twice).
    Not with Adam's coupled weight decay: where g + weight_decay * p cancels to about eps, Adam's early
    steps move by about lr * sign(g + weight_decay * p), and one rounding of g may flip that sign
    (seen: 0.6 lr at one element of 2**20). Gradients that only differ by rounding cannot cancel."""
    seed = derived_seed()
    ours, ref, ours_params, ref_params = make_pair(name, kwargs, device, seed)
    ours_scaler = GradScaler(device, init_scale=2.0**12, growth_interval=25)
    ref_scaler = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=25)
    gen = torch.Generator().manual_seed(seed + 1)
    max_norm = 10.0  # the gradients' norm is about 1000: every step clips
    # the two sides' clipped gradients differ by their clip coefficients: each side's norm is a tree or
    # cascade sum of <= 2**21 squares (relative error <= ~25 u on the sum, half on the norm) and each side
    # rounds the factor and the product (2 u): 2**-17 = 128 u covers both sides with room
    bound = bound_for(ref, device, rel_g=2.0**-17)
    skipped = 0
    for step in range(STEPS):
        sources = [torch.randn(s, generator=gen).to(device) for s in shapes_for(device)]
        if step in INJECT:
            t, e, value = INJECT[step]
            flat = sources[t].view(-1)
            flat[flat.numel() // 2 if e == "mid" else e] = value
        before = snapshot(ours, ours_params)
        ref_before = state_of(ref, ref_params)
        for opt, scaler, params in ((ours, ours_scaler, ours_params), (ref, ref_scaler, ref_params)):
            opt.zero_grad()
            scaler.scale(sum((p * s).sum() for p, s in zip(params, sources, strict=True))).backward()
            if scaler is ours_scaler:
                scaler.clip_grad_norm_(opt, max_norm)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            scaler.step(opt)
            scaler.update()
        assert ours_scaler.get_scale() == ref_scaler.get_scale(), f"step {step}"
        if step in INJECT:
            skipped += 1
            assert_same_tensors(snapshot(ours, ours_params), before)
        else:  # torch's unscale_ and clip wrote the gradients its step read
            bound.step(step + 1 - skipped, [q.grad for q in ref_params], ref_before, state_of(ref, ref_params))
    bound.check(ours, ref, ours_params, ref_params)

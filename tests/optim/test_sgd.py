"""hotloop.optim.SGD against torch's fused SGD: 200 steps under each one's GradScaler with inf/NaN injected,
state dicts both ways, the C reference over float16/bfloat16 gradients, and bad input."""
import copy

import pytest
import torch

import hotloop.optim
from hotloop.amp import GradScaler

from ..seeding import derived_seed
from . import c_calls
from .conftest import DEVICES, INJECT, SHAPES, STEPS, assert_mostly_identical, assert_same_tensors, shapes_for
from .sgd_bound import assert_close_to_torch, rounded_one_way_by_torch

CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, momentum=0.9),
    dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    dict(lr=1e-2, momentum=0.8, nesterov=True, weight_decay=1e-2, maximize=True),
]


def make_pair(kwargs, device, seed):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes_for(device)]
    ours_params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    ref_params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    return hotloop.optim.SGD(ours_params, **kwargs), torch.optim.SGD(ref_params, fused=True, **kwargs), \
        ours_params, ref_params


def snapshot(opt, params):
    return [p.detach().clone() for p in params] + \
        [t.clone() for p in params for t in opt.state[p].values() if t is not None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kwargs", CASES)
def test_matches_torch_under_grad_scaler(kwargs, device):
    seed = derived_seed()
    ours, ref, ours_params, ref_params = make_pair(kwargs, device, seed)
    ours_scaler = GradScaler(device, init_scale=2.0**12, growth_interval=25)
    ref_scaler = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=25)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(STEPS):
        sources = [torch.randn(s, generator=gen).to(device) for s in shapes_for(device)]
        if step in INJECT:
            t, e, value = INJECT[step]
            flat = sources[t].view(-1)
            flat[flat.numel() // 2 if e == "mid" else e] = value
        before = snapshot(ours, ours_params), snapshot(ref, ref_params)
        for opt, scaler, params in ((ours, ours_scaler, ours_params), (ref, ref_scaler, ref_params)):
            opt.zero_grad()
            scaler.scale(sum((p * s).sum() for p, s in zip(params, sources, strict=True))).backward()
            scaler.step(opt)
            scaler.update()
        assert ours_scaler.get_scale() == ref_scaler.get_scale(), f"step {step}"
        if step in INJECT:
            assert_same_tensors(snapshot(ours, ours_params), before[0])
            assert_same_tensors(snapshot(ref, ref_params), before[1])
    assert_close_to_torch(ours, ref, ours_params, ref_params, STEPS, kwargs["lr"])
    if device == "cuda":
        # torch's CUDA kernel does ours' arithmetic: bit-identical but where nvcc's contractions of torch's
        # source differ from ours (conftest.assert_mostly_identical says how rare)
        keys = ["momentum_buffer"] if "momentum_buffer" in ours.state.get(ours_params[0], {}) else []
        assert_mostly_identical(ours, ref, ours_params, ref_params, keys,
                                only=rounded_one_way_by_torch(ref_params, scaled=True))


def test_state_dict_loads_both_ways():
    kwargs = CASES[2]
    ours, ref, ours_params, ref_params = make_pair(kwargs, "cpu", derived_seed())
    for _ in range(3):
        grads = [torch.randn_like(p) for p in ours_params]
        for params, opt in ((ours_params, ours), (ref_params, ref)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    saved, ref_saved = ours.state_dict(), ref.state_dict()
    assert saved["param_groups"] == ref_saved["param_groups"]
    assert all(set(saved["state"][k]) == set(ref_saved["state"][k]) for k in ref_saved["state"])
    for torch_kwargs in (dict(fused=True), dict(foreach=True)):
        params_t = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
        params_o = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
        their = torch.optim.SGD(params_t, **kwargs, **torch_kwargs)
        their.load_state_dict(copy.deepcopy(saved))
        back = hotloop.optim.SGD(params_o, **kwargs)
        back.load_state_dict(copy.deepcopy(their.state_dict()))
        grads = [torch.randn_like(p) for p in ours_params]
        for params, opt in ((params_t, their), (params_o, back)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
        assert_close_to_torch(back, their, params_o, params_t, 4, kwargs["lr"])


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_c_reference_half_gradients_and_skip(grad_dtype):
    params = [torch.randn(s) for s in SHAPES[:5]]
    grads = [(torch.randn(s) * 64).to(grad_dtype) for s in SHAPES[:5]]
    bufs = [torch.rand_like(p) for p in params]
    params2, bufs2 = [p.clone() for p in params], [b.clone() for b in bufs]
    scale = torch.tensor(64.0)
    c_calls.sgd(params, grads, bufs, grad_scale=scale, found_inf=torch.tensor(1.0))
    assert_same_tensors(params + bufs, params2 + bufs2)  # skipped
    c_calls.sgd(params, grads, bufs, grad_scale=scale, found_inf=torch.tensor(0.0))
    unscaled = [g.float() / 64 for g in grads]  # kept alive: the table holds only their addresses
    c_calls.sgd(params2, unscaled, bufs2)
    assert_same_tensors(params + bufs, params2 + bufs2)
    assert not any(torch.equal(b, b0) for b, b0 in zip(bufs, [torch.zeros_like(b) for b in bufs], strict=True))


def test_c_reference_lr_tensor():
    """A float32 lr tensor is read where the number is not: bit for bit what its value gives."""
    params = [torch.randn(s) for s in SHAPES[:4]]
    grads = [torch.randn(s) for s in SHAPES[:4]]
    bufs = [torch.rand_like(p) for p in params]
    params2, bufs2 = [p.clone() for p in params], [b.clone() for b in bufs]
    lr = torch.tensor(0.03)
    c_calls.sgd(params, grads, bufs, lr=-7.0, lr_tensor=lr)
    c_calls.sgd(params2, grads, bufs2, lr=float(lr))
    assert_same_tensors(params + bufs, params2 + bufs2)


def test_bad_input_raises_before_any_work():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16 parameter"):
        hotloop.optim.SGD([torch.ones(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="Nesterov"):
        hotloop.optim.SGD([torch.nn.Parameter(torch.ones(3))], momentum=0.9, dampening=0.1, nesterov=True)
    good = torch.nn.Parameter(torch.randn(10))
    good.grad = torch.randn(10)
    bad = torch.nn.Parameter(torch.randn(5, 3))
    bad.grad = torch.randn(5, 3).to_sparse()
    opt = hotloop.optim.SGD([{"params": [good]}, {"params": [bad]}], lr=0.1, momentum=0.9)
    before = good.detach().clone()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    bad.grad = torch.randn(5, 3)
    with pytest.raises(TypeError, match="grad_scale: expected a float32"):
        opt.step(grad_scale=torch.tensor(2.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="found_inf: expected a tensor on cpu"):
        opt.step(found_inf=torch.zeros((), device="meta"))
    assert torch.equal(good.detach(), before) and len(opt.state) == 0


def test_arguments_and_defaults_match_torch():
    import inspect
    ours = inspect.signature(hotloop.optim.SGD.__init__).parameters
    ref = inspect.signature(torch.optim.SGD.__init__).parameters
    assert list(ours) == list(ref)
    assert [v.default for v in ours.values()] == [v.default for v in ref.values()]
    assert hotloop.optim.SGD._step_supports_amp_scaling


@pytest.mark.gpu
@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_c_reference(grad_dtype, first_step):
    """The CUDA kernel against the C reference on CPU copies: the same float operations and fmas (IEEE,
    none contracted), bit for bit. With first_step the kernel reads lr from a device tensor (and must
    ignore the wrong number it is passed); the C reference is given that tensor's float32 value."""
    params = [torch.randn(s) for s in SHAPES]
    grads = [(torch.randn(s) * 256).to(grad_dtype) for s in SHAPES]
    bufs = [torch.rand_like(p) for p in params]
    d_params, d_grads, d_bufs = [p.cuda() for p in params], [g.cuda() for g in grads], [b.cuda() for b in bufs]
    lr_tensor = torch.tensor(0.1)
    c_calls.sgd(params, grads, bufs, first_step=first_step, grad_scale=torch.tensor(256.0),
                found_inf=torch.tensor(0.0), lr=float(lr_tensor))
    lr = dict(lr=99.0, lr_tensor=lr_tensor.cuda()) if first_step else dict(lr=float(lr_tensor))
    c_calls.sgd(d_params, d_grads, d_bufs, first_step=first_step, grad_scale=torch.tensor(256.0, device="cuda"),
                found_inf=torch.tensor(0.0, device="cuda"), **lr)
    torch.cuda.synchronize()
    assert_same_tensors([t.cpu() for t in d_params + d_bufs], params + bufs)


@pytest.mark.gpu
def test_momentum_buffer_rounds_as_torchs():
    """Which of torch's CUDA momentum buffer momentum * buf + (1 - dampening) * g nvcc compiled: ours
    (kernels/optim_math.h) is fma(1 - dampening, g, momentum * buf), which matched every element on the
    H200 (torch 2.11; the unfused form 77 %, the other fma 63 %). Against torch's fused SGD on
    2**20 elements, one step from a known buffer: every element as that, and the message says how many
    match each way nvcc could have compiled it (fma over either product), in case it is not. The fmas are
    emulated in long double (the float product is exact there; a double rounding is rare, hence 1e-4)."""
    import numpy as np
    n = 2**20
    p, g, buf = torch.randn(n), torch.randn(n), torch.randn(n)
    q = torch.nn.Parameter(p.cuda())
    opt = torch.optim.SGD([q], lr=0.1, momentum=0.9, dampening=0.25, fused=True)
    q.grad = torch.zeros_like(q)
    opt.step()  # makes the buffer (the first step takes the gradient as it is)
    opt.state[q]["momentum_buffer"].copy_(buf)
    q.grad = g.cuda()
    opt.step()
    got = opt.state[q]["momentum_buffer"].cpu().numpy()
    m, d = np.float32(0.9), np.float32(1) - np.float32(0.25)
    b, x = buf.numpy(), g.numpy()
    L = np.longdouble
    variants = {
        "unfused": ((m * b).astype(np.float32) + (d * x).astype(np.float32)).astype(np.float32),
        "fma(momentum, buf, (1 - dampening) * g)": (L(m) * b.astype(L) + (d * x).astype(np.float32).astype(L)).astype(np.float32),
        "fma(1 - dampening, g, momentum * buf)": (L(d) * x.astype(L) + (m * b).astype(np.float32).astype(L)).astype(np.float32),
    }
    counts = {k: int((v == got).sum()) for k, v in variants.items()}
    assert n - counts["fma(1 - dampening, g, momentum * buf)"] <= 1e-4 * n, f"elements of {n} equal to torch's: {counts}"

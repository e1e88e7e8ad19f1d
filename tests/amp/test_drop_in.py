"""hotloop.GradScaler where torch's own grad-scaling tests found it was no drop-in: device specs, a scale on another device, sparse, non-dense and float64 gradients, gradients on several devices, argument checks."""
import math
import warnings

import pytest
import torch

from hotloop.amp import GradScaler

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 GPUs")


def both(*args, **kwargs):
    """torch's scaler and ours, built from the same arguments."""
    return torch.amp.GradScaler(*args, **kwargs), GradScaler(*args, **kwargs)


def assert_same(ours, ref):
    """every element equal (NaN where torch has NaN), and the same dtype, shape and layout"""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape and ours.layout == ref.layout
    if ref.is_sparse:
        ours, ref = ours.to_dense(), ref.to_dense()
    assert torch.equal(ours.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(ours, nan=0.0), torch.nan_to_num(ref, nan=0.0))


def found_sum(scaler, opt):
    return sum(v.item() for v in scaler._found_inf_per_device(opt).values())


# ---- 1. device specs ----

@pytest.mark.parametrize("spec", ["cpu", "cpu:0", "CPU", torch.device("cpu"), torch.device("cpu", 0),
                                  pytest.param("cuda:0", marks=pytest.mark.gpu),
                                  pytest.param(torch.device("cuda", 0), marks=pytest.mark.gpu),
                                  pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_specs_torch_accepts(spec):
    dev = torch.device("cuda" if "cuda" in str(spec) else "cpu")
    ref, ours = both(spec, init_scale=64.0, growth_interval=2)
    pr, po = (torch.nn.Parameter(torch.randn(50, device=dev)) for _ in range(2))
    po.data.copy_(pr.data)
    opt_r, opt_o = torch.optim.SGD([pr], lr=0.1), torch.optim.SGD([po], lr=0.1)
    for step in range(5):
        w = torch.randn(50, device=dev)
        if step == 2:
            w[7] = math.inf
        for p, opt, sc in ((pr, opt_r, ref), (po, opt_o, ours)):
            opt.zero_grad()
            sc.scale((p * w).sum()).backward()
            sc.step(opt)
            sc.update()
        assert ours._scale.device == ref._scale.device  # where torch puts it: the scaled tensor's device
        assert ours.get_scale() == ref.get_scale()
    assert_same(po.data, pr.data)


def test_device_specs_hotloop_cannot_run_are_refused_clearly():
    for spec, error in (("mps", ValueError), ("banana", ValueError), ("xpu:0", ValueError), (None, TypeError),
                        (3, TypeError)):
        with pytest.raises(error, match="device"):
            GradScaler(spec)


# ---- 2. scale() of a tensor on another device than the gradients ----

@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("unscale", [False, True])
def test_cpu_loss_with_a_cuda_scaler(fused, unscale):
    """torch's test_grad_scaler_with_preset_grad_scale: the scale lives on the CPU (the first scaled
    tensor), the gradients on the GPU, and a user's grad_scale is folded into a fused optimizer."""
    ref, ours = both(init_scale=5.0)
    weights, opts = [], []
    g = torch.randn(5, 5, device="cuda") * 15
    for sc in (ref, ours):
        w = torch.ones((5, 5), device="cuda", requires_grad=True)
        w.grad = g.clone()
        opt = torch.optim.Adam([w], lr=0.1, fused=fused)
        assert sc.scale(torch.ones(5)).device.type == "cpu"
        if unscale:
            sc.unscale_(opt)
        if fused:
            opt.grad_scale = torch.tensor([3.0], device="cuda")
        sc.step(opt)
        weights.append(w)
        opts.append(opt)
    assert ours._scale.device == ref._scale.device == torch.device("cpu")
    assert_same(weights[1].grad, weights[0].grad)
    assert_same(weights[1].detach(), weights[0].detach())
    ref.update()
    ours.update()
    assert ours.get_scale() == ref.get_scale()


# ---- 3. sparse gradients ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["step", "unscale", "clip"])
@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
def test_sparse_embedding_gradients(device, how, bad):
    emb_r = torch.nn.Embedding(40, 6, sparse=True).to(device)
    lin_r = torch.nn.Linear(6, 3).to(device)
    emb_o, lin_o = torch.nn.Embedding(40, 6, sparse=True).to(device), torch.nn.Linear(6, 3).to(device)
    emb_o.load_state_dict(emb_r.state_dict())
    lin_o.load_state_dict(lin_r.state_dict())
    idx = torch.randint(0, 40, (30,), device=device)  # repeats: an uncoalesced gradient
    y = torch.randn(30, 3, device=device)
    ref, ours = both(device, init_scale=2.0**10)
    results = []
    for emb, lin, sc in ((emb_r, lin_r, ref), (emb_o, lin_o, ours)):
        opt = torch.optim.SGD(list(emb.parameters()) + list(lin.parameters()), lr=0.1)
        sc.scale(torch.nn.functional.mse_loss(lin(emb(idx)), y)).backward()
        assert emb.weight.grad.is_sparse
        if bad is not None:
            emb.weight.grad._values()[3, 2] = bad
        norm = None
        if how == "unscale":
            sc.unscale_(opt)
        elif how == "clip" and sc is ref:
            sc.unscale_(opt)
            grads = [emb.weight.grad.coalesce().to_dense(), lin.weight.grad, lin.bias.grad]
            norm = torch.nn.utils.get_total_norm(grads)  # torch's clip_grad_norm_ cannot take sparse gradients
            coef = torch.clamp(0.05 / (norm + 1e-6), max=1.0)
            emb.weight.grad = emb.weight.grad * coef
            lin.weight.grad.mul_(coef)
            lin.bias.grad.mul_(coef)
        elif how == "clip":
            norm = sc.clip_grad_norm_(opt, 0.05)
        sc.step(opt)
        results.append((found_sum(sc, opt), norm, [p.detach().clone() for p in (emb.weight, lin.weight, lin.bias)],
                        emb.weight.grad))
        sc.update()
    (f_r, n_r, p_r, g_r), (f_o, n_o, p_o, g_o) = results
    assert f_o == f_r == (0.0 if bad is None else 1.0)
    assert ours.get_scale() == ref.get_scale()
    if how == "clip" and bad is None:
        assert n_o.item() == pytest.approx(n_r.item(), rel=1e-6)
    for a, b in zip(p_o, p_r, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if how == "unscale":
        torch.testing.assert_close(g_o.coalesce().to_dense(), g_r.coalesce().to_dense(), rtol=0, atol=0,
                                   equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_float16_sparse_gradient_overflows_once_coalesced(device):
    """Two repeats of 40000 fit in float16, their sum does not: torch coalesces float16 sparse
    gradients before the check, and so must we."""
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    v = torch.tensor([40000.0, 32.0, 40000.0]) * (1 + torch.rand(3) * 0.1)
    found = []
    for sc in both(device, init_scale=1.0):
        p = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float16, device=device))
        p.grad = torch.sparse_coo_tensor(i, v, (2, 3)).to(device=device, dtype=torch.float16)
        assert not p.grad.is_coalesced()
        opt = torch.optim.SGD([p], lr=1.0)
        sc.scale(torch.ones((), device=device))
        sc._check_inf_per_device(opt)
        found.append(found_sum(sc, opt))
        assert p.grad.is_coalesced()
    assert found == [1.0, 1.0]


# ---- 4. gradients with gaps or overlaps a user assigned ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [None, math.inf])
def test_non_dense_gradient_views_are_unscaled_in_place(device, dtype, bad):
    big = torch.randn(20, 20, device=device, dtype=dtype) * 64
    if bad is not None:
        big[4, 3] = bad
    dense = torch.randn(300, device=device) * 64
    ref, ours = both(device, init_scale=64.0)
    owners = []
    for sc in (ref, ours):
        owner = big.clone()
        p = torch.nn.Parameter(torch.zeros(20, 5, device=device, dtype=dtype))
        q = torch.nn.Parameter(torch.zeros(300, device=device))
        p.grad, q.grad = owner[:, :5], dense.clone()  # a view with gaps: not one block of memory
        assert not p.grad.is_contiguous()
        opt = torch.optim.SGD([p, q], lr=0.5)
        sc.scale(torch.ones((), device=device))
        sc.unscale_(opt)
        assert found_sum(sc, opt) == (0.0 if bad is None else 1.0)
        sc.step(opt)
        owners.append((owner, p.detach(), q.detach(), q.grad))
    for a, b in zip(owners[1], owners[0], strict=True):
        assert_same(a, b)  # the owner saw the unscaled values, and only where the view is


@pytest.mark.parametrize("device", DEVICES)
def test_gapped_and_float64_gradients_through_clip(device):
    """A view with gaps and a float64 gradient, through clip_grad_norm_ + step (torch: unscale_ + clip)."""
    big = torch.randn(8, 9, device=device) * 256
    g64 = torch.randn(9, device=device, dtype=torch.float64) * 256
    ref, ours = both(device, init_scale=256.0)
    out = []
    for sc in (ref, ours):
        p = torch.nn.Parameter(torch.ones(4, 7, device=device))
        d = torch.nn.Parameter(torch.ones(9, device=device, dtype=torch.float64))
        owner = big.clone()
        p.grad, d.grad = owner[::2, 2:], g64.clone()
        opt = torch.optim.SGD([p, d], lr=0.1)
        sc.scale(torch.ones((), device=device))
        if sc is ref:
            sc.unscale_(opt)
            norm = torch.nn.utils.get_total_norm([p.grad, d.grad])
            torch.nn.utils.clip_grads_with_norm_([p, d], 1.0, norm)
        else:
            norm = sc.clip_grad_norm_(opt, 1.0)
        sc.step(opt)
        out.append((norm, p.detach(), d.detach(), owner))
    assert out[1][0].item() == pytest.approx(out[0][0].item(), rel=1e-6)
    for a, b in zip(out[1][1:], out[0][1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_overlapping_gradient_is_refused_as_torch_refuses_it(device):
    ref, ours = both(device)
    for sc in (ref, ours):
        p = torch.nn.Parameter(torch.ones(4, 7, device=device))
        p.grad = torch.randn(1, 7, device=device).expand(4, 7)  # one element seen four times
        sc.scale(torch.ones((), device=device))
        with pytest.raises(RuntimeError if sc is ref else ValueError, match="overlap|more than one element"):
            sc.unscale_(torch.optim.SGD([p], lr=0.1))


# ---- 5. gradients on several devices under one optimizer ----

def two_device_case(devices, fused):
    """One model split over two devices (pipeline parallel), torch's copy and ours, one optimizer each."""
    d0, d1 = devices
    a, b = torch.nn.Linear(8, 16).to(d0), torch.nn.Linear(16, 4).to(d1)
    a2, b2 = torch.nn.Linear(8, 16).to(d0), torch.nn.Linear(16, 4).to(d1)
    a2.load_state_dict(a.state_dict())
    b2.load_state_dict(b.state_dict())
    kind = dict(fused=True) if fused else dict(foreach=False)
    return ((a, b, torch.optim.AdamW(list(a.parameters()) + list(b.parameters()), lr=1e-2, **kind)),
            (a2, b2, torch.optim.AdamW(list(a2.parameters()) + list(b2.parameters()), lr=1e-2, **kind)))


def run_two_devices(devices, fused, clip):
    d0, d1 = devices
    ref_case, our_case = two_device_case(devices, fused)
    ref, ours = both(d0.type, init_scale=2.0**8, growth_interval=2)
    for step in range(8):
        x, y = torch.randn(16, 8, device=d0), torch.randn(16, 4, device=d1)
        per = []
        for (a, b, opt), sc in ((ref_case, ref), (our_case, ours)):
            opt.zero_grad()
            sc.scale(torch.nn.functional.mse_loss(b(torch.relu(a(x)).to(d1)), y)).backward()
            if step in (3, 6):
                (a if step == 3 else b).weight.grad[1, 2] = math.inf
            if clip and sc is ref:
                sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(list(a.parameters()) + list(b.parameters()), 0.5)
            elif clip:
                sc.clip_grad_norm_(opt, 0.5)
            sc.step(opt)
            found = sc._found_inf_per_device(opt)
            per.append({dev: v.item() for dev, v in found.items()})
            sc.update()
        assert per[1] == per[0]  # a found_inf per device, keyed and valued as torch's
        assert ours.get_scale() == ref.get_scale()
    for p, q in zip([*ref_case[0].parameters(), *ref_case[1].parameters()],
                    [*our_case[0].parameters(), *our_case[1].parameters()], strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("clip", [False, True])
def test_gradients_on_a_gpu_and_the_cpu(fused, clip):
    """Two devices with one GPU: the cuda and cpu paths each take their share, one skip decision."""
    run_two_devices((torch.device("cuda:0"), torch.device("cpu")), fused, clip)


@needs_two_gpus
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("clip", [False, True])
def test_gradients_on_two_gpus(fused, clip):
    run_two_devices((torch.device("cuda:0"), torch.device("cuda:1")), fused, clip)


# ---- 6. float16 gradients in unscale_ (accepted: a documented difference) ----

@pytest.mark.parametrize("device", DEVICES)
def test_float16_gradients_unscaled_where_torch_refuses(device):
    g = torch.randn(257, device=device).half() * 512
    ref, ours = both(device, init_scale=512.0)
    p = torch.nn.Parameter(torch.zeros(257, device=device, dtype=torch.float16))
    p.grad = g.clone()
    ref.scale(torch.ones((), device=device))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        ref.unscale_(torch.optim.SGD([p], lr=1.0))
    ours.scale(torch.ones((), device=device))
    ours.unscale_(torch.optim.SGD([p], lr=1.0))
    assert_same(p.grad, (g.float() * (1 / 512.0)).half())


# ---- 8. argument checks ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["init", "state_dict"])
def test_nan_scale_stays_nan_as_torch(device, where):
    ref, ours = both(device, init_scale=math.nan if where == "init" else 2.0, growth_interval=1)
    if where == "state_dict":
        state = dict(ref.state_dict(), scale=math.nan)
        ref.load_state_dict(state)
        ours.load_state_dict(state)
    for step in range(3):
        for sc in (ref, ours):
            p = torch.nn.Parameter(torch.randn(5, device=device))
            opt = torch.optim.SGD([p], lr=0.1)
            sc.scale(p.sum()).backward()
            sc.step(opt)
            sc.update()
        assert math.isnan(ours.get_scale()) and math.isnan(ref.get_scale())
        assert ours._get_growth_tracker() == ref._get_growth_tracker()


def test_growth_interval_must_be_an_int_as_torch_needs():
    ref = torch.amp.GradScaler("cpu", growth_interval=1.5)  # torch fails only at the first update
    p = torch.nn.Parameter(torch.randn(3))
    ref.scale(p.sum()).backward()
    ref.step(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(TypeError, match="growth_interval"):
        ref.update()
    for bad, error in ((1.5, TypeError), (True, TypeError), ("2", TypeError), (0, ValueError), (-3, ValueError)):
        with pytest.raises(error, match="growth_interval"):
            GradScaler("cpu", growth_interval=bad)
        state = dict(GradScaler("cpu").state_dict(), growth_interval=bad)
        with pytest.raises(error, match="growth_interval"):
            GradScaler("cpu").load_state_dict(state)
    with pytest.raises(TypeError, match="new_interval"):
        GradScaler("cpu").set_growth_interval(2.5)


def test_bad_numbers_raise_before_anything_runs():
    with pytest.raises(TypeError, match="init_scale"):
        GradScaler("cpu", init_scale="big")
    with pytest.raises(TypeError, match="growth_factor"):
        GradScaler("cpu", growth_factor="2")
    for kwargs in (dict(growth_factor=math.nan), dict(backoff_factor=math.nan), dict(backoff_factor=0.0),
                   dict(backoff_factor=-0.5)):
        with pytest.raises(ValueError, match="factor"):
            GradScaler("cpu", **kwargs)
    with pytest.raises(AssertionError, match="growth factor"):  # torch's own checks keep torch's exception
        GradScaler("cpu", growth_factor=1.0)
    with pytest.raises(ValueError, match="min_scale"):
        GradScaler("cpu", min_scale=math.nan)
    with pytest.raises(TypeError, match="_growth_tracker"):
        GradScaler("cpu").load_state_dict(dict(GradScaler("cpu").state_dict(), _growth_tracker=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradScaler("cpu", init_scale=5)  # an int is a number, as torch takes it


def test_per_optimizer_state_is_torch_s():
    ours = GradScaler("cpu")
    assert ours._per_optimizer_states["any"] == torch.amp.grad_scaler._refresh_per_optimizer_state()
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    opt = torch.optim.SGD([p], lr=0.1)
    ours.scale(torch.ones(()))
    ours.clip_grad_norm_(opt, 1.0)
    state = ours._per_optimizer_states[id(opt)]
    assert set(state) == {"stage", "found_inf_per_device"}
    assert state["stage"] is torch.amp.grad_scaler.OptState.UNSCALED


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inject", [-1, 0, 1, 2, 3])
def test_private_unscale_grads_as_torch_s(device, inject):
    """torch's _unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16), which its own tests call:
    mixed dtypes and layouts, an inf in each gradient in turn."""
    g = torch.randn(20, 20, device=device) * 4
    make = [lambda: g.clone(), lambda: g.clone()[:, :5], lambda: g.to(torch.float16), lambda: g.to(torch.float64)]
    inv = torch.full((1,), 0.25, device=device)
    out = []
    for sc in both(device):
        grads = [f() for f in make]
        if inject >= 0:
            grads[inject][2, 2] = math.inf
        params = [torch.nn.Parameter(torch.empty_like(t)) for t in grads]
        for p, t in zip(params, grads, strict=True):
            p.grad = t
        opt = torch.optim.SGD(params, lr=1.0)
        master = torch.zeros(1, device=device)
        found = sc._unscale_grads_(opt, inv, master, True)
        assert master.item() == 0.0 and set(found) == {grads[0].device}  # cuda:0, not cuda
        out.append((found[grads[0].device], grads))
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            sc._unscale_grads_(opt, inv, master, False)
    (f_r, g_r), (f_o, g_o) = out
    assert f_o.shape == f_r.shape and f_o.item() == f_r.item() == (1.0 if inject >= 0 else 0.0)
    for a, b in zip(g_o, g_r, strict=True):
        assert_same(a, b)

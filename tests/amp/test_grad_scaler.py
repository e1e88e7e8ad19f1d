"""hotloop.GradScaler against torch.amp.GradScaler: same trajectory, same skips, same errors; on the CPU (C reference) and, marked gpu, on CUDA."""
import copy
import math
import pickle
import warnings

import pytest
import torch

import hotloop
from hotloop.amp import GradScaler, OptState

from ..seeding import current_seed, seeded_generator

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
OPTIMIZERS = ["sgd", "adamw_foreach", "adamw_fused"]


def make_model(device, seed=None):
    torch.manual_seed(current_seed() if seed is None else seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 4)).to(device)


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.02, momentum=0.9)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def backward(model, scaler, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    return loss


def inject(model, step):
    """inf/NaN now and then, in the first, a middle or the last tensor, at its first, middle or last element"""
    if step % 11 != 4:
        return
    params = list(model.parameters())
    p = params[[0, len(params) // 2, len(params) - 1][step % 3]]
    flat = p.grad.view(-1)
    flat[[0, flat.numel() // 2, flat.numel() - 1][(step // 3) % 3]] = [math.inf, -math.inf, math.nan][step % 3]


def after_one_backward(device):
    """a model, its SGD and a fresh scaler, right after one scaled backward"""
    model = make_model(device)
    opt = make_optimizer("sgd", model.parameters())
    scaler = GradScaler(device)
    backward(model, scaler, torch.randn(4, 16, device=device), torch.randn(4, 4, device=device))
    return model, opt, scaler


def side_by_side(device, ref, ours, opts_ref, opts_ours, sc_ref, sc_ours, steps, after_backward):
    """Train torch's copy and ours on the same batches, with the same inf/NaN injected;
    after_backward(model, optimizers, scaler) does the part under test. Same scale every step."""
    for step in range(steps):
        x, y = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
        for model, opts, scaler in ((ref, opts_ref, sc_ref), (ours, opts_ours, sc_ours)):
            for o in opts:
                o.zero_grad()
            backward(model, scaler, x, y)
            inject(model, step)
            after_backward(model, opts, scaler)
            scaler.update()
        assert sc_ours.get_scale() == sc_ref.get_scale()
    assert_params_close(ref, ours)


def assert_params_close(a, b, rel=1e-6):
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        tol = rel * max(pa.abs().max().item(), 1e-30)
        assert (pa - pb).abs().max().item() <= tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("clip", [False, True])
def test_parity_with_torch_over_200_steps(device, kind, clip):
    ref = make_model(device)
    ours = copy.deepcopy(ref)
    opt_ref, opt_ours = make_optimizer(kind, ref.parameters()), make_optimizer(kind, ours.parameters())
    sc_ref = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=6)
    sc_ours = GradScaler(device, init_scale=2.0**12, growth_interval=6)
    gen = seeded_generator(3)
    skipped = 0
    for step in range(200):
        x = torch.randn(32, 16, generator=gen).to(device)
        y = torch.randn(32, 4, generator=gen).to(device)
        for model, opt, scaler in ((ref, opt_ref, sc_ref), (ours, opt_ours, sc_ours)):
            opt.zero_grad()
            backward(model, scaler, x, y)
            inject(model, step)
            if clip and scaler is sc_ref:
                scaler.unscale_(opt)
                norm_ref = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            elif clip:
                norm_ours = scaler.clip_grad_norm_(opt, 0.3)
            scaler.step(opt)
        found_ref = sum(v.item() for v in sc_ref._found_inf_per_device(opt_ref).values())
        assert sc_ours.found_inf.item() == found_ref
        skipped += found_ref > 0
        if clip and not found_ref:
            assert norm_ours.item() == pytest.approx(norm_ref.item(), rel=1e-6)
        sc_ref.update()
        sc_ours.update()
        assert sc_ours.get_scale() == sc_ref.get_scale()
        assert sc_ours._get_growth_tracker() == sc_ref._get_growth_tracker()
    assert skipped == 18 and sc_ours.skipped_steps == skipped
    assert_params_close(ref, ours)
    assert sc_ours.state_dict() == sc_ref.state_dict()


def both_after_one_backward(device):
    """(torch's model, ours, their SGD optimizers, torch's scaler, ours) after the same scaled backward."""
    ref = make_model(device)
    ours = copy.deepcopy(ref)
    opt_ref, opt_ours = make_optimizer("sgd", ref.parameters()), make_optimizer("sgd", ours.parameters())
    sc_ref, sc_ours = torch.amp.GradScaler(device), GradScaler(device)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    backward(ref, sc_ref, x, y)
    backward(ours, sc_ours, x, y)
    return ref, ours, opt_ref, opt_ours, sc_ref, sc_ours


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [math.inf, 1.0])
def test_clip_other_norms_match_torch(device, norm_type):
    ref, ours, opt_ref, opt_ours, sc_ref, sc_ours = both_after_one_backward(device)
    sc_ref.unscale_(opt_ref)
    # the oracle: torch's norm of the same gradients in float64. (torch's float32 one strays from it by
    # tens of float32 roundings at norm_type 1, a sum of thousands of |g|, for some fresh draws)
    exact = torch.nn.utils.get_total_norm([p.grad.double() for p in ref.parameters()], norm_type)
    n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=norm_type)
    n_ours = sc_ours.clip_grad_norm_(opt_ours, 0.01, norm_type=norm_type)
    assert n_ours.dtype == torch.float32 and n_ours.device == n_ref.device and n_ours.dim() == 0
    assert n_ours.item() == pytest.approx(exact.item(), rel=2**-22)  # a few float32 roundings
    sc_ref.step(opt_ref)
    sc_ours.step(opt_ours)
    for pa, pb in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-6, atol=1e-9)
    assert_params_close(ref, ours)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inf", [False, True])
def test_finalize_grads_writes_what_torch_would_have_before_step(device, inf):
    """clip_grad_norm_ leaves the gradients scaled (the factor waits for step); finalize_grads_ writes
    torch's unscaled, clipped gradients now, and step then applies nothing twice. With an inf the
    gradients stay as they were, and the step is skipped, as torch's."""
    ref, ours, opt_ref, opt_ours, sc_ref, sc_ours = both_after_one_backward(device)
    if inf:
        for model in (ref, ours):
            next(model.parameters()).grad.view(-1)[-1] = math.inf
    scaled = [p.grad.clone() for p in ours.parameters()]
    sc_ref.unscale_(opt_ref)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    sc_ours.clip_grad_norm_(opt_ours, 0.01)
    for p, g in zip(ours.parameters(), scaled, strict=True):
        assert torch.equal(p.grad, g)  # not written yet
    sc_ours.finalize_grads_(opt_ours)
    for pa, pb, g in zip(ref.parameters(), ours.parameters(), scaled, strict=True):
        want = g if inf else pa.grad
        torch.testing.assert_close(pb.grad, want, rtol=1e-6, atol=1e-9, equal_nan=True)
    sc_ours.finalize_grads_(opt_ours)  # nothing pending any more: the gradients stay
    sc_ref.step(opt_ref)
    sc_ours.step(opt_ours)
    assert_params_close(ref, ours)


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_then_torch_clip_then_step(device):
    """The torch idiom unchanged: scaler.unscale_ + torch.nn.utils.clip_grad_norm_."""
    ref = make_model(device)
    ours = copy.deepcopy(ref)
    opt_ref, opt_ours = make_optimizer("adamw_foreach", ref.parameters()), make_optimizer("adamw_foreach",
                                                                                           ours.parameters())

    def unscale_clip_step(model, opts, scaler):
        scaler.unscale_(opts[0])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opts[0])

    side_by_side(device, ref, ours, [opt_ref], [opt_ours], torch.amp.GradScaler(device), GradScaler(device), 20,
                 unscale_clip_step)


@pytest.mark.parametrize("device", DEVICES)
def test_two_optimizers_one_scaler(device):
    ref = make_model(device)
    ours = copy.deepcopy(ref)

    def split(model):
        params = list(model.parameters())
        return (make_optimizer("sgd", params[:3]), make_optimizer("adamw_fused", params[3:]))

    def step_both(model, opts, scaler):
        for o in opts:
            scaler.step(o)

    side_by_side(device, ref, ours, split(ref), split(ours), torch.amp.GradScaler(device, growth_interval=3),
                 GradScaler(device, growth_interval=3), 30, step_both)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_interchange_both_ways(device):
    model = make_model(device)
    opt = make_optimizer("sgd", model.parameters())
    ours = GradScaler(device, init_scale=1024.0, growth_interval=4)
    for step in range(7):
        opt.zero_grad()
        backward(model, ours, torch.randn(4, 16, device=device), torch.randn(4, 4, device=device))
        inject(model, 4)
        ours.step(opt)
        ours.update()
    state = ours.state_dict()
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    theirs = torch.amp.GradScaler(device)
    theirs.load_state_dict(state)
    assert theirs.state_dict() == state
    back = GradScaler(device)
    back.load_state_dict(theirs.state_dict())
    assert back.state_dict() == state
    # after the lazy init too, and with values torch wrote
    back.scale(torch.ones((), device=device))
    theirs._scale = None
    theirs._growth_tracker = None
    theirs.scale(torch.ones((), device=device))
    theirs._scale.fill_(123.0)
    back.load_state_dict(theirs.state_dict())
    assert back.get_scale() == 123.0 and back._get_growth_tracker() == state["_growth_tracker"]
    extra = GradScaler(device, hysteresis=3, min_scale=1.0, max_scale=2.0**20).state_dict()
    assert extra["hysteresis"] == 3 and extra["min_scale"] == 1.0 and extra["max_scale"] == 2.0**20
    torch.amp.GradScaler(device).load_state_dict(extra)  # torch ignores the extra keys


@pytest.mark.parametrize("device", DEVICES)
def test_errors_torch_raises(device):
    model = make_model(device)
    opt = make_optimizer("sgd", model.parameters())
    scaler = GradScaler(device)
    with pytest.raises(AssertionError, match="_scale is None"):
        scaler.step(opt)
    with pytest.raises(AssertionError, match="_scale is None"):
        scaler.unscale_(opt)
    backward(model, scaler, torch.randn(4, 16, device=device), torch.randn(4, 4, device=device))
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.update()
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.update()
    with pytest.raises(AssertionError):
        GradScaler(device, growth_factor=0.9)
    with pytest.raises(AssertionError):
        GradScaler(device, backoff_factor=1.0)
    assert pickle.loads(pickle.dumps(scaler)).get_scale() == scaler.get_scale()


@pytest.mark.parametrize("device", DEVICES)
def test_no_gradients_at_all(device):
    model = make_model(device)
    opt = make_optimizer("sgd", model.parameters())
    for scaler in (torch.amp.GradScaler(device), GradScaler(device)):
        scaler.scale(torch.ones((), device=device))
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
            scaler.step(opt)


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_without_grads_are_skipped(device):
    ref = make_model(device)
    ours = copy.deepcopy(ref)
    extra = torch.randn(5, device=device)
    for m in (ref, ours):
        m.extra = torch.nn.Parameter(extra.clone())  # never used: its grad stays None
    opt_ref, opt_ours = make_optimizer("adamw_fused", ref.parameters()), make_optimizer("adamw_fused",
                                                                                         ours.parameters())
    sc_ref, sc_ours = torch.amp.GradScaler(device), GradScaler(device)
    for _ in range(5):
        x, y = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
        for model, opt, scaler in ((ref, opt_ref, sc_ref), (ours, opt_ours, sc_ours)):
            opt.zero_grad()
            backward(model, scaler, x, y)
            if scaler is sc_ours:
                scaler.clip_grad_norm_(opt, 0.1)
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
    assert_params_close(ref, ours)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_every_gradient(device):
    model = make_model(device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = make_optimizer("adamw_fused", model.parameters())
    names = list(model.named_parameters())
    scaler = GradScaler(device, init_scale=64.0, named_parameters=names)
    assert scaler.overflow_report() is None
    backward(model, scaler, torch.randn(4, 16, device=device), torch.randn(4, 4, device=device))
    for p in model.parameters():
        p.grad.fill_(math.nan)
    norm = scaler.clip_grad_norm_(opt, 1.0)
    assert math.isnan(norm.item())
    assert scaler.step(opt) is None
    scaler.update()
    assert scaler.get_scale() == 32.0 and scaler.skipped_steps == 1
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    report = scaler.overflow_report()
    assert report.param_index == 0 and report.name == names[0][0] and report.step == 0
    assert names[0][0] in str(report)


@pytest.mark.parametrize("device", DEVICES)
def test_error_if_nonfinite_raises_as_torch(device):
    model, opt, scaler = after_one_backward(device)
    model[0].weight.grad[1, 1] = math.inf
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_report_names_the_first_bad_parameter(device):
    model = make_model(device)
    opt = torch.optim.SGD([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:]}],
                          lr=0.1)
    scaler = GradScaler(device)
    for step in range(3):
        opt.zero_grad()
        backward(model, scaler, torch.randn(4, 16, device=device), torch.randn(4, 4, device=device))
        if step == 1:
            model[2].bias.grad[5] = math.inf
            model[4].weight.grad[0, 0] = math.nan
        scaler.step(opt)
        scaler.update()
    report = scaler.overflow_report(named_parameters=model.named_parameters())
    assert (report.step, report.param_index, report.param_group, report.index_in_group) == (1, 3, 1, 1)
    assert report.name == "2.bias" and report.shape == (64,) and report.overflows == 1


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    dev = torch.device(device)
    scaler = GradScaler(device)
    scaler.scale(torch.ones((), device=dev))
    ints = torch.zeros(3, dtype=torch.int64, device=dev)
    ints.grad = torch.ones(3, dtype=torch.int64, device=dev)
    with pytest.raises(TypeError, match="float32, float16, bfloat16 or float64 gradient, got int64"):
        scaler.unscale_(torch.optim.SGD([ints], lr=0.1))
    z = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64, device=dev))
    z.grad = torch.ones(3, dtype=torch.complex64, device=dev)
    with pytest.raises(TypeError, match="got complex64"):
        scaler.clip_grad_norm_(torch.optim.SGD([z], lr=0.1), 1.0)
    csr = torch.nn.Parameter(torch.eye(3, device=dev).to_sparse_csr())
    csr.grad = torch.eye(3, device=dev).to_sparse_csr()
    with pytest.raises(TypeError, match="layout"):
        scaler.unscale_(torch.optim.SGD([csr], lr=0.1))
    p = torch.nn.Parameter(torch.randn(4, 4, device=dev))
    p.grad = torch.randn(4, 4, device=dev)
    fresh = GradScaler(device)
    fresh.scale(torch.ones((), device=dev))
    for bad in (math.nan, -1.0):
        with pytest.raises(ValueError, match="max_norm"):
            fresh.clip_grad_norm_(torch.optim.SGD([p], lr=0.1), bad)
    with pytest.raises(ValueError, match="norm_type"):
        fresh.clip_grad_norm_(torch.optim.SGD([p], lr=0.1), 1.0, norm_type=0.0)
    with pytest.raises(ValueError, match="device"):
        GradScaler(device).scale(torch.ones((), device="meta"))
    with pytest.raises(ValueError, match="device"):
        GradScaler("mps")


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_gradient_is_fine(device):
    ref = torch.nn.Parameter(torch.randn(6, 5, device=device))
    ours = torch.nn.Parameter(ref.detach().clone())
    g = torch.randn(5, 6, device=device).t() * 100.0
    ref.grad, ours.grad = g.clone(), g.clone()  # clone keeps the transposed strides
    assert not ours.grad.is_contiguous()
    sc_ref, sc_ours = torch.amp.GradScaler(device, init_scale=8.0), GradScaler(device, init_scale=8.0)
    sc_ref.scale(torch.ones((), device=device))
    sc_ours.scale(torch.ones((), device=device))
    o_ref, o_ours = torch.optim.SGD([ref], lr=0.1), torch.optim.SGD([ours], lr=0.1)
    sc_ref.unscale_(o_ref)
    n_ref = torch.nn.utils.clip_grad_norm_([ref], 1.0)
    n_ours = sc_ours.clip_grad_norm_(o_ours, 1.0)
    sc_ref.step(o_ref)
    sc_ours.step(o_ours)
    assert n_ours.item() == pytest.approx(n_ref.item(), rel=1e-6)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_and_bfloat16_gradients(device, dtype):
    """torch's unscale_ refuses float16 and bfloat16 gradients; these are unscaled as torch would."""
    p = torch.nn.Parameter(torch.randn(3000, device=device).to(dtype))
    q = torch.nn.Parameter(torch.randn(70, device=device))
    scaler = GradScaler(device, init_scale=256.0)
    scaler.scale(torch.ones((), device=device))
    p.grad = (torch.randn(3000, device=device) * 256).to(dtype)
    q.grad = torch.randn(70, device=device) * 256
    expect = [(g.float() / 256.0).to(g.dtype) for g in (p.grad, q.grad)]
    opt = torch.optim.SGD([p, q], lr=0.1)
    scaler.unscale_(opt)
    assert torch.equal(p.grad, expect[0]) and torch.equal(q.grad, expect[1])
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 256.0


def test_enabled_false_is_a_pass_through():
    model = make_model("cpu")
    ref = copy.deepcopy(model)
    opt, opt_ref = make_optimizer("sgd", model.parameters()), make_optimizer("sgd", ref.parameters())
    scaler = GradScaler("cpu", enabled=False)
    loss = torch.nn.functional.mse_loss(model(torch.ones(2, 16)), torch.zeros(2, 4))
    assert scaler.scale(loss) is loss
    loss.backward()
    torch.nn.functional.mse_loss(ref(torch.ones(2, 16)), torch.zeros(2, 4)).backward()
    scaler.unscale_(opt)
    n = scaler.clip_grad_norm_(opt, 0.1)
    n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert n.item() == n_ref.item()
    assert scaler.step(opt) is None
    opt_ref.step()
    scaler.update()
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled() and scaler.state_dict() == {}
    assert scaler.skipped_steps == 0 and scaler.overflow_report() is None
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_cuda_scaler_without_cuda_disables_itself_like_torch():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = hotloop.GradScaler()
    assert not scaler.is_enabled() and any("CUDA is not available" in str(w.message) for w in caught)


@pytest.mark.parametrize("device", DEVICES)
def test_getters_setters_and_update_with_new_scale(device):
    scaler = GradScaler(device, init_scale=100.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    assert scaler.get_scale() == 100.0 and scaler.get_growth_factor() == 3.0
    assert scaler.get_backoff_factor() == 0.25 and scaler.get_growth_interval() == 7
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(9)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.125, 9)
    out = scaler.scale([torch.ones(2, device=device), (torch.full((1,), 2.0, device=device),)])
    assert out[0].tolist() == [100.0, 100.0] and isinstance(out[1], tuple) and out[1][0].item() == 200.0
    scaler.update(new_scale=5.0)
    assert scaler.get_scale() == 5.0
    scaler.update(new_scale=torch.full((), 6.0, device=device))
    assert scaler.get_scale() == 6.0
    with pytest.raises(AssertionError):
        scaler.update(new_scale=torch.ones(2, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_clip_then_unscale_state(device):
    model, opt, scaler = after_one_backward(device)
    scaler.clip_grad_norm_(opt, 1.0)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    # clipping twice clips the clipped gradients, as two torch clips would
    ref = [p.grad.detach().clone() / scaler.get_scale() for p in model.parameters()]
    n1 = torch.nn.utils.get_total_norm(ref)
    ref = [r * torch.clamp(1.0 / (n1 + 1e-6), max=1.0) for r in ref]
    n2 = scaler.clip_grad_norm_(opt, 0.5)
    assert n2.item() == pytest.approx(torch.nn.utils.get_total_norm(ref).item(), rel=1e-5)


# ---- CUDA only ----

@pytest.mark.gpu
@pytest.mark.parametrize("moved", [False, True])
def test_zero_host_syncs_with_clip_and_fused_adamw(moved):
    model = make_model("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler("cuda")
    x, y = torch.randn(32, 16, device="cuda"), torch.randn(32, 4, device="cuda")
    for _ in range(3):  # warm-up: the gradient table is built on the first step
        opt.zero_grad(set_to_none=False)
        backward(model, scaler, x, y)
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=False)
    backward(model, scaler, x, y)
    if moved:  # a gradient at a new address: the table is rebuilt and uploaded inside the step
        model[2].weight.grad = model[2].weight.grad.clone()
    torch.cuda.synchronize()
    # a long kernel ahead of the step: if anything waited for the device, the stream would be idle after
    torch.cuda._sleep(200_000_000)
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm = scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.cuda.current_stream().query()  # the host never waited for the sleeping stream
    assert math.isfinite(norm.item())


@pytest.mark.gpu
def test_scaler_kind_does_not_bind_tensors():
    """As torch's: a "cuda" scaler scales a CPU tensor (its scale then lives on the CPU) and a "cpu"
    scaler a CUDA one; only devices hotloop has no kernels for are refused."""
    for kind, dev in (("cuda", "cpu"), ("cpu", "cuda")):
        ref, ours = torch.amp.GradScaler(kind, init_scale=3.0), GradScaler(kind, init_scale=3.0)
        x = torch.randn(5, device=dev)
        assert torch.equal(ours.scale(x), ref.scale(x)) and ours._scale.device == ref._scale.device
    with pytest.raises(ValueError, match="device"):
        GradScaler("cuda").scale(torch.ones((), device="meta"))


def copy_training_state(src_model, src_opt, dst_model, dst_opt):
    with torch.no_grad():
        for ps, pd in zip(src_model.parameters(), dst_model.parameters(), strict=True):
            pd.copy_(ps)
            for key, value in src_opt.state[ps].items():
                dst_opt.state[pd][key].copy_(value)


@pytest.mark.gpu
def test_autocast_fp16_training_matches_torch():
    """float16 autocast with fused AdamW and clipping, 100 steps, each step from the same state.

    Why each step restarts from torch's parameters and optimizer state: hotloop folds the clip
    coefficient into the fused optimizer's grad_scale (grad / (scale / coef)) where torch rounds
    twice (grad * inv_scale, then * coef), a last-bit difference. Under float16 autocast such a
    difference flips roundings of float16 activations in the next forward, and Adam turns a
    near-zero gradient of either sign into a +-lr step, so over many steps two runs drift apart
    chaotically (3e-5 after 100 steps, either way round). One step, from one state, is what the
    maths fixes: that must agree to 1e-6 relative, with the same scale and the same skips.
    """
    ref = make_model("cuda")
    ours = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3, fused=True)
    sc_ref, sc_ours = torch.amp.GradScaler("cuda", init_scale=2.0**24), GradScaler("cuda", init_scale=2.0**24)
    skipped = 0
    for step in range(100):
        x, y = torch.randn(64, 16, device="cuda") * 50, torch.randn(64, 4, device="cuda")
        for model, opt, scaler in ((ref, opt_ref, sc_ref), (ours, opt_ours, sc_ours)):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if scaler is sc_ref:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
        skipped += sc_ours.found_inf.item() > 0
        assert sc_ours.found_inf.item() == sum(v.item() for v in sc_ref._found_inf_per_device(opt_ref).values())
        sc_ref.update()
        sc_ours.update()
        assert sc_ours.get_scale() == sc_ref.get_scale()
        if step > 0:  # step 0 creates the optimizer state
            assert_params_close(ref, ours, rel=1e-6)
        copy_training_state(ref, opt_ref, ours, opt_ours)
    assert skipped > 0 and sc_ours.skipped_steps == skipped  # 2**24 overflows float16 at first


def test_table_is_reused_while_gradients_stay_and_rebuilt_when_they_move():
    model = make_model("cpu")
    opt = make_optimizer("sgd", model.parameters())
    scaler = GradScaler("cpu")
    tables = []
    for step in range(4):
        opt.zero_grad(set_to_none=step >= 2)  # steps 2, 3: fresh gradient tensors
        backward(model, scaler, torch.randn(4, 16), torch.randn(4, 4))
        if step == 3:
            model[0].weight.grad = model[0].weight.grad.clone()  # one gradient moved
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        tables.append(scaler._caches[opt].devices[0].table)
    assert tables[1] is tables[0]
    assert tables[3] is not tables[2]
    # a new parameter group invalidates the parameter list too
    extra = torch.nn.Parameter(torch.randn(3))
    opt.add_param_group({"params": [extra]})
    extra.grad = torch.full((3,), math.inf)
    backward(model, scaler, torch.randn(4, 16), torch.randn(4, 4))
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 1 and scaler.overflow_report().param_index == len(list(model.parameters()))

"""hotloop.GradScaler and hotloop.optim inside torch.compile (inductor, CPU): a compiled training step
gives eager's numbers and torch's scaler + fused AdamW's, with graph breaks where hotloop calls C."""
import copy
import math
import warnings

import pytest
import torch

import hotloop

from ..seeding import seeded_generator

# a step whose input holds an inf: its gradients are non-finite and the step is skipped
POISONED = [False, True, False, False]


def tiny_model():
    gen = seeded_generator(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def batches():
    gen = seeded_generator(6)
    out = []
    for poison in POISONED:
        x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
        if poison:
            x[2, 3] = float("inf")
        out.append((x, y))
    return out


def hotloop_step(model, opt, scaler):
    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)
        scaler.update()
        return loss.detach(), norm
    return step


def torch_step(model, opt, scaler):
    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        return loss.detach(), norm
    return step


def train(make_step, opt_class, scaler_class, compiled, device="cpu", **opt_kwargs):
    torch._dynamo.reset()
    model = tiny_model().to(device)
    opt = opt_class(model.parameters(), lr=0.05, **opt_kwargs)
    scaler = scaler_class(device, init_scale=2.0**10, growth_interval=2)
    step = make_step(model, opt, scaler)
    if compiled:
        step = torch.compile(step, backend="inductor")
    record = []
    for x, y in batches():
        loss, norm = step(x.to(device), y.to(device))
        record.append((loss.item(), norm.item(), scaler.get_scale()))
    return record, [p.detach().clone() for p in model.parameters()]


def assert_same_run(a, b, rel):
    (rec_a, params_a), (rec_b, params_b) = a, b
    for (loss_a, norm_a, scale_a), (loss_b, norm_b, scale_b), poisoned in zip(rec_a, rec_b, POISONED, strict=True):
        assert scale_a == scale_b
        assert loss_a == pytest.approx(loss_b, rel=rel)  # tanh keeps the poisoned loss finite
        if poisoned:  # a non-finite norm both ways
            assert not math.isfinite(norm_a) and not math.isfinite(norm_b)
        else:
            assert norm_a == pytest.approx(norm_b, rel=rel)
    for pa, pb in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=rel, atol=rel)


def test_compiled_step_with_hotloop_scaler_and_optim_matches_eager_and_torch():
    ours_compiled = train(hotloop_step, hotloop.optim.AdamW, hotloop.GradScaler, True)
    ours_eager = train(hotloop_step, hotloop.optim.AdamW, hotloop.GradScaler, False)
    torch_compiled = train(torch_step, torch.optim.AdamW, torch.amp.GradScaler, True, fused=True)
    assert [r[2] for r in ours_compiled[0]] == [2.0**10, 2.0**9, 2.0**9, 2.0**10]  # skipped, then grown
    assert_same_run(ours_compiled, ours_eager, 1e-6)
    assert_same_run(ours_compiled, torch_compiled, 1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_step_with_hotloop_scaler_and_torch_fused_adamw(device):
    ours = train(hotloop_step, torch.optim.AdamW, hotloop.GradScaler, True, device, fused=True)
    theirs = train(torch_step, torch.optim.AdamW, torch.amp.GradScaler, True, device, fused=True)
    assert_same_run(ours, theirs, 1e-5)


def test_compiled_optimizer_step_matches_eager():
    torch._dynamo.reset()
    model = tiny_model()
    twin = copy.deepcopy(model)
    opts = [hotloop.optim.AdamW(m.parameters(), lr=0.05) for m in (model, twin)]
    compiled_step = torch.compile(opts[0].step, backend="inductor")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches()[2:]:
            for m, opt, step in ((model, opts[0], compiled_step), (twin, opts[1], opts[1].step)):
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                step()
    # the step leaves the graph whole: Dynamo never meets hotloop's C calls (it warns when it does)
    assert not [w for w in caught if "hotloop._C" in str(w.message)], [str(w.message) for w in caught]
    for pa, pb in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(pa, pb)

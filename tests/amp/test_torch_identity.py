"""hotloop.GradScaler as code written for torch's sees it: a torch.amp.GradScaler, torch's own methods
reading its attributes, Lightning's AMP plugin and Accelerate's skipped-step detection."""
import copy

import pytest
import torch

import hotloop
from hotloop.amp import GradScaler

from ..seeding import current_seed


def model_and_batch(seed=None):
    gen = torch.Generator().manual_seed(current_seed() if seed is None else seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
    return model, x, y


def backward(model, scaler, x, y, poison=False):
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if poison:
        next(model.parameters()).grad[0, 0] = float("inf")


def test_is_a_torch_grad_scaler():
    assert issubclass(GradScaler, torch.amp.GradScaler)
    assert isinstance(GradScaler("cpu"), torch.amp.GradScaler)
    assert isinstance(hotloop.GradScaler("cpu", enabled=False), torch.amp.GradScaler)


def test_every_method_torch_s_defines_is_hotloop_s():
    """GradScaler is built from parts (grad_checks.GradChecks, scale_state.ScaleState): none of torch's
    own methods may show through, or a call would run torch's code on hotloop's state."""
    torch_own = [n for n, v in vars(torch.amp.GradScaler).items() if callable(v)]
    assert torch_own
    shown_through = [n for n in torch_own
                     if next(c for c in GradScaler.__mro__ if n in vars(c)) is torch.amp.GradScaler]
    assert shown_through == []


def test_torch_s_own_methods_read_its_state_as_torch_s():
    """torch's methods, called on our instance, read _scale, _growth_tracker and the settings with
    torch's meanings (what Lightning and Accelerate read), after growth and a skipped step."""
    ours, ref = GradScaler("cpu", init_scale=4.0, growth_interval=2), torch.amp.GradScaler("cpu", init_scale=4.0,
                                                                                            growth_interval=2)
    model, x, y = model_and_batch()
    twin = copy.deepcopy(model)
    opts = (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1))
    for step in range(5):
        for scaler, m, opt in ((ours, model, opts[0]), (ref, twin, opts[1])):
            opt.zero_grad()
            backward(m, scaler, x, y, poison=step == 3)
            scaler.step(opt)
            scaler.update()
        T = torch.amp.GradScaler
        assert ours._scale.dtype == torch.float32 and ours._scale.dim() == 0
        assert ours._growth_tracker.dtype == torch.int32 and ours._growth_tracker.dim() == 0
        assert T.get_scale(ours) == ref.get_scale() == ours.get_scale()
        assert T._get_growth_tracker(ours) == ref._get_growth_tracker()
        assert T.state_dict(ours) == ref.state_dict() == ours.state_dict()
        assert T.is_enabled(ours) and T.get_growth_interval(ours) == 2
    # torch's load_state_dict fills our tensors in place, as ours does
    T.load_state_dict(ours, {**ref.state_dict(), "scale": 128.0, "_growth_tracker": 1})
    assert ours.get_scale() == 128.0 and ours._get_growth_tracker() == 1


def test_lightning_amp_plugin_takes_it():
    from lightning.fabric.plugins.precision import MixedPrecision

    ours = GradScaler("cpu", init_scale=2.0**10)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=ours)
    model, x, y = model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    plugin.backward(torch.nn.functional.mse_loss(model(x), y), model)
    plugin.optimizer_step(opt)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert plugin.state_dict() == ours.state_dict()


# ---- Accelerate: AcceleratedOptimizer.step_was_skipped watches whether optimizer.step runs ----

@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state: start and leave each test with none (as its own tests do)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerated(opt, scaler):
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # the state AcceleratedOptimizer reads; fp16 on the CPU has no scaler there
    return AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)


@pytest.mark.parametrize("fused", [True, False])
def test_accelerate_reads_a_skipped_step_as_skipped(fused, fresh_accelerate_state):
    """A skipped step reads as skipped and holds the LR scheduler back, with a fused AdamW too (which
    hotloop calls only when the step is taken while something watches its step); parameters, Adam
    state and learning rate follow torch's scaler with a non-fused AdamW, which Accelerate reads right."""
    from accelerate.scheduler import AcceleratedScheduler

    model, x, y = model_and_batch(current_seed() + 1)
    twin = copy.deepcopy(model)
    runs = []
    for m, scaler, kind in ((model, GradScaler("cpu", init_scale=2.0**8), {"fused": fused}),
                            (twin, torch.amp.GradScaler("cpu", init_scale=2.0**8), {"foreach": False})):
        opt = torch.optim.AdamW(m.parameters(), lr=0.01, **kind)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        acc_opt = accelerated(opt, scaler)
        runs.append((m, scaler, acc_opt, AcceleratedScheduler(sched, acc_opt, step_with_optimizer=True,
                                                               split_batches=True), opt))
    for step, poison in enumerate([True, False, True, True, False]):
        seen = []
        for m, scaler, acc_opt, acc_sched, opt in runs:
            acc_opt.zero_grad()
            backward(m, scaler, x, y, poison=poison)
            acc_opt.step()
            acc_sched.step()
            seen.append((acc_opt.step_was_skipped, opt.param_groups[0]["lr"], scaler.get_scale()))
        assert seen[0] == seen[1] == (poison, 0.01 * 0.5 ** (step + 1 - [1, 1, 2, 3, 3][step]), seen[1][2])
    for pa, pb in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    for pa, pb in zip(model.parameters(), twin.parameters(), strict=True):
        sa, sb = runs[0][4].state[pa], runs[1][4].state[pb]
        assert float(sa["step"]) == float(sb["step"]) == 2.0


def test_a_watched_fused_step_is_the_only_one_that_syncs():
    """Without a watcher (an LR scheduler's own wrapper included) the fused step is always called."""
    model, x, y = model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step on the instance, to warn only
    calls = []
    inner = opt.step

    def counting(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    counting._wrapped_by_lr_sched = True  # as torch's scheduler marks its wrapper
    opt.step = counting
    scaler = GradScaler("cpu")
    backward(model, scaler, x, y, poison=True)
    scaler.step(opt)
    scaler.update()
    assert calls == [1] and scaler.skipped_steps == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_accelerate_fp16_on_cuda_reads_skipped_steps(fused, fresh_accelerate_state):
    """Accelerate's own fp16 path (autocast, its scaler slot, prepare, backward, step, scheduler) with
    hotloop's scaler put in torch's place: optimizer_step_was_skipped and the learning rate follow the
    injected overflows, fused or not, and the parameters follow torch's scaler with a non-fused AdamW."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    results = []
    for ours in (True, False):
        AcceleratorState._reset_state(True)
        accelerator = Accelerator(mixed_precision="fp16")
        if ours:
            accelerator.scaler = GradScaler("cuda", init_scale=2.0**8)
        else:
            accelerator.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
        model, x, y = model_and_batch(current_seed() + 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, **({"fused": fused} if ours else {"foreach": False}))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        x, y = x.cuda(), y.cuda()
        seen = []
        for poison in [True, False, True, False]:
            opt.zero_grad()
            with accelerator.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            if poison:
                next(model.parameters()).grad[0, 0] = float("inf")
            opt.step()
            sched.step()
            seen.append((accelerator.optimizer_step_was_skipped, opt.param_groups[0]["lr"]))
        assert [s for s, _ in seen] == [True, False, True, False]
        results.append((seen, [p.detach().cpu().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    for pa, pb in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)

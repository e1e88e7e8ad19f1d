"""hotloop.integrations.lightning.MixedPrecision against Lightning's own MixedPrecision plugin (torch's
GradScaler, torch's clip_grad_norm_), on the CPU with float16 autocast: the same losses, skipped steps,
scales, parameters and checkpoint contents, with gradient clipping by norm running as the scaler's
fused clip, fused optimizers included (which Lightning's own plugin refuses to clip)."""
import math

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install hotloop[test])")
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision  # noqa: E402

import hotloop  # noqa: E402
from hotloop.integrations.lightning import MixedPrecision  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


class Regression(pl.LightningModule):
    """A small MLP under float16 autocast; one batch in each epoch is large enough to overflow
    float16 (a skipped step and a backoff). Records each step's loss, norm and the scale after it."""

    def __init__(self, make_optimizer, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        self.make_optimizer = make_optimizer
        self.losses, self.scales = [], []

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.detach().clone())
        return loss

    def on_train_batch_end(self, outputs, batch, i):
        scaler = self.trainer.precision_plugin.scaler
        self.scales.append(scaler.get_scale())

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def data(seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(80, 16, generator=g) * 3, torch.randn(80, 4, generator=g)
    x[40:48] *= 3e4  # overflows float16 in the forward pass: that step is skipped
    return torch.utils.data.TensorDataset(x, y)


def fit(plugin, make_optimizer, seed, tmp_path, name, ckpt_path=None, epochs=2, accelerator="cpu", **trainer_kwargs):
    model = Regression(make_optimizer, seed)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, plugins=[plugin], max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kwargs)
    trainer.fit(model, torch.utils.data.DataLoader(data(seed), batch_size=8), ckpt_path=ckpt_path)
    path = tmp_path / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    return model, torch.load(path, weights_only=False)


def torch_plugin(device="cpu", **scaler_kwargs):
    return LightningMixedPrecision("16-mixed", device, torch.amp.GradScaler(device, **scaler_kwargs))


def hotloop_plugin(device="cpu", **scaler_kwargs):
    return MixedPrecision("16-mixed", device, hotloop.GradScaler(device, **scaler_kwargs))


def adamw(**kw):
    return lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, **kw)


def sgd(**kw):  # its step is linear in the gradient: the clip's factor shows in full in the weights
    return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, **kw)


def assert_same_runs(theirs, ours, ckpt_theirs, ckpt_ours, rtol=1e-4, atol=1e-5):
    assert len(ours.losses) == len(theirs.losses) > 0
    for j, (a, b) in enumerate(zip(theirs.losses, ours.losses, strict=True)):
        if math.isfinite(a):
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=lambda m: f"step {j}: {m}")
        else:
            assert not math.isfinite(b), f"step {j}: Lightning's loss {a}, ours {b}"
    assert ours.scales == theirs.scales  # the same steps skipped, the same growth
    for (n, a), b in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")
    # the checkpoints hold the same entries: the plugin's under the same name, with the same scaler state
    assert ckpt_ours.keys() == ckpt_theirs.keys()
    assert ckpt_ours["MixedPrecision"] == ckpt_theirs["MixedPrecision"]
    assert ckpt_ours["global_step"] == ckpt_theirs["global_step"]
    torch.testing.assert_close(ckpt_ours["state_dict"], ckpt_theirs["state_dict"], rtol=rtol, atol=atol)
    opt_ours, opt_theirs = ckpt_ours["optimizer_states"], ckpt_theirs["optimizer_states"]
    # a fused optimizer keeps its step count on the parameters' device, the plain one on the CPU
    torch.testing.assert_close([o["state"] for o in opt_ours], [o["state"] for o in opt_theirs], rtol=rtol, atol=atol,
                               check_device=False)
    # the hyperparameters, not how the step runs (foreach, fused): that is the point
    hyper = [k for k in ("params", "lr", "betas", "eps", "momentum", "weight_decay") if k in opt_theirs[0]["param_groups"][0]]
    assert [[{k: g[k] for k in hyper} for g in o["param_groups"]] for o in opt_ours] == \
        [[{k: g[k] for k in hyper} for g in o["param_groups"]] for o in opt_theirs]


class Calls:
    """Counts a scaler's unscale_ and clip_grad_norm_ calls (the path the plugin took)."""

    def __init__(self, scaler):
        self.unscale, self.clip = 0, 0
        unscale, clip = scaler.unscale_, scaler.clip_grad_norm_

        def counted_unscale(opt):
            self.unscale += 1
            return unscale(opt)

        def counted_clip(opt, max_norm, *args, **kwargs):
            self.clip += 1
            return clip(opt, max_norm, *args, **kwargs)

        scaler.unscale_, scaler.clip_grad_norm_ = counted_unscale, counted_clip


FUSED_TOLERANCE = dict(rtol=1e-3, atol=1e-4)
SCALER = dict(init_scale=2.0**14, growth_interval=3)  # grows within the run, and backs off at the overflow


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_equals_lightnings_plugin_with_a_plain_optimizer(tmp_path, clip, optimizer):
    """AdamW and SGD with momentum (per-tensor loops): with clipping by norm (a norm far above 0.05:
    every step is clipped) and without, hotloop's plugin steps as Lightning's does, element for element
    up to rounding (the clip's factor is computed once, in float64, where torch unscales and then
    multiplies in float32: through float16 activations a weight one rounding apart can move a loss by ~1e-5)."""
    seed = torch.randint(1 << 20, ()).item()
    make = adamw(foreach=False) if optimizer == "AdamW" else sgd(foreach=False)
    theirs, ckpt_theirs = fit(torch_plugin(**SCALER), make, seed, tmp_path, "theirs", gradient_clip_val=clip)
    plugin = hotloop_plugin(**SCALER)
    calls = Calls(plugin.scaler)
    ours, ckpt_ours = fit(plugin, make, seed, tmp_path, "ours", gradient_clip_val=clip)
    assert_same_runs(theirs, ours, ckpt_theirs, ckpt_ours)
    steps = len(ours.losses)
    if clip is None:  # unscaled before the hooks, as Lightning does
        assert (calls.unscale, calls.clip) == (steps, 0)
    else:  # the fused clip alone: no separate unscale pass
        assert (calls.unscale, calls.clip) == (0, steps)
    pairs = list(zip(ours.scales, ours.scales[1:]))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs)  # a backoff (skipped step) and a growth


def test_clipping_changes_the_run(tmp_path):
    """The clip is real: without it the same run ends elsewhere."""
    seed = torch.randint(1 << 20, ()).item()
    clipped, _ = fit(hotloop_plugin(**SCALER), adamw(foreach=False), seed, tmp_path, "a", gradient_clip_val=0.05)
    free, _ = fit(hotloop_plugin(**SCALER), adamw(foreach=False), seed, tmp_path, "b")
    assert not torch.allclose(clipped.net[0].weight, free.net[0].weight, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("fused", ["torch", "hotloop"])
def test_fused_optimizer_clips_as_lightning_clips_a_plain_one(tmp_path, fused):
    """Lightning's own plugin refuses gradient_clip_val with a fused optimizer; hotloop's clips inside
    its step, and the run equals Lightning's plugin with the plain optimizer and the same clip."""
    seed = torch.randint(1 << 20, ()).item()
    make_fused = adamw(fused=True) if fused == "torch" else \
        (lambda params: hotloop.optim.AdamW(params, lr=3e-3, weight_decay=0.01))
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(torch_plugin(**SCALER), make_fused, seed, tmp_path, "refused", gradient_clip_val=0.05)
    theirs, ckpt_theirs = fit(torch_plugin(**SCALER), adamw(foreach=False), seed, tmp_path, "theirs",
                              gradient_clip_val=0.05)
    plugin = hotloop_plugin(**SCALER)
    calls = Calls(plugin.scaler)
    ours, ckpt_ours = fit(plugin, make_fused, seed, tmp_path, "ours", gradient_clip_val=0.05)
    assert (calls.unscale, calls.clip) == (0, len(ours.losses))
    # fused Adam's own arithmetic (one kernel, its own order of operations) rounds a little apart, and
    # through float16 activations a weight one rounding apart can move a loss by ~1e-4: FUSED_TOLERANCE.
    # The clip's own arithmetic is checked to 1e-5 with the plain optimizer above; here, that the clip
    # happens inside the fused step: the same fused run without it is far outside that tolerance.
    assert_same_runs(theirs, ours, ckpt_theirs, ckpt_ours, **FUSED_TOLERANCE)
    free, ckpt_free = fit(hotloop_plugin(**SCALER), make_fused, seed, tmp_path, "free")
    with pytest.raises(AssertionError):
        assert_same_runs(theirs, free, ckpt_theirs, ckpt_free, **FUSED_TOLERANCE)


def test_clip_by_value_equals_lightnings(tmp_path):
    """gradient_clip_algorithm="value": unscaled, then torch's clip_grad_value_, as Lightning does."""
    seed = torch.randint(1 << 20, ()).item()
    theirs, ckpt_theirs = fit(torch_plugin(**SCALER), adamw(foreach=False), seed, tmp_path, "theirs",
                              gradient_clip_val=0.01, gradient_clip_algorithm="value")
    ours, ckpt_ours = fit(hotloop_plugin(**SCALER), adamw(foreach=False), seed, tmp_path, "ours",
                          gradient_clip_val=0.01, gradient_clip_algorithm="value")
    assert_same_runs(theirs, ours, ckpt_theirs, ckpt_ours)


def test_resumes_from_lightnings_checkpoint_as_lightning_does(tmp_path):
    """A checkpoint written with Lightning's plugin resumes under hotloop's (the scaler's state under
    the same entry) and the next epochs equal Lightning's own resume from it."""
    seed = torch.randint(1 << 20, ()).item()
    _, _ = fit(torch_plugin(**SCALER), adamw(foreach=False), seed, tmp_path, "first", epochs=1,
               gradient_clip_val=0.05)
    first = str(tmp_path / "first.ckpt")
    theirs, ckpt_theirs = fit(torch_plugin(**SCALER), adamw(foreach=False), seed, tmp_path, "theirs",
                              ckpt_path=first, epochs=3, gradient_clip_val=0.05)
    ours, ckpt_ours = fit(hotloop_plugin(**SCALER), adamw(foreach=False), seed, tmp_path, "ours",
                          ckpt_path=first, epochs=3, gradient_clip_val=0.05)
    assert len(ours.losses) == 20  # epochs 2 and 3 only
    assert_same_runs(theirs, ours, ckpt_theirs, ckpt_ours)


def test_bf16_has_no_scaler_and_clips_as_lightning(tmp_path):
    """bf16-mixed: no scaler, Lightning's plugin as it is (torch's clip)."""
    seed = torch.randint(1 << 20, ()).item()
    plugin = MixedPrecision("bf16-mixed", "cpu")
    assert plugin.scaler is None
    model = Regression(adamw(foreach=False), seed)
    model.on_train_batch_end = lambda *a: None
    theirs_model = Regression(adamw(foreach=False), seed)
    theirs_model.on_train_batch_end = lambda *a: None
    for p, m in ((plugin, model), (LightningMixedPrecision("bf16-mixed", "cpu"), theirs_model)):
        pl.Trainer(accelerator="cpu", devices=1, plugins=[p], max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.05).fit(
            m, torch.utils.data.DataLoader(data(seed), batch_size=8))
    for a, b in zip(theirs_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="'16-mixed' or 'bf16-mixed'"):
        MixedPrecision("32", "cpu")
    with pytest.raises(TypeError, match="hotloop.GradScaler"):
        MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["torch", "hotloop"])
def test_cuda_fused_clip_equals_lightnings_plain_clip(tmp_path, fused):
    """On the GPU: the default scaler (hotloop.GradScaler("cuda")), the fused clip inside torch's
    fused AdamW or hotloop.optim.AdamW, against Lightning's plugin with the per-tensor AdamW."""
    seed = torch.randint(1 << 20, ()).item()
    make_fused = adamw(fused=True) if fused == "torch" else \
        (lambda params: hotloop.optim.AdamW(params, lr=3e-3, weight_decay=0.01))
    theirs, ckpt_theirs = fit(torch_plugin("cuda", **SCALER), adamw(foreach=False), seed, tmp_path, "theirs",
                              accelerator="gpu", gradient_clip_val=0.05)
    plugin = MixedPrecision("16-mixed", "cuda")
    assert isinstance(plugin.scaler, hotloop.GradScaler)
    plugin.scaler.load_state_dict(torch.amp.GradScaler("cuda", **SCALER).state_dict())
    calls = Calls(plugin.scaler)
    ours, ckpt_ours = fit(plugin, make_fused, seed, tmp_path, "ours", accelerator="gpu", gradient_clip_val=0.05)
    assert (calls.unscale, calls.clip) == (0, len(ours.losses))
    assert_same_runs(theirs, ours, ckpt_theirs, ckpt_ours, **FUSED_TOLERANCE)


class ManualRegression(Regression):
    """Manual optimization: the step clips by norm itself (Lightning's way: self.clip_gradients)."""

    def __init__(self, make_optimizer, seed):
        super().__init__(make_optimizer, seed)
        self.automatic_optimization = False

    def training_step(self, batch, i):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.detach().clone())
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()


def test_manual_optimization_clips_as_torchs_own_loop(tmp_path):
    """Manual optimization, clip_gradients(norm) then opt.step(): the unscaled gradients are clipped,
    as in torch's own loop (scaler.unscale_, clip_grad_norm_, scaler.step, scaler.update). (Lightning's
    own plugin clips there before unscaling: the scaled gradients.)"""
    seed = torch.randint(1 << 20, ()).item()
    model = ManualRegression(sgd(foreach=False), seed)
    plugin = hotloop_plugin(**SCALER)
    pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(
        model, torch.utils.data.DataLoader(data(seed), batch_size=8))

    reference = Regression(sgd(foreach=False), seed)
    opt = reference.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    losses, scales = [], []
    for x, y in torch.utils.data.DataLoader(data(seed), batch_size=8):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = torch.nn.functional.mse_loss(reference.net(x).float(), y)
        losses.append(loss.detach())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert model.scales == scales
    for j, (a, b) in enumerate(zip(losses, model.losses, strict=True)):
        if math.isfinite(a):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {j}: {m}")
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)

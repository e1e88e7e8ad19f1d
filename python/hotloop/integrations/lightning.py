"""Lightning's mixed-precision plugin with hotloop's GradScaler, whose `gradient_clip_val` runs as
the scaler's fused clip (one read pass, the factor applied inside the optimizer step; no host sync)."""
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ..amp import GradScaler

__all__ = ["MixedPrecision"]


def _handles_unscaling(optimizer) -> bool:
    """A fused optimizer (torch's fused=True, hotloop.optim): it takes grad_scale/found_inf and
    unscales inside its own step (Lightning's own test for it, by the same attribute)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


class MixedPrecision(_LightningMixedPrecision):
    """`Trainer(plugins=[hotloop.integrations.lightning.MixedPrecision("16-mixed")])`: Lightning's
    MixedPrecision plugin (same arguments, same checkpoint entry, the same steps skipped and scale
    updates) with a hotloop.GradScaler, and with gradient clipping by norm done by the scaler.

    Lightning's own plugin unscales the gradients in one read-write pass, then clips them with
    torch.nn.utils.clip_grad_norm_ (a read pass for the norm, a read-write pass to scale), and refuses
    `gradient_clip_val` with a fused optimizer (it unscales inside its step, so there is nothing to
    clip in between). Here `Trainer(gradient_clip_val=v)` (algorithm "norm", Lightning's default)
    becomes `scaler.clip_grad_norm_(optimizer, v)`: one read-only pass finds inf/NaN and the norm,
    and the unscale x clip factor is applied inside a fused optimizer's own kernel (torch's
    fused=True or hotloop.optim), or in one read-write pass before any other optimizer. So clipping
    works with fused optimizers, with no pass and no host sync added.

    What a hook sees: with a norm clip configured, or a fused optimizer (as with Lightning's plugin),
    `on_before_optimizer_step` sees the gradients still scaled and unclipped: the factor is folded
    into the step (`self.trainer.precision_plugin.scaler.finalize_grads_(optimizer)` writes them
    there, for a hook that must read them). Otherwise the gradients are unscaled before the hook,
    as Lightning does. Clipping by value unscales first and clips with torch, as Lightning does (a
    fused optimizer included: the unscaled step then takes no grad_scale).

    precision: "16-mixed" (float16 autocast and a scaler) or "bf16-mixed" (bfloat16, no scaler:
        Lightning's plugin as it is). device: torch.autocast's device type ("cuda" or "cpu").
    scaler: a hotloop.GradScaler (default: hotloop.GradScaler(device) for "16-mixed").
    """

    def __init__(self, precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed", device: str = "cuda",
                 scaler: Optional[GradScaler] = None) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):  # Lightning's check, before a scaler is made
            raise ValueError(f"hotloop.integrations.lightning.MixedPrecision: expected precision '16-mixed' or "
                             f"'bf16-mixed', got {precision!r}")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(f"hotloop.integrations.lightning.MixedPrecision: expected scaler=None or a "
                            f"hotloop.GradScaler, got {type(scaler).__name__} (Lightning's own MixedPrecision "
                            "takes torch's)")
        if scaler is None and precision == "16-mixed":
            scaler = GradScaler(device)
        super().__init__(precision, device, scaler)
        # id(optimizer) -> "unscaled" (unscale_ or clip_grad_norm_ ran since its last step) or
        # "no backward" (the training step returned None: nothing to clip, no step to fold a clip into)
        self._stage = {}

    def _norm_clip_configured(self, model) -> bool:
        trainer = model.trainer
        algorithm = trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM
        return bool(trainer.gradient_clip_val) and GradClipAlgorithmType(algorithm) == GradClipAlgorithmType.NORM

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        closure_result = closure()
        # as Lightning: backward skipped in automatic optimization (the step returned None)
        skip_unscaling = closure_result is None and model.automatic_optimization
        try:
            if skip_unscaling:
                self._stage[id(optimizer)] = "no backward"
            elif not _handles_unscaling(optimizer) and not self._norm_clip_configured(model):
                # no norm clip to fold the unscale into: unscaled now, as Lightning does, for the hooks to see
                self._unscale(optimizer)
            self._after_closure(model, optimizer)  # the hooks, then configure_gradient_clipping -> clip_gradients
            if skip_unscaling:
                return closure_result
            step_output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return step_output
        finally:
            self._stage.pop(id(optimizer), None)

    def _unscale(self, optimizer):
        """unscale_ once per step (a manual-optimization clip_gradients may have done it already)."""
        if id(optimizer) not in self._stage:
            self.scaler.unscale_(optimizer)
            self._stage[id(optimizer)] = "unscaled"

    def clip_gradients(self, optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if self.scaler is None:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        if isinstance(optimizer, LightningOptimizer):  # manual optimization's self.optimizers(): the scaler
            optimizer = optimizer.optimizer  # keys its state by the optimizer that step() gets
        if clip_val <= 0 or self._stage.get(id(optimizer)) == "no backward":
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            # unscale and clip inside the step (after an unscale_ above, the clip alone)
            self.scaler.clip_grad_norm_(optimizer, clip_val)
            self._stage[id(optimizer)] = "unscaled"
        elif gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self._unscale(optimizer)
            self.scaler.finalize_grads_(optimizer)  # a norm clip pending from an earlier call, made real first
            self.clip_grad_by_value(optimizer, clip_val)

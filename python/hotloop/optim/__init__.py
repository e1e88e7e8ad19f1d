"""hotloop.optim: drop-ins for torch's fused optimizers whose one C call per device reads every gradient
once, divides it by the GradScaler's unscale x clip factor inside the update and never writes it back."""
from .adam import Adam, AdamW
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD"]

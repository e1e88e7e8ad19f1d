"""hotloop.GradScaler and the kernels under it: grad_scaler.py (the drop-in for torch.amp.GradScaler, built on
grad_checks.py, its gradient tables and passes, and scale_state.py, its scale, update and state; overflow_report.py),
device_grads.py (an optimizer's gradients per device: kernel table or torch's ops), sharded.py (gradients
sharded across ranks: the groups a check is reduced over, the one gather), ops.py (its kernels for code
that wants them alone), tensor_table.py (many tensors, one launch)."""
from .grad_scaler import GradScaler, OptState, OverflowReport

__all__ = ["GradScaler", "OptState", "OverflowReport"]

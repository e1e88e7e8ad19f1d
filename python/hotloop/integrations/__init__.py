"""hotloop inside other training frameworks: `hotloop.integrations.lightning` (a precision plugin whose
gradient clipping is the scaler's fused one) and `hotloop.integrations.accelerate` (Accelerate's
prepare_data_loader, keeping hotloop's DataLoader). Each submodule imports its framework; this one
imports nothing."""

"""Test set-up: `gpu`-marked tests skip unless hotloop and torch can both use a CUDA device."""
import pytest
import torch

import hotloop


def gpu_usable() -> bool:
    return hotloop.cuda_available() and torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if gpu_usable():
        return
    reason = hotloop._C.cuda_unavailable_reason() or "torch cannot see a CUDA device"
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

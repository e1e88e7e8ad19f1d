"""What the optimizer tests share: the devices, shapes and steps they run, the inf/NaN they inject, a random
Adam state, and the checks of ours against torch's tensors."""
import math

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SHAPES = [(1,), (555,), (65536,), (65537,), (3, 7), (2**20 + 3,)]
# On the CPU the last tensor has 3 chunks and a tail (the C reference's threads share chunks of 32768):
# 2**20 + 3 elements test nothing more there, and made the bounds' float64 arithmetic most of the time.
CPU_SHAPES = SHAPES[:-1] + [(3 * 32768 + 5,)]


def shapes_for(device):
    return SHAPES if device == "cuda" else CPU_SHAPES


STEPS = 200
# (step, tensor, element, value) injected into the gradient source: first, middle and last tensor and element
INJECT = {5: (0, 0, math.inf), 37: (-1, -1, math.nan), 120: (2, "mid", -math.inf), 121: (-1, 0, math.nan)}


def assert_same_tensors(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def assert_mostly_identical(ours, ref, ours_params, ref_params, keys, only=None):
    """On CUDA ours does torch's arithmetic, float operation for float operation (kernels/optim_math.h):
    bit-identical but where nvcc contracted one of torch's a*b + c into an fma where ours does not, or the
    other way round (none, if optim_math.h guessed nvcc right). A wrong guess, or double arithmetic where
    torch's is float, differs in a tenth to a third of the elements. So: at most 1e-4 of the elements differ,
    counted per kind (param, each state) over all tensors of the test together: per tensor, a tensor of
    fewer than 10,000 elements would allow none (seen: one differing element of a 1-element tensor
    failing the old per-tensor check, where the arithmetic differed everywhere). `only`: the indices of
    the parameters to count (None: all)."""
    for key in ["param"] + list(keys):
        differ, total, where = 0, 0, []
        for i, (p, q) in enumerate(zip(ours_params, ref_params, strict=True)):
            if only is not None and i not in only:
                continue
            a, b = (p.detach(), q.detach()) if key == "param" else (ours.state[p][key], ref.state[q][key])
            n = int((a != b).sum())
            differ, total = differ + n, total + a.numel()
            if n:
                where.append(f"param {i}: {n} of {a.numel()}")
        assert differ <= 1e-4 * total, f"{key}: {differ} of {total} elements differ ({', '.join(where)})"


def fresh_state(params, amsgrad):
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    out = []
    for p in params:
        st = {k: torch.rand_like(p) for k in keys}
        st["step"] = torch.tensor(float(torch.randint(0, 50, ())), dtype=torch.float32)
        out.append(st)
    return out

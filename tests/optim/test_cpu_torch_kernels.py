"""CPU steps of large tensors go to torch's fused kernels (NOTE [ CPU steps of large tensors go to torch ]):
which parameter sets take that path, that they then give torch's bits, and that hotloop's rules hold on it
(any non-zero found_inf skips the step, the first SGD step's buffers take the gradient)."""
import pytest
import torch

import hotloop
from hotloop.optim import torch_cpu_step

from ..seeding import seeded_generator

pytestmark = pytest.mark.skipif(not torch_cpu_step.torch_has_cpu_fused_kernels(),
                                reason="this torch has no fused CPU optimizer kernels")

LARGE = torch_cpu_step.LARGE_TENSOR_ELEMENTS + 37
CASES = [("AdamW", dict(weight_decay=0.05)), ("Adam", dict(amsgrad=True, maximize=True, weight_decay=0.01)),
         ("SGD", dict(momentum=0.9, nesterov=True)), ("SGD", dict(momentum=0.9, dampening=0.3)),
         ("SGD", dict(momentum=0.0, weight_decay=0.01))]


def pair(name, kwargs, shapes, dtype, gen):
    """(hotloop's optimizer, torch's fused one) over equal copies of fresh parameters of `shapes`"""
    ours = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    return (getattr(hotloop.optim, name)(ours, lr=1e-2, **kwargs),
            getattr(torch.optim, name)(theirs, lr=1e-2, fused=True, **kwargs))


def count_torch_kernel_calls(monkeypatch):
    calls = []
    for op in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_"):
        real = getattr(torch, op)
        monkeypatch.setattr(torch, op, lambda *a, _real=real, _op=op, **k: (calls.append(_op), _real(*a, **k))[1])
    return calls


def step_both(ours, theirs, gen, scale=None, found=None):
    for po, pt in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"], strict=True):
        g = torch.randn(po.shape, generator=gen).to(po.dtype)
        po.grad, pt.grad = g.clone(), g.clone()
    if scale is None:
        ours.step()
        theirs.step()
        return
    ours.step(grad_scale=scale, found_inf=found)
    theirs.grad_scale, theirs.found_inf = scale, found  # how a GradScaler hands them to torch's
    theirs.step()
    del theirs.grad_scale, theirs.found_inf


def assert_same_bits(ours, theirs):
    for po, pt in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(po, pt, rtol=0, atol=0)
        for key, value in theirs.state[pt].items():
            torch.testing.assert_close(ours.state[po][key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,kwargs", CASES)
def test_large_tensors_step_by_torchs_kernel_with_its_bits(name, kwargs, dtype, monkeypatch):
    gen = seeded_generator()
    ours, theirs = pair(name, kwargs, [(LARGE,), (2, LARGE // 2 + 1)], dtype, gen)
    step_both(ours, theirs, gen)  # the first step (SGD's buffers take the gradient: hotloop's C)
    calls = count_torch_kernel_calls(monkeypatch)
    scale = torch.tensor([64.0])
    for _ in range(3):
        step_both(ours, theirs, gen, scale, torch.zeros(()))  # GradScaler's shapes
        step_both(ours, theirs, gen)
    assert len(calls) == 12  # 6 of ours, 6 of torch's own
    assert_same_bits(ours, theirs)


@pytest.mark.parametrize("name,kwargs", CASES)
def test_any_non_zero_found_inf_skips_on_torchs_kernel_too(name, kwargs):
    """torch's kernel skips for found_inf == 1.0 only; hotloop's rule (any non-zero value) holds on its path"""
    gen = seeded_generator()
    ours, _ = pair(name, kwargs, [(LARGE,)], torch.float32, gen)
    p = ours.param_groups[0]["params"][0]
    p.grad = torch.randn(p.shape, generator=gen)
    ours.step()
    before = p.detach().clone(), {k: v.clone() for k, v in ours.state[p].items()}
    for found in (2.0, -1.0, float("nan")):
        p.grad = torch.randn(p.shape, generator=gen)
        ours.step(grad_scale=torch.ones(1), found_inf=torch.tensor([found]))  # of one element, any shape
    torch.testing.assert_close(p.detach(), before[0], rtol=0, atol=0)
    for key, value in before[1].items():
        torch.testing.assert_close(ours.state[p][key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("shapes", [[(64, 64)] * 40, [(LARGE,), (3, 3)], [(LARGE - 100,)]],
                         ids=["many-small", "large-mixed-with-float16-grads", "below-the-mean"])
def test_other_sets_stay_with_hotloops_kernel(shapes, monkeypatch):
    """small tensors on average, and a float32 parameter with a float16 gradient (which torch's kernel
    refuses), step by hotloop's C"""
    gen = seeded_generator()
    ours, _ = pair("AdamW", {}, shapes, torch.float32, gen)
    calls = count_torch_kernel_calls(monkeypatch)
    for _ in range(2):
        for i, p in enumerate(ours.param_groups[0]["params"]):
            g = torch.randn(p.shape, generator=gen)
            if len(shapes) == 2 and i == 0:
                if hasattr(p, "grad_dtype"):
                    p.grad_dtype = None  # torch >= 2.10 refuses another dtype's gradient unless told
                g = g.half()
            p.grad = g
        ours.step()
    assert calls == []


def test_step_counts_add_as_torchs_foreach_add():
    """StepCounter's C call gives torch._foreach_add_'s float32 bits, also where float32 stops counting
    (2**24 + 1 rounds back to 2**24), and leaves counts of another kind to torch."""
    starts = [0.0, 1.0, 2.0**24 - 1, 2.0**24, 2.0**24 + 2, 3.5e7, float(torch.randint(0, 2**30, ()).item())]
    ours = [torch.tensor(v, dtype=torch.float32) for v in starts]
    theirs = [t.clone() for t in ours]
    counter = torch_cpu_step.StepCounter(ours)
    for _ in range(3):
        counter.count()
        torch._foreach_add_(theirs, 1)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), (a.item(), b.item())
    doubles = [torch.tensor(v, dtype=torch.float64) for v in starts]
    torch_cpu_step.StepCounter(doubles).count()  # torch's own add
    assert [t.item() for t in doubles] == [v + 1 for v in starts]


def test_optim_count_steps_refuses_what_it_does_not_count():
    from hotloop import _C
    from hotloop.amp import tensor_table

    one, two = torch.zeros(()), torch.zeros(2)
    with pytest.raises(ValueError, match="one-element CPU tensors"):
        _C.optim_count_steps(tensor_table.packed_bytes([one, two]))
    with pytest.raises(TypeError):
        _C.optim_count_steps(tensor_table.packed_bytes([one, torch.zeros((), dtype=torch.float64)]))
    assert one.item() == 0.0  # nothing counted before the refusal

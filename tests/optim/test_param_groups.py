"""The forms of params torch's optimizers take give torch's result: a generator per param group (as
module.parameters() is), a single tensor, a group added during training, a parameter without a gradient
for some steps, gradients set to None between steps (each step's are new tensors)."""
import copy

import pytest
import torch

import hotloop.optim

from ..seeding import seeded_generator


def train(make, model, steps=12, add_at=6):
    opt = make([{"params": model[0].parameters(), "lr": 1e-2},  # generators, read once
                {"params": model[2].weight, "weight_decay": 0.0},  # one tensor
                {"params": iter([model[2].bias])}])
    model[1].weight.requires_grad_(False)  # no gradient until its group is added
    for i in range(steps):
        if i == add_at:
            model[1].weight.requires_grad_(True)
            opt.add_param_group({"params": model[1].parameters(), "lr": 1e-3})
        x = torch.randn(16, 8, generator=seeded_generator(i))  # the same batches for torch's run and ours
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("name,kwargs", [("AdamW", {}), ("Adam", {"amsgrad": True}), ("SGD", {"momentum": 0.9})])
def test_param_group_forms_step_as_torchs(name, kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4))
    ours, ours_opt = train(lambda groups: getattr(hotloop.optim, name)(groups, lr=3e-3, **kwargs),
                           copy.deepcopy(model))
    theirs, theirs_opt = train(lambda groups: getattr(torch.optim, name)(groups, lr=3e-3, fused=True, **kwargs),
                               copy.deepcopy(model))
    assert [len(g["params"]) for g in ours_opt.param_groups] == [len(g["params"]) for g in theirs_opt.param_groups]
    for (key, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert not torch.equal(p, model.state_dict()[key]), f"{key} never moved"
        # float32 rounding of a dozen steps on the CPU (tests/optim's bounds say how much a step may differ)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=key)

"""hotloop's optimizers are instances of the torch optimizers they replace (issue 36: code that dispatches on
type takes torch's path), and what torch's machinery does with an optimizer works: LR schedulers, step
hooks, zero_grad, add_param_group, state_dict into torch's optimizer and back."""
import copy

import pytest
import torch

import hotloop.optim

from ..seeding import current_seed

TYPES = [("AdamW", {}), ("Adam", {"amsgrad": True}), ("SGD", {"momentum": 0.9})]


def model_params(seed=None):
    gen = torch.Generator().manual_seed(current_seed() if seed is None else seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(8, 4), (4,), (3,)]]


def set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_isinstance_of_torchs_classes():
    p = [torch.nn.Parameter(torch.randn(3))]
    assert isinstance(hotloop.optim.AdamW(p), torch.optim.AdamW)
    assert isinstance(hotloop.optim.AdamW(p), torch.optim.Adam)  # as torch's AdamW is
    assert isinstance(hotloop.optim.Adam(p), torch.optim.Adam)
    assert not isinstance(hotloop.optim.Adam(p), torch.optim.AdamW)
    assert isinstance(hotloop.optim.SGD(p), torch.optim.SGD)
    for name, _ in TYPES:
        assert issubclass(getattr(hotloop.optim, name), torch.optim.Optimizer)
        # hotloop's own step, not torch's
        assert getattr(hotloop.optim, name).step is not getattr(torch.optim, name).step


@pytest.mark.parametrize("name,kwargs", TYPES)
def test_lr_scheduler_and_hooks_as_torchs(name, kwargs):
    """A StepLR and a LambdaLR chained over ours give the lr torch's get, and the parameters follow; step
    pre/post hooks run once per step; zero_grad(set_to_none) clears the gradients."""
    ours_params, ref_params = model_params(), model_params()
    ours = getattr(hotloop.optim, name)(ours_params, lr=0.1, **kwargs)
    ref = getattr(torch.optim, name)(ref_params, lr=0.1, fused=True, **kwargs)
    scheds = []
    for opt in (ours, ref):
        scheds.append(torch.optim.lr_scheduler.ChainedScheduler([
            torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))]))
    calls = []
    ours.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    ours.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    for step in range(6):
        for opt, params, sched in ((ours, ours_params, scheds[0]), (ref, ref_params, scheds[1])):
            opt.zero_grad(set_to_none=True)
            assert all(p.grad is None for p in params)
            set_grads(params, step)
            opt.step()
            sched.step()
        assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
        for p, q in zip(ours_params, ref_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # float32 rounding of a few steps
    assert calls == ["pre", "post"] * 6
    assert ours.param_groups[0]["lr"] != 0.1


@pytest.mark.parametrize("name,kwargs", TYPES)
def test_state_dict_round_trip_through_torchs_optimizer(name, kwargs):
    """ours -> torch's fused optimizer -> ours: the same keys in param_groups and state, the same tensors
    after the round trip, and a step of each side from there agrees."""
    ours_params = model_params()
    ours = getattr(hotloop.optim, name)(ours_params, lr=0.05, **kwargs)
    ours.add_param_group({"params": [torch.nn.Parameter(torch.randn(5))], "lr": 0.01})
    ours_params.append(ours.param_groups[1]["params"][0])
    for step in range(3):
        set_grads(ours_params, step)
        ours.step()
    saved = ours.state_dict()
    theirs_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    theirs = getattr(torch.optim, name)([{"params": theirs_params[:3]}, {"params": theirs_params[3:]}], lr=0.05,
                                        fused=True, **kwargs)
    theirs.load_state_dict(copy.deepcopy(saved))
    theirs_saved = theirs.state_dict()
    assert theirs_saved["param_groups"] == saved["param_groups"]
    back_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    back = getattr(hotloop.optim, name)([{"params": back_params[:3]}, {"params": back_params[3:]}], lr=0.05, **kwargs)
    back.load_state_dict(copy.deepcopy(theirs_saved))
    again = back.state_dict()
    assert again["param_groups"] == saved["param_groups"]
    assert again["state"].keys() == saved["state"].keys()
    for k, st in saved["state"].items():
        assert st.keys() == again["state"][k].keys()
        for key, value in st.items():
            assert torch.equal(again["state"][k][key], value), (k, key)
    set_grads(back_params, 10)
    set_grads(theirs_params, 10)
    back.step()
    theirs.step()
    for p, q in zip(back_params, theirs_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

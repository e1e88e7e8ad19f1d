"""The per-step checks' shortcuts (optim/group_key.py, optim/param_table.py): a step whose group key equals
the last checked step's only launches, so whatever the key leaves out would go unchecked. State tensors
replaced or moved, gradients reshaped or re-strided in place (same address), all get checked again, and
a gradient the shortcut does not recognise still gets check_param's verdict."""
import copy

import pytest
import torch

import hotloop

CASES = [("AdamW", {}, "exp_avg_sq"), ("Adam", {"amsgrad": True}, "max_exp_avg_sq"),
         ("SGD", {"momentum": 0.9}, "momentum_buffer")]


@pytest.mark.parametrize("name,kwargs,key", CASES)
def test_a_replaced_state_tensor_is_checked_again(name, kwargs, key):
    p = torch.nn.Parameter(torch.randn(6, 5))
    opt = getattr(hotloop.optim, name)([p], lr=0.1, **kwargs)
    p.grad = torch.empty(6, 5)
    for _ in range(2):  # the state is made, then its table cached (the gradient stays where it is, as
        p.grad.normal_()  # with zero_grad(set_to_none=False): only the state tells the steps apart)
        opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    param = p.detach().clone()
    opt.state[p][key] = torch.zeros(5, 6)  # another tensor: its shape is wrong
    p.grad.normal_()
    with pytest.raises(ValueError, match=f"state '{key}' must be a float32 tensor laid out as its parameter"):
        opt.step()
    assert torch.equal(p.detach(), param)
    opt.state[p][key] = before[key].clone()  # a good tensor again: accepted, and the step is torch's
    ref = torch.nn.Parameter(param.clone())
    torch_opt = getattr(torch.optim, name)([ref], lr=0.1, **kwargs)
    torch_opt.state[ref].update({k: v.clone() for k, v in before.items()})
    ref.grad = p.grad.clone()
    opt.step()
    torch_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-5, atol=1e-6)  # float32 rounding of one step


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_gradients_outside_the_shortcut_get_check_params_verdict(name):
    # a channels_last parameter and gradient: not contiguous, so check_param decides, and accepts
    p = torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    p.grad = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    getattr(hotloop.optim, name)([p], lr=0.1).step()
    # a contiguous parameter with a channels_last gradient: refused, nothing changed
    q = torch.nn.Parameter(torch.randn(2, 3, 4, 5))
    q.grad = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    before = q.detach().clone()
    with pytest.raises(ValueError, match="laid out as its parameter"):
        getattr(hotloop.optim, name)([q], lr=0.1).step()
    assert torch.equal(q.detach(), before)


def stepped_twice(name, kwargs, shape=(6, 5)):
    """an optimizer whose step over one parameter is cached: its state made, its key and table kept (the
    gradient stays where it is, as with zero_grad(set_to_none=False))"""
    p = torch.nn.Parameter(torch.randn(*shape))
    opt = getattr(hotloop.optim, name)([p], lr=0.1, **kwargs)
    p.grad = torch.empty(*shape)
    for _ in range(2):
        p.grad.normal_()
        opt.step()
    return p, opt


@pytest.mark.parametrize("name,kwargs,key", CASES)
def test_a_state_tensor_moved_by_data_assignment_is_checked_again(name, kwargs, key):
    p, opt = stepped_twice(name, kwargs)
    param = p.detach().clone()
    opt.state[p][key].data = torch.zeros(5, 6)  # the same tensor object, another place and shape
    with pytest.raises(ValueError, match=f"state '{key}' must be a float32 tensor laid out as its parameter"):
        opt.step()
    assert torch.equal(p.detach(), param)


@pytest.mark.parametrize("name,kwargs,key", CASES)
def test_a_gradient_changed_in_place_is_checked_again(name, kwargs, key):
    p, opt = stepped_twice(name, kwargs, shape=(5, 5))
    param = p.detach().clone()
    p.grad.t_()  # same address and shape, transposed strides
    with pytest.raises(ValueError, match="laid out as its parameter"):
        opt.step()
    assert torch.equal(p.detach(), param)
    p.grad.t_()
    p.grad.resize_(25)  # same address, another shape
    with pytest.raises(ValueError, match="gradient shape"):
        opt.step()
    assert torch.equal(p.detach(), param)


@pytest.mark.parametrize("name,kwargs,key", CASES)
def test_load_state_dict_replaces_what_the_cached_step_updates(name, kwargs, key):
    p, opt = stepped_twice(name, kwargs)
    ref = torch.nn.Parameter(p.detach().clone())
    torch_opt = getattr(torch.optim, name)([ref], lr=0.1, **kwargs)
    saved = opt.state_dict()
    saved["state"][0] = {k: torch.rand_like(v) if v.dim() else v.clone() for k, v in saved["state"][0].items()}
    opt.load_state_dict(copy.deepcopy(saved))  # load_state_dict may keep the very tensors it is given
    torch_opt.load_state_dict(copy.deepcopy(saved))
    ref.grad = p.grad.clone()
    opt.step()
    torch_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    for k, v in torch_opt.state[ref].items():
        torch.testing.assert_close(opt.state[p][k], v, rtol=1e-5, atol=1e-6)

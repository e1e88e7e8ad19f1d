"""The per-step checks' shortcuts (optim/param_table.py): state tensors are checked again whenever one
is replaced (step_key changes, so the table is written again), and a gradient the shortcut does not
recognise still gets check_param's verdict."""
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

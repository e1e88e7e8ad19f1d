"""The C entry points that take many values take them by keyword only (NOTE [ Keyword-only seams ] in
csrc/keyword_args.h): a positional call, an unknown or missing name and a value of the wrong type raise
TypeError before any work, and a call by name reaches the C reference."""
import math

import pytest
import torch

from hotloop import _C

SEAMS = ["amp_check", "amp_apply", "amp_update", "optim_adam", "optim_adam_table", "optim_sgd", "image_resize"]


@pytest.mark.parametrize("name", SEAMS)
def test_positional_values_are_refused(name):
    with pytest.raises(TypeError, match=f"{name} takes keyword arguments only"):
        getattr(_C, name)(0, 1, 2, 3, 4, 5, 6)


@pytest.mark.parametrize("name", SEAMS)
def test_nothing_given_names_a_missing_argument(name):
    with pytest.raises(TypeError, match=f"{name}: missing keyword argument"):
        getattr(_C, name)()


def update_call(tensors, **changes):
    scale, tracker, state, found = tensors
    kwargs = dict(device=-1, scale=scale.data_ptr(), growth_tracker=tracker.data_ptr(), state=state.data_ptr(),
                  found=(found.data_ptr(),), growth_factor=2.0, backoff_factor=0.5, growth_interval=1,
                  hysteresis=1, min_scale=0.0, max_scale=math.inf, adjust=True, stream=0)
    kwargs.update(changes)
    _C.amp_update(**kwargs)


def scale_state():
    start = float(torch.randint(1, 2 ** 20, ()).item())
    return (torch.full((), start), torch.zeros((), dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int64),
            start)


def test_a_call_by_name_in_any_order_runs():
    scale, tracker, state, start = scale_state()
    found = torch.zeros(())
    update_call((scale, tracker, state, found))
    assert scale.item() == start * 2.0  # one clean step with interval 1: grown
    found.fill_(1.0)
    kwargs = dict(stream=0, adjust=True, max_scale=math.inf, min_scale=0.0, hysteresis=1, growth_interval=1,
                  backoff_factor=0.5, growth_factor=2.0, found=(found.data_ptr(),), state=state.data_ptr(),
                  growth_tracker=tracker.data_ptr(), scale=scale.data_ptr(), device=-1)
    _C.amp_update(**kwargs)  # the names reversed: the same values reach the same places
    assert scale.item() == start and tracker.item() == 0 and state[0].item() == 1


def test_unknown_name_and_wrong_type_raise_before_any_work():
    scale, tracker, state, start = scale_state()
    tensors = (scale, tracker, state, torch.zeros(()))
    with pytest.raises(TypeError, match="unexpected keyword argument 'growth'"):
        update_call(tensors, growth=2.0)
    with pytest.raises(TypeError, match="amp_update: growth_interval: expected an int"):
        update_call(tensors, growth_interval="1")
    with pytest.raises(TypeError, match="amp_update: backoff_factor: expected a number"):
        update_call(tensors, backoff_factor=None)
    with pytest.raises(OverflowError, match="amp_update: scale"):
        update_call(tensors, scale=-1)
    with pytest.raises(OverflowError, match="amp_update: device"):
        update_call(tensors, device=2 ** 40)
    assert scale.item() == start and tracker.item() == 0  # nothing ran

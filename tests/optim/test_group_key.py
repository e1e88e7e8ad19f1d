"""The param-group key in C (csrc/group_key.c): equal while nothing a step's checks or table were made
from changed, different after each change that could matter, None where the step must check everything,
and other errors raised."""
import pytest
import torch

from hotloop.optim.group_key import group_key

from ..seeding import seeded_generator

KEYS = ("exp_avg", "step")


def a_group(gen):
    """(state, params): two parameters with gradients and state, one without a gradient"""
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(3)]
    params[0].data = params[0].data.half()  # float16 and bfloat16 share a size: a dtype alone can change
    state = {}
    for p in params[:2]:
        p.grad = torch.randn(4, 3, generator=gen).to(p.dtype)
        state[p] = {"exp_avg": torch.zeros(4, 3), "step": torch.zeros(())}
    return state, params


def changes(state, params):
    """each change a cached step must notice, as a function that makes it"""
    p, q = params[0], params[1]
    return {
        "parameter moved by .data =": lambda: setattr(p, "data", p.data.clone()),
        "parameter re-strided where it lies": lambda: setattr(p, "data", p.data.as_strided((4, 3), (1, 4))),
        "parameter viewed as another dtype": lambda: setattr(p, "data", p.data.view(torch.bfloat16)),
        "gradient replaced": lambda: setattr(q, "grad", q.grad.clone()),
        "gradient reshaped in place": lambda: q.grad.resize_(12),
        "gradient dropped": lambda: setattr(q, "grad", None),
        "gradient given": lambda: setattr(params[2], "grad", torch.zeros(4, 3)),
        "state tensor replaced": lambda: state[q].__setitem__("exp_avg", torch.zeros(4, 3)),
        "state tensor moved by .data =": lambda: setattr(state[p]["step"], "data", torch.zeros(())),
    }


@pytest.mark.parametrize("change", list(changes({}, [None, None]).keys()))
def test_the_key_changes_with_what_a_step_was_made_from(change):
    state, params = a_group(seeded_generator())
    key = group_key(state, params, KEYS)
    assert key is not None and key == group_key(state, params, KEYS)  # read twice, nothing changed
    state[params[0]]["exp_avg"].add_(1)  # values change every step: not part of the key
    params[1].grad.normal_()
    assert group_key(state, params, KEYS) == key
    changes(state, params)[change]()
    assert group_key(state, params, KEYS) != key


def test_no_key_where_the_step_must_check_everything():
    state, params = a_group(seeded_generator())
    del state[params[1]]
    assert group_key(state, params, KEYS) is None  # no state yet: the step makes it
    state, params = a_group(seeded_generator())
    del state[params[1]]["step"]
    assert group_key(state, params, KEYS) is None  # a state tensor missing
    state[params[1]]["step"] = 3.0
    assert group_key(state, params, KEYS) is None  # not a tensor: converted by the step
    state, params = a_group(seeded_generator())
    params[0].grad = torch.eye(4, 3, dtype=torch.float16).to_sparse()
    assert group_key(state, params, KEYS) is None  # no strides: check_param says why it is refused
    assert group_key(state, params[2:], KEYS) == (None,)  # without a gradient nothing else is read
    assert group_key(state, params[:1], ()) is None


def test_other_errors_propagate():
    class Broken:
        @property
        def grad(self):
            raise ValueError("not a parameter")

    with pytest.raises(ValueError, match="not a parameter"):
        group_key({}, [Broken()], KEYS)
    with pytest.raises(TypeError, match="params"):
        group_key({}, 3, KEYS)

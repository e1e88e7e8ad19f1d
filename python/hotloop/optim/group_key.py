"""The key of one param group's optimizer step: what the step's checks and the kernels' table were made
from, read in one pass of a few attribute reads per parameter (the step's host time is mostly this, so
the pass is C's: csrc/group_key.c)."""
from .. import _C


def group_key(state, params, keys):
    """A tuple that changes whenever the checks or the table of a step over `params` could: per parameter
    None without a gradient, else the address, dtype, shape and strides of the parameter and those of its
    gradient, and the identity and address of each state tensor named in `keys` (a tensor replaced, or
    moved by ``.data =``, changes it). None when a parameter with a gradient lacks that state or holds
    something else there (the step then makes or converts it), or a gradient has no strides (sparse:
    check_param says why it is refused)."""
    if not isinstance(state, dict):  # torch's is a defaultdict; another mapping: every step checks everything
        return None
    return _C.group_key(state, params, tuple(keys))

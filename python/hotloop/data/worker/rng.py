"""The global RNG states of a DataLoader worker: seeded as torch seeds them, and saved and restored
as bytes, so that a resumed epoch or a replaced worker draws what the original would have drawn."""
import array
import random
import struct

import torch

from ..._torch_compat import numpy_worker_seed

def seed_like_torch(base_seed, worker_id):
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(numpy_worker_seed(base_seed, worker_id))
    except ImportError:
        pass
    return seed


_RNG_HEAD = struct.Struct("<HI")  # format version, bytes of torch's state
_PY_RNG = struct.Struct("<?d")  # random's cached gauss: present, value
_NP_RNG = struct.Struct("<iid")  # numpy's position, has_gauss, cached_gaussian
_MT_WORDS = 624


def rng_state() -> bytes:
    """The process's global RNG states (torch's CPU generator, random, numpy's legacy one) as bytes:
    plain bytes pickle and torch.save cheaply (about 10 kB, mostly the generators' state tables)."""
    t = torch.get_rng_state().numpy().tobytes()
    version, words, gauss = random.getstate()
    if version != 3 or len(words) != _MT_WORDS + 1:
        raise ValueError(f"rng_state: unexpected random.getstate() version {version}")
    parts = [_RNG_HEAD.pack(1, len(t)), t, array.array("I", words).tobytes(),
             _PY_RNG.pack(gauss is not None, gauss or 0.0)]
    try:
        import numpy as np
    except ImportError:
        np = None
    state = np.random.get_state() if np is not None else None
    if type(state) is tuple and state[0] == "MT19937":  # else a bit generator set by the user: not ours
        _, keys, pos, has_gauss, cached = state
        parts += [keys.astype("<u4", copy=False).tobytes(), _NP_RNG.pack(pos, has_gauss, cached)]
    return b"".join(parts)


def set_rng_state(state: bytes) -> None:
    """Undo rng_state(): set the states it took (numpy's only if it was there and still is)."""
    fmt, tlen = _RNG_HEAD.unpack_from(state)
    if fmt != 1:
        raise ValueError(f"set_rng_state: unknown format {fmt}")
    off = _RNG_HEAD.size
    torch.set_rng_state(torch.frombuffer(bytearray(state[off:off + tlen]), dtype=torch.uint8))
    off += tlen
    words = array.array("I")
    words.frombytes(state[off:off + 4 * (_MT_WORDS + 1)])
    off += 4 * (_MT_WORDS + 1)
    has, gauss = _PY_RNG.unpack_from(state, off)
    off += _PY_RNG.size
    random.setstate((3, tuple(words), gauss if has else None))
    if off < len(state):
        try:
            import numpy as np
        except ImportError:
            return
        keys = np.frombuffer(state, dtype="<u4", count=_MT_WORDS, offset=off).astype(np.uint32)
        pos, has_gauss, cached = _NP_RNG.unpack_from(state, off + 4 * _MT_WORDS)
        np.random.set_state(("MT19937", keys, pos, has_gauss, cached))


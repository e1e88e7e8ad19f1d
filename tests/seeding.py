"""The seed each test runs under: fresh every run, printed when the test fails, set by HOTLOOP_TEST_SEED.

tests/conftest.py seeds torch, random and numpy with a new seed before every test (`seed_test`) and adds
"seed: N" to a failing test's report; HOTLOOP_TEST_SEED=N runs every test under N again. A test or helper
that makes its own generator seeds it with `derived_seed()`, a draw from that seeded state, or, where two
sides must draw alike (torch's loader and ours), with `current_seed() + k` (`seeded_generator(k)`): fresh
each run, the same again under the same N. Fixtures shared by a whole module draw under conftest's
`module_seed` (reported too, set by HOTLOOP_MODULE_SEED)."""
import os
import random

import numpy as np
import torch

SEED_BITS = 31  # what every generator here accepts (numpy's legacy seed is 32-bit, torch's 64-bit)

_current = None  # the running test's seed, set by the autouse fixture through seed_test()


def fresh_seed(variable):
    """The seed in environment variable `variable` when set (to reproduce a run), else a new one."""
    text = os.environ.get(variable, "").strip()
    if text:
        return int(text)
    return int.from_bytes(os.urandom(8), "little") % 2**SEED_BITS


def seed_everything(seed):
    """torch (CPU and every CUDA device), Python's random and numpy's legacy global generator."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def seed_test(seed):
    """The running test's seed becomes `seed`: torch, random and numpy seeded with it."""
    global _current
    _current = seed
    seed_everything(seed)


def current_seed():
    """The running test's seed (reported when it fails): for generators that two sides seed alike."""
    if _current is None:
        raise RuntimeError("no test seed yet: current_seed() is for a test's body and its function fixtures")
    return _current


def seeded_generator(offset=0):
    """A torch.Generator seeded with the running test's seed + `offset`: two made with one offset draw
    alike (the sampler of torch's loader and of ours), two with different offsets do not."""
    return torch.Generator().manual_seed(current_seed() + offset)


def derived_seed():
    """A seed drawn from torch's seeded generator: for a generator a test makes itself (numpy's
    default_rng, a torch.Generator for a sampler) so that the test seed reproduces it."""
    return int(torch.randint(0, 2**SEED_BITS, ()).item())

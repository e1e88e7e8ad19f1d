"""The sampler is read no further ahead than torch's iterator reads it: prefetch_factor batches per
worker beyond those handed out, batches copied to the device ahead (device=, prefetch_batches) counted
among them. A sampler read past its end draws again from the loader's generator (RandomSampler's
randperm for the next pass, BatchSampler asking for one batch more), so an epoch left near its end
that read further than torch's left the generator elsewhere, and every later epoch's order differed."""
import pytest
import torch

import hotloop

from .conftest import fake_device


def epochs(make, seed, stop):
    """An epoch left after `stop` batches, then a whole one: (the whole epoch's batches, the
    generator's state after it)."""
    gen = torch.Generator().manual_seed(seed)
    loader = make(gen)
    it = iter(loader)
    for _ in range(stop):
        next(it)
    del it
    whole = [b.tolist() for b in loader]
    return whole, gen.get_state()


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_an_epoch_left_near_its_end_leaves_the_generator_as_torch_does(device, fake_cuda, prefetch_thread):
    seed = int(torch.randint(1 << 30, ()))
    data = list(range(40))  # 10 batches of 4: torch reads batch 11 (the end) once 7 were handed out

    def ours(gen):
        loader = hotloop.DataLoader(data, batch_size=4, shuffle=True, num_workers=2, generator=gen)
        return fake_device(loader) if device else loader

    def theirs(gen):
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=2, generator=gen)

    for stop in range(1, 11):
        want_batches, want_state = epochs(theirs, seed, stop)
        got_batches, got_state = epochs(ours, seed, stop)
        assert got_batches == want_batches, f"left after {stop} batches: the next epoch's order differs"
        assert torch.equal(got_state, want_state), f"left after {stop} batches: the generator differs"

"""hotloop's own DataLoader settings, set after the first epoch started persistent workers: refused with a
ValueError (the pool took them when it was made), as torch refuses its structural attributes; allowed
while no pool lives."""
import pytest
import torch

import hotloop


@pytest.mark.parametrize("name,value", [("prefetch_batches", 3), ("max_worker_restarts", 1),
                                        ("gpu_transform", None)])
def test_settings_a_live_pool_took_are_refused(name, value):
    loader = hotloop.DataLoader(torch.arange(16), batch_size=4, num_workers=1, persistent_workers=True)
    setattr(loader, name, value)  # before the first epoch: the pool takes it when made
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match=f"{name} cannot be set once the first epoch"):
        setattr(loader, name, value)
    assert getattr(loader, name) == value
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):  # torch's own rule, kept
        loader.batch_size = 2


def test_without_persistent_workers_each_epoch_takes_the_settings_anew():
    loader = hotloop.DataLoader(torch.arange(8), batch_size=4, num_workers=1)
    assert len(list(loader)) == 2
    loader.prefetch_batches = 5
    loader.max_worker_restarts = 0
    assert (loader.prefetch_batches, loader.max_worker_restarts) == (5, 0)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]

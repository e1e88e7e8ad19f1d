"""gpu_decode's batches leave no reference cycles behind: each batch's device memory (the output,
the decode buffers) goes back when the loader is done with it, not at the collector's next pass, and
no cycle of it is left for a worker forked meanwhile to collect (on the H200 three workers blocked
for good there, freeing CUDA memory under the allocator's lock, which another thread held at the
fork). The device path runs on the CPU (fake_cuda), PIL standing in for nvjpeg."""
import gc

import pytest
from torchvision.datasets import ImageFolder

from hotloop.data.ring import copies
from hotloop.data.image import maker as image_maker

from ..seeding import current_seed
from .conftest import open_with
from .image_folders import TRAIN_V1, make_folder
from .stand_in_decoder import GatedDecoder, gpu_decode_loaders

_BATCH_KINDS = (copies.QueuedBatch, image_maker._Prepared, image_maker._Tables)


@pytest.mark.parametrize("broken_off", [False, True], ids=["whole-epochs", "epoch-broken-off"])
def test_no_batch_object_is_left_in_a_cycle(tmp_path, fake_cuda, monkeypatch, broken_off):
    open_with(monkeypatch, GatedDecoder())
    ds = ImageFolder(make_folder(str(tmp_path), n=30), transform=TRAIN_V1(28))
    _, ours = gpu_decode_loaders(ds, current_seed(), batch_size=5, shuffle=True, num_workers=2)
    gc.collect()
    gc.disable()  # what the loops below leave in cycles stays for the look after them
    try:
        for epoch in range(2):
            for i, batch in enumerate(ours):
                if broken_off and epoch == 0 and i == 2:
                    break
        del batch
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds stays in gc.garbage
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if type(o) in _BATCH_KINDS]  # type(): no proxy is called
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []

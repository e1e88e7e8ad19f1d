"""A hotloop.DataLoader made again from its own attributes, as tools do to put a DistributedSampler in
(PyTorch Lightning, for a loader made outside its hooks): every argument that differs from its default
is read back from vars(loader) by name and passed to the class again. torch's attributes hold the
arguments as given; hotloop's extras must too, or the new loader loses its device or refuses its own
gpu_decode value."""
import inspect
import warnings

import pytest
import torch
from torch.utils.data import DistributedSampler
from torchvision.datasets import ImageFolder

import hotloop
from hotloop.data import dataloader

from ..seeding import current_seed
from .conftest import Images, assert_same
from .image_folders import TRAIN_V2, make_folder


def remade(loader, sampler):
    """type(loader)(...) from the loader's public instance attributes that name an argument of its
    __init__ and differ from that argument's default, with `sampler` in place of its own."""
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    params = inspect.signature(type(loader).__init__).parameters
    kwargs = {name: attrs[name] for name, p in params.items() if name in attrs and attrs[name] is not p.default}
    kwargs.update(dataset=loader.dataset, sampler=sampler, shuffle=False, batch_sampler=None)
    return type(loader)(**kwargs)


def test_gpu_decode_survives_being_made_again(tmp_path):
    ds = ImageFolder(make_folder(str(tmp_path), n=14), transform=TRAIN_V2(16))
    loader = hotloop.DataLoader(ds, batch_size=3, num_workers=2, gpu_decode=True)
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "gpu_decode is off" (torch's default_collate taken as a collate_fn given)
        again = remade(loader, sampler)
    direct = hotloop.DataLoader(ds, batch_size=3, num_workers=2, gpu_decode=True, sampler=sampler)
    torch.manual_seed(current_seed())
    got = list(again)
    torch.manual_seed(current_seed())
    want = list(direct)
    assert len(got) == len(want) == 3  # 7 of the 14 images, in batches of 3
    for a, b in zip(got, want, strict=True):
        assert_same(a, b)
    assert again.stats.decoder == direct.stats.decoder is not None  # the image path ran
    assert again.stats.images_cpu_decoded == 7


def test_hotloop_arguments_are_kept(monkeypatch):
    # device="cuda:0" without a GPU: the loader is only made, never iterated
    monkeypatch.setattr(dataloader, "_cuda_device", lambda device: None if device is None else torch.device(device))
    tf = hotloop.Normalize((0.5,), (0.25,))
    with pytest.warns(UserWarning, match="gpu_decode is off"):  # Images is no image folder: it runs as torch would
        loader = hotloop.DataLoader(Images(n=8, size=4), batch_size=2, num_workers=2, device="cuda:0",
                                    prefetch_batches=3, gpu_transform=tf, max_worker_restarts=1, gpu_decode="cpu")
    assert loader.device == torch.device("cuda", 0)  # the property: the device batches go to
    with pytest.warns(UserWarning, match="gpu_decode is off"):
        again = remade(loader, DistributedSampler(loader.dataset, num_replicas=2, rank=0))
    assert again.device == torch.device("cuda", 0)
    assert (again.prefetch_batches, again.gpu_transform, again.max_worker_restarts) == (3, tf, 1)
    assert again.gpu_decode.backend == "cpu"
    loader.device = torch.device("cuda", 1)  # set later: what a loader made again takes too
    with pytest.warns(UserWarning, match="gpu_decode is off"):
        assert remade(loader, None).device == torch.device("cuda", 1)

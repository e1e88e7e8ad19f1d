"""Folders of JPEGs for the gpu_decode tests, the torchvision pipelines gpu_decode reads, and our batches
against torch's within a level of 255."""
import os

import numpy as np
import torch
import torchvision.transforms as v1
import torchvision.transforms.v2 as v2
from PIL import Image

from ..seeding import current_seed, derived_seed

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
LEVEL = 1 / 255 / min(STD) + 1e-5  # one level of 255, normalised


def make_photo(rng, h, w):
    """Smooth content with some noise: compresses like a photo, not like white noise."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = [np.sin(x / rng.uniform(5, 30) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(5, 30)) for _ in range(3)]
    img = np.stack(base, -1) * 100 + 128 + rng.normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def make_folder(root, n=24, classes=3, seed=None, sizes=(40, 140), extra=()):
    """An ImageFolder of JPEGs (plus `extra`: (name, bytes) files in class 0)."""
    rng = np.random.default_rng(derived_seed() if seed is None else seed)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"c{c}"), exist_ok=True)
    for i in range(n):
        h, w = (int(v) for v in rng.integers(*sizes, size=2))
        make_photo(rng, h, w).save(os.path.join(root, f"c{i % classes}", f"{i:04d}.jpg"), quality=90)
    for name, data in extra:
        with open(os.path.join(root, "c0", name), "wb") as f:
            f.write(data)
    return root


TRAIN_V1 = lambda size: v1.Compose([v1.RandomResizedCrop(size), v1.RandomHorizontalFlip(), v1.ToTensor(),
                                    v1.Normalize(MEAN, STD)])
TRAIN_V2 = lambda size: v2.Compose([v2.ToImage(), v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(),
                                    v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
EVAL_V1 = lambda size: v1.Compose([v1.Resize(size + size // 7), v1.CenterCrop(size), v1.ToTensor(), v1.Normalize(MEAN, STD)])
EVAL_V2 = lambda size: v2.Compose([v2.Resize(size + size // 7), v2.CenterCrop(size), v2.PILToTensor(),
                                   v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def seeded_batches(loader, seed=None):
    """The loader's batches, cloned, drawn under `seed` (the test's seed by default): with num_workers=0
    the transform draws from the main process's generator."""
    torch.manual_seed(current_seed() if seed is None else seed)
    return [(x.clone(), y.clone()) for x, y in loader]


def assert_batches_close(ours, theirs, levels=1):
    """Every element within `levels` levels of 255 (normalised): 1 against Pillow's resize, which the
    kernel's arithmetic is; 2 against torch's uint8 tensor resize (v2 pipelines that resize after
    ToImage), whose fixed point differs from Pillow's by a level at times, and ours from it by one."""
    assert len(ours) == len(theirs)
    for (x, y), (tx, ty) in zip(ours, theirs, strict=True):
        assert torch.equal(y, ty)
        assert x.shape == tx.shape and x.dtype == tx.dtype
        diff = (x.float() - tx.float()).abs().max().item()
        assert diff <= levels * LEVEL, f"max difference {diff} > {levels} level(s) ({levels * LEVEL})"

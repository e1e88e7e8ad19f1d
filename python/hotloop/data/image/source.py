"""The worker's half of gpu_decode: a sample is its file's bytes and where its output comes from.

`ImageSource.of(dataset)` recognises a dataset whose images hotloop can decode itself: a torchvision
DatasetFolder / ImageFolder with the default image loader, or a hotloop.EncodedImageDataset. In the
workers `EncodedSamples` stands in for the dataset: per index it reads the encoded bytes and the JPEG
header (a few microseconds), draws the transform's random parameters as the transform would
(plan.py), and returns a record; `collate_encoded` packs a batch of records into three tensors
(a table, the bytes, and finished images) that fit the ring. The main process decodes and resizes
(stage.py).

Per sample, what the GPU path cannot take falls back, in the worker, to the CPU: a file that is not
a baseline JPEG the decoder takes (PNG, CMYK, progressive on the hardware decoder, a truncated file)
is opened by the dataset's own loader, so PIL raises what it raises for the CPU pipeline (naming the
file), and its pixels, crop box only, go to the GPU kernel; an image the geometry cannot express
(a CenterCrop larger than the image, which pads) runs the whole transform here.
"""
import io

import numpy as np
import torch

from ... import _C
from ..._torch_compat import default_collate
from .plan import NeedsCpu

MARKER = "hotloop_encoded_images"  # key of the table in a packed batch: how the main process knows one

# what a table row's kind says its bytes are
ENCODED, PIXELS, DONE = 0, 1, 2
# table columns
COLUMNS = ("kind", "offset", "length", "src_h", "src_w", "channels", "box_top", "box_left", "box_h", "box_w",
           "resized_h", "resized_w", "out_top", "out_left", "flip", "index")
_COL = {name: k for k, name in enumerate(COLUMNS)}


class EncodedImageDataset(torch.utils.data.Dataset):
    """A dataset of encoded images from anywhere (tar shards, LMDB, a list of byte strings) that
    hotloop.DataLoader(..., gpu_decode=True) decodes on the GPU.

    `fetch(index) -> (bytes, target)` returns an image file's bytes and its target. Used on its own
    (or with torch's DataLoader) it is the CPU pipeline: PIL decodes, converts to RGB as ImageFolder
    does, then `transform` and `target_transform` apply. With gpu_decode, the same transform runs as
    one GPU kernel when it is one hotloop recognises (see hotloop.GpuDecode).
    """

    def __init__(self, fetch, length, transform=None, target_transform=None):
        if not callable(fetch):
            raise TypeError(f"EncodedImageDataset: expected fetch to be callable, got {type(fetch).__name__}")
        self.fetch = fetch
        self.length = int(length)
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self):
        return self.length

    def load(self, data, index):
        from PIL import Image
        return Image.open(io.BytesIO(data)).convert("RGB")

    def __getitem__(self, index):
        data, target = self.fetch(index)
        image = self.load(data, index)
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class ImageSource:
    """How to read one sample's bytes and how the CPU pipeline opens them, for a recognised dataset."""

    def __init__(self, dataset, read, load):
        self.dataset = dataset
        self.read = read  # index -> (bytes, target)
        self.load = load  # (bytes, index) -> RGB PIL image, raising as the CPU pipeline would
        self.transform = dataset.transform
        self.target_transform = dataset.target_transform

    @classmethod
    def of(cls, dataset):
        """The source of a dataset hotloop can decode itself, or None (with the reason) if not."""
        if isinstance(dataset, EncodedImageDataset):
            return cls(dataset, dataset.fetch, dataset.load), None
        try:
            from torchvision.datasets import DatasetFolder
            from torchvision.datasets.folder import default_loader, pil_loader
            from torchvision import get_image_backend
        except ImportError:
            return None, "torchvision is not installed"
        if not isinstance(dataset, DatasetFolder):
            return None, f"{type(dataset).__name__} is neither a torchvision DatasetFolder nor a hotloop.EncodedImageDataset"
        if type(dataset).__getitem__ is not DatasetFolder.__getitem__:
            return None, f"{type(dataset).__name__} has its own __getitem__"
        if dataset.loader not in (default_loader, pil_loader) or \
                (dataset.loader is default_loader and get_image_backend() != "PIL"):
            return None, "its loader is not torchvision's default PIL loader"

        def read(index):
            path, target = dataset.samples[index]
            with open(path, "rb") as f:
                return f.read(), target

        def load(data, index):
            from PIL import Image
            try:  # the bytes already read: pil_loader's own steps, without reading the file again
                return Image.open(io.BytesIO(data)).convert("RGB")
            except Exception:
                return dataset.loader(dataset.samples[index][0])  # PIL's own error, naming the file

        return cls(dataset, read, load), None


class EncodedSamples(torch.utils.data.Dataset):
    """What the workers index instead of the dataset: records for collate_encoded. `gpu_jpeg` says
    whether JPEG bytes go to the GPU (a decoder runs there) or are decoded here (the CPU backend);
    `progressive` whether that decoder takes progressive JPEGs."""

    def __init__(self, source, plan, gpu_jpeg, progressive, capacity):
        self.source, self.plan = source, plan
        self.gpu_jpeg, self.progressive = gpu_jpeg, progressive
        self.capacity = capacity  # bytes the first batch's data tensor reserves in the ring

    def __len__(self):
        return len(self.source.dataset)

    def _to_gpu(self, data) -> tuple:
        """(height, width, channels) when the GPU decoder takes these bytes, else None."""
        if not self.gpu_jpeg:
            return None
        try:
            header = _C.jpeg_header(data)
        except ValueError:
            return None  # a corrupt header: PIL says what is wrong, as in the CPU pipeline
        if header is None:
            return None
        height, width, components, process, adobe_transform, ends_with_eoi = header
        if not ends_with_eoi or components not in (1, 3) or height <= 0 or width <= 0:
            return None
        if process not in (0, 1) and not (process == 2 and self.progressive):
            return None
        if components == 3 and adobe_transform == 0:
            return None  # RGB-coded, not YCbCr: PIL's reading of it is the reference
        return height, width, components

    def __getitem__(self, index):
        source, plan = self.source, self.plan
        data, target = source.read(index)
        if source.target_transform is not None:
            target = source.target_transform(target)
        before = torch.get_rng_state()
        gpu = self._to_gpu(data)
        image = None
        if gpu is None:
            image = source.load(data, index)
        height, width = gpu[:2] if gpu is not None else (image.height, image.width)
        try:
            geo = plan.draw(height, width)
        except NeedsCpu:
            torch.set_rng_state(before)  # the transform draws again, from where draw() started
            if image is None:
                image = source.load(data, index)
            return (DONE, source.transform(image), None, target, index)
        if gpu is not None:
            return (ENCODED, data, (height, width, gpu[2], geo), target, index)
        # only the crop box travels: the kernel resizes it as it would the whole image's box
        box = image.crop((geo.box_left, geo.box_top, geo.box_left + geo.box_w, geo.box_top + geo.box_h))
        pixels = np.asarray(box, dtype=np.uint8)
        geo.box_top = geo.box_left = 0
        return (PIXELS, pixels, (geo.box_h, geo.box_w, 3, geo), target, index)


def collate_encoded(records, capacity=0):
    """[{MARKER: table int64 [n, len(COLUMNS)], "data": uint8 bytes, "done": finished images}, targets]."""
    table = torch.zeros((len(records), len(COLUMNS)), dtype=torch.int64)
    rows = table.numpy()
    total = sum(len(r[1]) if r[0] == ENCODED else r[1].nbytes for r in records if r[0] != DONE)
    data = torch.empty(max(total, capacity), dtype=torch.uint8)
    flat = data.numpy()
    done, offset = [], 0
    for k, (kind, payload, shape, _, index) in enumerate(records):
        row = rows[k]
        row[_COL["kind"]], row[_COL["index"]] = kind, index
        if kind == DONE:
            row[_COL["offset"]] = len(done)
            done.append(payload)
            continue
        raw = np.frombuffer(payload, dtype=np.uint8) if kind == ENCODED else payload.reshape(-1)
        flat[offset:offset + raw.size] = raw
        height, width, channels, geo = shape
        row[_COL["offset"]], row[_COL["length"]] = offset, raw.size
        row[_COL["src_h"]], row[_COL["src_w"]], row[_COL["channels"]] = height, width, channels
        row[_COL["box_top"]:_COL["flip"] + 1] = (geo.box_top, geo.box_left, geo.box_h, geo.box_w, geo.resized_h,
                                                  geo.resized_w, geo.out_top, geo.out_left, geo.flip)
        offset += raw.size
    done_t = torch.stack(done) if done else torch.empty(0)
    targets = default_collate([r[3] for r in records])
    return [{MARKER: table, "data": data, "done": done_t}, targets]


def column(name) -> int:
    return _COL[name]

"""The worker's half of gpu_decode: a sample is its file's bytes and where its output comes from.

`ImageSource.of(dataset)` recognises a dataset whose images hotloop can decode itself: a torchvision
DatasetFolder / ImageFolder with the default image loader, or a hotloop.EncodedImageDataset. In the
workers `EncodedSamples` stands in for the dataset: per index it reads the encoded bytes and the JPEG
header (a few microseconds), draws the transform's random parameters as the transform would
(plan.py), and returns a record; `collate_encoded` packs a batch of records into three tensors
(a table, the bytes, and finished images) that fit the ring. The main process decodes and resizes
(maker.py); with worker processes and GpuDecode(worker_decode=True), the workers decode a share of
the JPEGs themselves (NOTE [ Two pools for one batch ] in split.py).

Per sample, what the GPU path cannot take falls back, in the worker, to the CPU: a file that is not
a baseline JPEG the decoder takes (PNG, CMYK, progressive on the hardware decoder, a truncated file)
is opened by the dataset's own loader, so PIL raises what it raises for the CPU pipeline (naming the
file), and its pixels, crop box only, go to the GPU kernel; an image the geometry cannot express
(a CenterCrop larger than the image, which pads) runs the whole transform here. Where the workers
decode a JPEG whose crop box is much larger than the output, they decode it at a DCT scale and
resize it themselves (NOTE [ Decoding at a DCT scale ]).
"""
import io
import math
import time

import numpy as np
import torch

from ... import _C
from ..._torch_compat import default_collate
from .plan import NeedsCpu
from .split import ShareTaker

MARKER = "hotloop_encoded_images"  # key of the table in a packed batch: how the main process knows one

# what a table row's kind says its bytes are
ENCODED, PIXELS, DONE = 0, 1, 2
# NOTE [ Decoding at a DCT scale ]
# libjpeg(-turbo), under Pillow, decodes a JPEG at 1/2, 1/4 or 1/8 of its size in the DCT domain
# (Image.draft), several times cheaper than a full decode for a large photo. Its pixel i covers the
# full image's [i * s, (i + 1) * s), so a crop box lands on fractional coordinates, which the
# kernel's integer box cannot hold: rounding the box to whole scaled pixels shifts the output by up
# to half a scaled pixel, tens of levels off torchvision's at edges. So the worker resizes the
# scaled crop itself, with Pillow's bilinear resize (the kernel's arithmetic) on the exact
# fractional box, and ships only the output window; the kernel then copies, flips and normalises it.
# The scaled pixels are a low-pass of each 8 x 8 block, not the full decode's: the larger the
# scaled crop is against the resized size, the more of the difference the bilinear filter removes.
# A scale is taken only where the scaled crop is at least DRAFT_MARGIN times the resized size in
# each dimension (DRAFT_MARGIN_INSIDE where the box has an edge inside the image, as most of
# RandomResizedCrop's do: there the scaled pixels straddling the edge mix in pixels torchvision
# crops away). tests/data/test_image_draft.py holds the result to the bounds the GPU decoders are
# held to against the CPU pipeline. Only JPEGs PIL decodes to RGB or L take it; CMYK, PNG and the
# rest decode whole, as before, and any failure of the scaled decode falls back to the dataset's own
# loader, which decodes as PIL would or raises PIL's error naming the file.
DRAFT_SCALES = (8, 4, 2)
DRAFT_MARGIN = 2.0
DRAFT_MARGIN_INSIDE = 3.0
_SCALABLE_MODES = ("RGB", "L")  # what PIL decodes a YCbCr or grey JPEG to
# table columns
# worker_us: the worker's time on the sample; split: a JPEG the GPU decoder takes, decoded by the worker
# (NOTE [ Two pools for one batch ] in split.py)
COLUMNS = ("kind", "offset", "length", "src_h", "src_w", "channels", "box_top", "box_left", "box_h", "box_w",
           "resized_h", "resized_w", "out_top", "out_left", "flip", "index", "worker_us", "split")
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

    def __init__(self, dataset, read, load, pil_open):
        self.dataset = dataset
        self.read = read  # index -> (bytes, target)
        self.load = load  # (bytes, index) -> RGB PIL image, raising as the CPU pipeline would
        self.pil_open = pil_open  # whether load is Image.open(bytes).convert("RGB"): a scaled decode may stand in
        self.transform = dataset.transform
        self.target_transform = dataset.target_transform

    @classmethod
    def of(cls, dataset):
        """The source of a dataset hotloop can decode itself, or None (with the reason) if not."""
        if isinstance(dataset, EncodedImageDataset):
            return cls(dataset, dataset.fetch, dataset.load, type(dataset).load is EncodedImageDataset.load), None
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

        return cls(dataset, read, load, True), None


class EncodedSamples(torch.utils.data.Dataset):
    """What the workers index instead of the dataset: records for collate_encoded. `gpu_jpeg` says
    whether JPEG bytes go to the GPU (a decoder runs there) or are decoded here (the CPU backend);
    `progressive` whether that decoder takes progressive JPEGs; `share` (split.DecodeShare, or None)
    the share of the GPU's JPEGs decoded here instead."""

    def __init__(self, source, plan, gpu_jpeg, progressive, capacity, share=None):
        self.source, self.plan = source, plan
        self.gpu_jpeg, self.progressive = gpu_jpeg, progressive
        self.capacity = capacity  # bytes the first batch's data tensor reserves in the ring
        self.taker = ShareTaker(share) if share is not None and gpu_jpeg else None

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
        started = time.perf_counter()
        kind, payload, shape, target, split = self._sample(index)
        return kind, payload, shape, target, index, time.perf_counter() - started, split

    def _sample(self, index):
        """(kind, payload, shape, target, split) of one sample: collate_encoded's record, less the index and time."""
        source, plan = self.source, self.plan
        data, target = source.read(index)
        if source.target_transform is not None:
            target = source.target_transform(target)
        before = torch.get_rng_state()
        gpu = self._to_gpu(data)
        split = gpu is not None and self.taker is not None and self.taker.decode_here()
        if split:
            gpu = None  # decoded here, as the CPU backend would
        image = opened = None
        if gpu is None:
            opened = _scalable_jpeg(data) if source.pil_open else None
            image = source.load(data, index) if opened is None else None
        height, width = gpu[:2] if gpu is not None else (image if image is not None else opened).size[::-1]
        try:
            geo = plan.draw(height, width)
        except NeedsCpu:
            torch.set_rng_state(before)  # the transform draws again, from where draw() started
            if image is None:
                image = source.load(data, index)
            return (DONE, source.transform(image), None, target, False)
        if gpu is not None:
            return (ENCODED, data, (height, width, gpu[2], geo), target, False)
        if opened is not None:
            scale = draft_scale(geo, height, width)
            window = _scaled_window(opened, geo, scale, plan.out_size) if scale > 1 else None
            if window is not None:
                return (PIXELS, window, (window.shape[0], window.shape[1], 3, _window_geometry(window, geo)),
                        target, split)
            image = _whole(opened) if scale == 1 else None  # opened as load opens it: not parsed again
            if image is None:
                image = source.load(data, index)  # PIL's own decode, or its error naming the file
        # only the crop box travels: the kernel resizes it as it would the whole image's box
        box = image.crop((geo.box_left, geo.box_top, geo.box_left + geo.box_w, geo.box_top + geo.box_h))
        pixels = np.asarray(box, dtype=np.uint8)
        geo.box_top = geo.box_left = 0
        return (PIXELS, pixels, (geo.box_h, geo.box_w, 3, geo), target, split)


def _scalable_jpeg(data):
    """The file opened by PIL (its header read, no pixels) when it is a JPEG PIL decodes to RGB or
    grey, which a scaled decode may stand in for; else None (the dataset's loader opens it)."""
    from PIL import Image
    try:
        opened = Image.open(io.BytesIO(data))
    except Exception:
        return None  # not an image PIL knows: the loader raises its error, naming the file
    return opened if _scalable(opened) else None


def _whole(opened):
    """The opened JPEG decoded whole, as source.load would (Image.open(bytes).convert("RGB")); None where
    that fails, so that the dataset's own loader raises its error, naming the file."""
    try:
        return opened.convert("RGB")
    except Exception:
        return None


def _scalable(opened) -> bool:
    return opened.format in ("JPEG", "MPO") and opened.mode in _SCALABLE_MODES and len(opened.tile) == 1


def shipped_pixel_bytes(path, plan) -> int:
    """The bytes a worker decoding `path` itself ships for it under `plan`: the output window where
    it decodes at a DCT scale, else the crop box; none where the transform runs here (its output
    travels in the batch's "done" tensor).
    The box is drawn from torch's generator, as the worker draws it: a caller that must keep its own
    draws forks the generator around its calls."""
    from PIL import Image
    with Image.open(path) as opened:
        width, height = opened.size
        scalable = _scalable(opened)
    try:
        geo = plan.draw(height, width)
    except NeedsCpu:
        return 0
    if scalable and draft_scale(geo, height, width) > 1:
        return plan.out_size[0] * plan.out_size[1] * 3
    return geo.box_h * geo.box_w * 3


def draft_scale(geo, height, width) -> int:
    """The largest DCT scale (8, 4, 2, else 1: none) at which the crop box still has DRAFT_MARGIN
    (or DRAFT_MARGIN_INSIDE) times the resized size's pixels in each dimension (NOTE [ Decoding at a
    DCT scale ]). The box is the full image's, drawn before any scaling."""
    margin_h = DRAFT_MARGIN if geo.box_h == height else DRAFT_MARGIN_INSIDE
    margin_w = DRAFT_MARGIN if geo.box_w == width else DRAFT_MARGIN_INSIDE
    for scale in DRAFT_SCALES:
        if geo.box_h >= scale * margin_h * geo.resized_h and geo.box_w >= scale * margin_w * geo.resized_w:
            return scale
    return 1


def _scaled_window(opened, geo, scale, out_size):
    """The output window of the resized crop, uint8 [h, w, 3], from a decode at 1/scale; None where
    the scaled decode fails or PIL did not take that scale (the caller decodes whole, as before)."""
    from PIL import Image
    width, height = opened.size
    try:
        opened.draft(opened.mode, (width // scale, height // scale))  # PIL picks the largest scale that fits
        if opened.size != (-(-width // scale), -(-height // scale)):
            return None
        opened.load()
    except Exception:
        return None  # truncated, corrupt: the loader's full decode says what PIL says, naming the file
    # the box in scaled pixels (fractional), and the whole scaled pixels that hold it
    top, left = geo.box_top / scale, geo.box_left / scale
    bottom, right = (geo.box_top + geo.box_h) / scale, (geo.box_left + geo.box_w) / scale
    held = (math.floor(left), math.floor(top),
            min(math.ceil(right), opened.width), min(math.ceil(bottom), opened.height))
    # the window [out_top, +out_h) x [out_left, +out_w) of the box resized to (resized_h, resized_w)
    per_row, per_col = (bottom - top) / geo.resized_h, (right - left) / geo.resized_w
    y0, x0 = top - held[1] + geo.out_top * per_row, left - held[0] + geo.out_left * per_col
    out_h, out_w = out_size
    crop = opened.crop(held).resize((out_w, out_h), Image.Resampling.BILINEAR,
                                    box=(x0, y0, x0 + out_w * per_col, y0 + out_h * per_row))
    return np.asarray(crop.convert("RGB") if crop.mode != "RGB" else crop, dtype=np.uint8)


def _window_geometry(window, geo):
    """The kernel's entry for a shipped window: no crop, no resize, the draw's flip."""
    h, w = window.shape[:2]
    geo.box_top = geo.box_left = geo.out_top = geo.out_left = 0
    geo.box_h, geo.resized_h, geo.box_w, geo.resized_w = h, h, w, w
    return geo


def collate_encoded(records, capacity=0):
    """[{MARKER: table int64 [n, len(COLUMNS)], "data": uint8 bytes, "done": finished images}, targets]."""
    table = torch.zeros((len(records), len(COLUMNS)), dtype=torch.int64)
    rows = table.numpy()
    total = sum(len(r[1]) if r[0] == ENCODED else r[1].nbytes for r in records if r[0] != DONE)
    data = torch.empty(max(total, capacity), dtype=torch.uint8)
    flat = data.numpy()
    done, offset = [], 0
    for k, (kind, payload, shape, _, index, seconds, split) in enumerate(records):
        row = rows[k]
        row[_COL["kind"]], row[_COL["index"]] = kind, index
        row[_COL["worker_us"]], row[_COL["split"]] = round(seconds * 1e6), split
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

"""The fused crop-resize-flip-normalise of a batch of differently sized uint8 images, and its entry table.

One entry per image (kernels/image_resize.h's hl_image_entry, _C.IMAGE_ENTRY_BYTES bytes) says where
the decoded pixels are, the box cropped from them, the size the crop is resized to, the window of
the resized crop written out and whether it is mirrored. One call fills a whole [N, 3, H, W] batch:
one CUDA kernel for a CUDA batch, the C reference for a CPU one. The resize is torchvision's
resized_crop(..., antialias=True) in Pillow's arithmetic (horizontal pass rounded to uint8, then the
vertical one), so it equals Pillow's crop + resize(BILINEAR) and is within one level of torchvision;
a float batch then holds ((q / scale) - mean) / std in float32 (ToTensor, then Normalize).
"""
import struct
from typing import NamedTuple

import torch

from ... import _C

_ENTRY = struct.Struct("<Qq12i")
if _ENTRY.size != _C.IMAGE_ENTRY_BYTES:
    raise ImportError(f"hotloop._C's image entry is {_C.IMAGE_ENTRY_BYTES} bytes, resize.py packs {_ENTRY.size}")


class ImageEntry(NamedTuple):
    """One image of a batch, as the kernel reads it (the field order is the packed order)."""

    src: int  # address of pixel (0, 0): device memory for a CUDA batch, host memory for a CPU one
    src_pitch: int  # bytes between rows
    src_h: int
    src_w: int
    box_top: int  # the crop, inside the image
    box_left: int
    box_h: int
    box_w: int
    resized_h: int  # the crop is resized to this
    resized_w: int
    out_top: int = 0  # corner, in the resized crop, of the batch-sized window written out
    out_left: int = 0
    flip: int = 0  # 1: the window mirrored left-right
    channels: int = 3  # 3 (RGB) or 1 (grey, replicated into R, G and B)


def pack_entries(rows) -> bytes:
    """ImageEntry rows (or tuples in its field order) -> the table image_resize takes."""
    rows = list(rows)
    table = bytearray(len(rows) * _ENTRY.size)
    for i, row in enumerate(rows):
        try:
            _ENTRY.pack_into(table, i * _ENTRY.size, *row)
        except struct.error as err:
            raise ValueError(f"pack_entries: entry {i} ({row!r}): {err}") from None
    return bytes(table)


def image_entry(image: torch.Tensor, box, resized, offset=(0, 0), flip=False) -> ImageEntry:
    """The entry of a uint8 [h, w, c] tensor (c 1 or 3; its rows may be padded: any stride(0) >=
    w * c, with stride(1) == c and stride(2) == 1). box: (top, left, height, width) of the crop;
    resized: (height, width) the crop is resized to; offset: (top, left) of the window in it."""
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] not in (1, 3):
        raise ValueError(f"image_entry: expected a uint8 [h, w, 1 or 3] tensor, got {image.dtype} {tuple(image.shape)}")
    h, w, c = image.shape
    if image.stride(2) != 1 or image.stride(1) != c or image.stride(0) < w * c:
        raise ValueError(f"image_entry: expected interleaved rows (strides [>= {w * c}, {c}, 1]), got {image.stride()}")
    top, left, box_h, box_w = box
    return ImageEntry(image.data_ptr(), image.stride(0), h, w, top, left, box_h, box_w, resized[0], resized[1],
                      offset[0], offset[1], int(bool(flip)), c)


def empty_batch(count, size, dtype, device, channels_last):
    """(the [count, 3, h, w] batch, its memory in the kernel's order): channels_last memory is [count, h, w, 3]."""
    h, w = size
    if channels_last:
        mem = torch.empty((count, h, w, 3), dtype=dtype, device=device)
        return mem.permute(0, 3, 1, 2), mem
    mem = torch.empty((count, 3, h, w), dtype=dtype, device=device)
    return mem, mem


def resize_batch(table, count, out_mem, channels_last, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), scale=255.0,
                 stream=0, table_dev=None, table_host=None):
    """Fill out_mem (empty_batch's memory) from the first `count` entries of `table` (pack_entries).

    A CUDA batch: the table is copied to `table_dev` (uint8 on out_mem's device, at least count *
    _C.IMAGE_ENTRY_BYTES bytes) on `stream` (an int handle) and one kernel runs there; nothing waits
    for it, and table_dev and the images must outlive it (allocate them for that stream). A CPU
    batch: the C reference, here and now. table_host: page-locked host memory of as many bytes the
    table goes through, unchanged until `stream` passed the upload (None: from pageable memory, which
    may wait for the stream)."""
    _C.image_resize(table=table, count=count, table_dev=table_dev, out=out_mem, channels_last=channels_last, mean=mean,
                    std=std, scale=scale, stream=stream, table_host=table_host)


def resize_images(images, boxes, size, *, resized=None, offsets=None, flips=None, dtype=torch.uint8,
                  channels_last=False, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), scale=255.0):
    """uint8 [h, w, c] images (all on one device) -> a [n, 3, size[0], size[1]] batch of `dtype`.

    Image i's box (top, left, height, width) is resized to resized[i] (default: size) and the window
    at offsets[i] (default (0, 0)) written out, mirrored where flips[i]. On CPU tensors this is the C
    reference; on CUDA tensors the kernel, on the current stream. For tests and one-off use: a
    loader packs its entries and calls resize_batch."""
    n = len(images)
    resized = resized if resized is not None else [tuple(size)] * n
    offsets = offsets if offsets is not None else [(0, 0)] * n
    flips = flips if flips is not None else [False] * n
    device = images[0].device if n else torch.device("cpu")
    if any(img.device != device for img in images):
        raise ValueError("resize_images: expected every image on one device")
    rows = [image_entry(images[i], boxes[i], resized[i], offsets[i], flips[i]) for i in range(n)]
    out, mem = empty_batch(n, size, dtype, device, channels_last)
    if device.type == "cuda":
        table_dev = torch.empty(max(n, 1) * _C.IMAGE_ENTRY_BYTES, dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
    else:
        table_dev, stream = None, 0
    resize_batch(pack_entries(rows), n, mem, channels_last, mean, std, scale, stream, table_dev)
    return out

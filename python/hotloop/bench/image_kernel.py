"""Benchmark rows for the image batch kernel (part of the images component, hotloop/bench/images.py): crop, resize, flip and normalise a batch of differently sized
images in one call, against torch's per-image interpolate(antialias=True) and a normalise."""
import math

from .. import _C
from ..data.image.resize import empty_batch, image_entry, pack_entries, resize_batch
from .harness import Row

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def random_resized_crop_box(torch, g, h, w):
    """a box as torchvision's RandomResizedCrop draws it (area 8-100 %, aspect 3/4-4/3), else the whole image"""
    for _ in range(10):
        area = h * w * float(torch.empty(()).uniform_(0.08, 1.0, generator=g))
        ratio = math.exp(float(torch.empty(()).uniform_(math.log(3 / 4), math.log(4 / 3), generator=g)))
        bw, bh = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
        if 0 < bw <= w and 0 < bh <= h:
            return (int(torch.randint(0, h - bh + 1, (), generator=g)), int(torch.randint(0, w - bw + 1, (), generator=g)),
                    bh, bw)
    return 0, 0, h, w


def rows(ctx):
    torch = ctx.torch
    g = torch.Generator().manual_seed(0)
    n, side, size = (8, 64, 32) if (ctx.quick or not ctx.is_cuda) else (256, 500, 224)
    dtype = torch.float16 if ctx.is_cuda else torch.float32
    images, boxes = [], []
    for i in range(n):  # ImageNet-like: ~4:3, a third of them portrait
        h = side * 3 // 4 + int(torch.randint(-side // 12, side // 12 + 1, (), generator=g))
        w = side + int(torch.randint(-side // 8, side // 8 + 1, (), generator=g))
        h, w = (w, h) if i % 3 == 0 else (h, w)
        images.append(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g).to(ctx.device))
        boxes.append(random_resized_crop_box(torch, g, h, w))
    flips = [i % 2 for i in range(n)]
    table = pack_entries(image_entry(images[i], boxes[i], (size, size), flip=flips[i]) for i in range(n))
    out, mem = empty_batch(n, (size, size), dtype, ctx.device, True)
    table_dev = torch.empty(n * _C.IMAGE_ENTRY_BYTES, dtype=torch.uint8, device=ctx.device) if ctx.is_cuda else None
    stream = torch.cuda.current_stream(ctx.device).cuda_stream if ctx.is_cuda else 0
    mean = torch.tensor(MEAN, device=ctx.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=ctx.device).view(1, 3, 1, 1)

    def ours():
        resize_batch(table, n, mem, True, MEAN, STD, 255.0, stream, table_dev)

    def theirs():
        crops = []
        for img, (top, left, bh, bw), flip in zip(images, boxes, flips):
            x = img[top:top + bh, left:left + bw].permute(2, 0, 1).unsqueeze(0).float()
            x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True)
            crops.append(x.flip(-1) if flip else x)
        x = torch.cat(crops).div_(255).sub_(mean).div_(std).to(dtype)
        return x.contiguous(memory_format=torch.channels_last)

    ms, torch_ms = ctx.compare(ours, theirs)
    what = f"{n} images ~{side}x{side * 3 // 4}, RandomResizedCrop({size}) + flip + normalise, {str(dtype)[6:]} NHWC"
    yield Row("images", what, ms, torch_ms, "ms", note="torch: interpolate(antialias=True) per image, then normalise")
    yield Row("images", "images per second", n / (ms * 1e-3), n / (torch_ms * 1e-3), "img/s")

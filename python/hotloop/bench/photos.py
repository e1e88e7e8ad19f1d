"""A folder of ImageNet-like files made from real photographs: random crops of the photos scikit-image ships,
resized to ImageNet's sizes and saved with ImageNet's mix of JPEG kinds, for benchmarks on realistic data.

Synthetic pictures (smooth waves plus noise) decode faster than photographs, all come in one JPEG kind
and one size band, and so flatter a decoder. What a photograph brings instead: real texture (the
entropy decoder's work), ImageNet's spread of sizes (about 500 x 375, up to ~1,900 px), and the odd
files a real folder holds: 4:4:4 chroma, grayscale, CMYK, and PNGs named .JPEG. Each file is a
different crop, scale, flip and tone of one of the photos, so no two files are alike and a page
cache or a decoder never sees the same bitstream twice.

No network: the photos are scikit-image's package data (`pip install scikit-image`), or any folder of
pictures named by HOTLOOP_PHOTOS.
"""
import importlib.util
import io
import multiprocessing
import os
import pathlib
import typing

import numpy as np

# scikit-image's photographs (not its charts, text or micrographs), colour and grey
COLOUR_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg", "motorcycle_left.png",
                 "motorcycle_right.png", "retina.jpg", "rocket.jpg", "ihc.png")
GREY_PHOTOS = ("camera.png", "moon.png", "coins.png", "clock_motion.png", "brick.png", "grass.png", "gravel.png")


class Mix(typing.NamedTuple):
    """The share of each kind of file, as in ImageNet's training set; the rest are 4:2:0 colour JPEGs."""
    yuv444: float = 0.05
    grey: float = 0.01
    cmyk: float = 0.003
    png: float = 0.002


IMAGENET_MIX = Mix()


def photo_folder() -> pathlib.Path:
    """HOTLOOP_PHOTOS, else scikit-image's data folder (found without importing scikit-image)."""
    chosen = os.environ.get("HOTLOOP_PHOTOS")
    if chosen:
        return pathlib.Path(chosen)
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("realistic images are made from photographs that scikit-image ships: "
                           "`pip install scikit-image`, or set HOTLOOP_PHOTOS to a folder of pictures")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "data"


def source_photos(folder=None) -> typing.Tuple[list, list]:
    """(colour photos, grey photos): paths that exist. In a HOTLOOP_PHOTOS folder every picture counts
    as colour, and grey ones are made from them."""
    folder = pathlib.Path(folder or photo_folder())
    if os.environ.get("HOTLOOP_PHOTOS") and folder == pathlib.Path(os.environ["HOTLOOP_PHOTOS"]):
        colour = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
        grey = []
    else:
        colour = [folder / n for n in COLOUR_PHOTOS if (folder / n).is_file()]
        grey = [folder / n for n in GREY_PHOTOS if (folder / n).is_file()]
    if not colour:
        raise RuntimeError(f"no photographs found in {folder}")
    return colour, grey


def imagenet_size(rng) -> typing.Tuple[int, int]:
    """(width, height) drawn like ImageNet's: most pictures 500 px on the long side (500 x 375 or
    500 x 333), a quarter of other sizes up to 1,931 px; one in seven in portrait."""
    if rng.random() < 0.75:
        long_side = 500
        short = int(rng.choice([375, 333, int(rng.integers(280, 500))], p=[0.6, 0.25, 0.15]))
    else:
        long_side = int(np.clip(rng.lognormal(np.log(620), 0.35), 200, 1931))
        short = int(long_side * rng.uniform(0.6, 0.9))
    return (short, long_side) if rng.random() < 0.15 else (long_side, short)


class FileKind(typing.NamedTuple):
    mode: str  # PIL mode saved: "RGB", "L", "CMYK"
    subsampling: int  # PIL's: 0 is 4:4:4, 2 is 4:2:0
    png: bool  # PNG bytes under a .JPEG name


def file_kind(rng, mix: Mix) -> FileKind:
    u = rng.random()
    for share, kind in ((mix.png, FileKind("RGB", 2, True)), (mix.cmyk, FileKind("CMYK", 2, False)),
                        (mix.grey, FileKind("L", 2, False)), (mix.yuv444, FileKind("RGB", 0, False))):
        if u < share:
            return kind
        u -= share
    return FileKind("RGB", 2, False)


def _load(path, cache):
    from PIL import Image

    if path not in cache:
        with Image.open(path) as im:
            cache[path] = im.convert("RGB")
    return cache[path]


def make_picture(rng, colour, grey, mix: Mix, cache) -> typing.Tuple[bytes, FileKind, typing.Tuple[int, int]]:
    """One file's bytes: a random crop of a photo, resized to an ImageNet size, toned and saved."""
    from PIL import Image, ImageEnhance

    kind = file_kind(rng, mix)
    sources = grey if kind.mode == "L" and grey else colour
    photo = _load(sources[int(rng.integers(len(sources)))], cache)
    size = imagenet_size(rng)
    # a crop of 35-100 % of the photo's side, with the target's aspect ratio where the photo allows
    aspect = size[0] / size[1]
    scale = rng.uniform(0.35, 1.0)
    w = min(photo.width, int(round(photo.width * scale)))
    h = min(photo.height, max(1, int(round(w / aspect))))
    w = min(photo.width, max(1, int(round(h * aspect))))
    x, y = int(rng.integers(0, photo.width - w + 1)), int(rng.integers(0, photo.height - h + 1))
    picture = photo.crop((x, y, x + w, y + h)).resize(size, Image.Resampling.BICUBIC)
    if rng.random() < 0.5:
        picture = picture.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    picture = ImageEnhance.Brightness(picture).enhance(rng.uniform(0.8, 1.2))
    picture = ImageEnhance.Color(picture).enhance(rng.uniform(0.7, 1.3))
    # sensor-like grain: an upscaled crop would otherwise be smoother than any camera's picture
    pixels = np.asarray(picture, dtype=np.float32)
    pixels += rng.normal(0, rng.uniform(1.5, 4.0), pixels.shape).astype(np.float32)
    picture = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    if kind.mode != "RGB":
        picture = picture.convert(kind.mode)
    out = io.BytesIO()
    if kind.png:
        picture.save(out, format="PNG")
    else:
        picture.save(out, format="JPEG", quality=int(rng.integers(70, 96)), subsampling=kind.subsampling)
    return out.getvalue(), kind, size


def _write_part(args):
    root, first, count, seed, classes, mix, folder = args
    colour, grey = source_photos(folder)
    rng = np.random.default_rng([seed, first])
    cache = {}
    written = []
    for i in range(first, first + count):
        data, kind, size = make_picture(rng, colour, grey, mix, cache)
        path = os.path.join(root, f"n{i % classes:04d}", f"photo_{i:07d}.JPEG")
        with open(path, "wb") as f:
            f.write(data)
        written.append((kind, size, len(data)))
    return written


def _run_parts(write, parts, processes):
    """[write(part) for part in parts], by `processes` forked processes (all cores by default; 1: here)."""
    processes = processes or os.cpu_count()
    if processes == 1:
        return [write(p) for p in parts]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return pool.map(write, parts)


def write_photo_dataset(root, n, classes=100, seed=0, mix: Mix = IMAGENET_MIX, processes=None, folder=None) -> dict:
    """n distinct files in `classes` class folders under root (an ImageFolder), written by `processes`
    processes (all cores by default); the same (n, classes, seed, mix) give the same files. Returns a
    summary: counts of each kind, mean width, height and bytes, and the largest side."""
    source_photos(folder)  # fail here, before any worker starts, when no photos are found
    for c in range(classes):
        os.makedirs(os.path.join(root, f"n{c:04d}"), exist_ok=True)
    parts = [(os.fspath(root), k, min(256, n - k), seed, classes, mix, folder) for k in range(0, n, 256)]
    written = [w for part in _run_parts(_write_part, parts, processes) for w in part]
    return {
        "files": len(written),
        "png": sum(k.png for k, _, _ in written),
        "cmyk": sum(k.mode == "CMYK" for k, _, _ in written),
        "grey": sum(k.mode == "L" for k, _, _ in written),
        "yuv444": sum(k.mode == "RGB" and k.subsampling == 0 and not k.png for k, _, _ in written),
        "mean_width": float(np.mean([s[0] for _, s, _ in written])),
        "mean_height": float(np.mean([s[1] for _, s, _ in written])),
        "max_side": max(max(s) for _, s, _ in written),
        "mean_bytes": float(np.mean([b for _, _, b in written])),
    }


def _write_large(args):
    root, first, count, seed, size, folder = args
    from PIL import Image

    colour, _ = source_photos(folder)
    rng = np.random.default_rng([seed, first])
    h, w = size
    cache = {}
    for i in range(first, first + count):
        photo = _load(colour[int(rng.integers(len(colour)))], cache)
        side = rng.uniform(0.5, 1.0)
        cw, ch = int(photo.width * side), int(photo.height * side)
        x, y = int(rng.integers(0, photo.width - cw + 1)), int(rng.integers(0, photo.height - ch + 1))
        picture = photo.crop((x, y, x + cw, y + ch)).resize((w, h), Image.Resampling.BICUBIC)
        # a camera's grain: the enlarged crop is otherwise smoother than any photo of that size
        pixels = np.asarray(picture, dtype=np.float32) + rng.normal(0, 3.0, (h, w, 3)).astype(np.float32)
        out = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
        with open(os.path.join(root, f"c{i % 2}", f"{i:05d}.jpg"), "wb") as f:
            f.write(out.getvalue())


def write_large_photos(root, files, size=(3000, 4000), seed=0, processes=None, folder=None):
    """`files` camera-sized 4:2:0 JPEGs of size (h, w) in two class folders under root (an ImageFolder),
    each an enlarged crop of a photograph with grain: the phone pictures a user's own dataset holds.
    Kept when root already holds that many files (the same arguments give the same files)."""
    if os.path.isdir(root) and sum(len(fs) for _, _, fs in os.walk(root)) == files:
        return
    source_photos(folder)
    for c in range(2):
        os.makedirs(os.path.join(root, f"c{c}"), exist_ok=True)
    parts = [(os.fspath(root), k, min(16, files - k), seed, size, folder) for k in range(0, files, 16)]
    _run_parts(_write_large, parts, processes)

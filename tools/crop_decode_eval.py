"""Does decoding only a crop box's rows and columns pay, for the workers' decode (gpu_decode's CPU
backend)? Measured before it is built.

Writes --files distinct photo files as the photos bench does (hotloop.bench.photos: ImageNet's sizes
and mix of kinds), draws for each JPEG the boxes of torchvision's RandomResizedCrop(224) (its own
get_params, seeded) and of Resize(256) + CenterCrop(224), and times, per image and box, libjpeg-turbo's
whole decode against its partial decode of the box (crop_decode_eval.c, built here with `cc` and the
system's libjpeg-turbo headers: a tool only, hotloop does not link libjpeg). Each figure is the least
of --repeats decodes, the two ways alternated. Prints, per transform, the medians per image, the
whole set's time with the partial decode as a share of the whole decode's, and the share of the
image's pixels the boxes hold.

    python tools/crop_decode_eval.py --files 512 --repeats 3
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))


def build(folder):
    exe = os.path.join(folder, "crop_decode_eval")
    subprocess.run(["cc", "-O2", "-o", exe, os.path.join(HERE, "crop_decode_eval.c"), "-ljpeg"], check=True)
    return exe


def boxes(path, generator):
    """{transform: (top, left, height, width)} for one image, in its full size's pixels."""
    import torchvision.transforms as T

    with Image.open(path) as im:
        width, height = im.size
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=generator)))
    top, left, h, w = T.RandomResizedCrop.get_params(Image.new("L", (width, height)), (0.08, 1.0), (3 / 4, 4 / 3))
    short = min(width, height)
    side = min(short, round(224 * short / 256))  # Resize(256) then CenterCrop(224), in the full image's pixels
    centre = ((height - side) // 2, (width - side) // 2, side, side)
    return {"RandomResizedCrop(224)": (top, left, h, w), "Resize(256) + CenterCrop(224)": centre}, width * height


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from hotloop.bench import photos

    folder = tempfile.mkdtemp(prefix="hotloop-crop-decode-")
    try:
        exe = build(folder)
        root = os.path.join(folder, "photos")
        made = photos.write_photo_dataset(root, args.files, seed=args.seed)
        jpegs = []
        for d, _, names in sorted(os.walk(root)):
            for name in sorted(names):
                path = os.path.join(d, name)
                with Image.open(path) as im:
                    if im.format == "JPEG" and im.mode in ("RGB", "L"):
                        jpegs.append(path)
        generator = torch.Generator().manual_seed(args.seed)
        drawn = [(path, *boxes(path, generator)) for path in jpegs]
        print(f"{len(jpegs)} JPEGs of {made['files']} files (mean {made['mean_width']:.0f} x "
              f"{made['mean_height']:.0f} px); libjpeg-turbo, least of {args.repeats} per image; {os.cpu_count()} "
              "cores")
        for transform in drawn[0][1]:
            lines = "".join(f"{path} {' '.join(map(str, box[transform]))}\n" for path, box, _ in drawn)
            out = subprocess.run([exe, str(args.repeats)], input=lines, capture_output=True, text=True, check=True)
            times = [tuple(map(float, line.split())) for line in out.stdout.splitlines() if line != "error"]
            whole, part = [t[0] for t in times], [t[1] for t in times]
            pixels = sum(b[transform][2] * b[transform][3] / area for _, b, area in drawn) / len(drawn)
            print(f"{transform}: whole {statistics.median(whole) / 1e3:.3f} ms, box only "
                  f"{statistics.median(part) / 1e3:.3f} ms per image (medians); the set's box-only time "
                  f"{100 * sum(part) / sum(whole):.1f} % of its whole decodes; the box {100 * pixels:.0f} % of the "
                  f"pixels on average; {len(whole)} images")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

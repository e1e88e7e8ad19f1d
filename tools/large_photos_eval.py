"""Times the validation transform on 12-megapixel photos: hotloop.DataLoader(..., gpu_decode=True) against
torch's DataLoader with the same workers, alternated in one process (issue 58's case).

Resize(256) + CenterCrop(224) + ToTensor + Normalize on files of 4000 x 3000 (an enlarged crop of one of
scikit-image's photographs with a camera's grain, 4:2:0 JPEG), batches of 8, each loader's epoch timed
by the wall clock from iter() to its last batch, the order flipped each round. Prints each epoch, the
medians, hotloop's rate over torch's, and hotloop's loader.stats (decoder, ring_bytes). The files are
written by hotloop.bench.photos.write_large_photos and kept under --root; the timing uses public names
only, so that once the files are there it runs against any hotloop install: run it with each of two to
compare them on the same files.

    python tools/large_photos_eval.py --files 48 --workers 2 --rounds 3 --root /tmp/photos-12mp \
        [--device cuda --backend cpu]
"""
import argparse
import os
import statistics
import time

import torch

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def epoch(loader, device):
    started = time.perf_counter()
    count = 0
    for x, _ in loader:
        if device != "cpu":
            x = x.to(device, non_blocking=True)
        count += x.shape[0]
    if device != "cpu":
        torch.cuda.synchronize()
    return count / (time.perf_counter() - started)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=48)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default="/tmp/hotloop-photos-12mp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto", choices=("auto", "hardware", "cuda", "cpu"))
    args = ap.parse_args()

    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    import hotloop

    if not os.path.isdir(args.root) or sum(len(fs) for _, _, fs in os.walk(args.root)) != args.files:
        from hotloop.bench.photos import write_large_photos

        write_large_photos(args.root, args.files)
    tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = ImageFolder(args.root, transform=tf)
    on_gpu = args.device != "cpu"
    ways = {
        "torch": lambda: torch.utils.data.DataLoader(ds, batch_size=args.batch, num_workers=args.workers,
                                                     pin_memory=on_gpu),
        "hotloop": lambda: hotloop.DataLoader(ds, batch_size=args.batch, num_workers=args.workers,
                                              gpu_decode=hotloop.GpuDecode(backend=args.backend),
                                              **({"device": args.device} if on_gpu else {})),
    }
    rates = {name: [] for name in ways}
    stats = None
    for r in range(args.rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            make = ways[name]
            loader = make()
            rates[name].append(epoch(loader, args.device))
            print(f"round {r}: {name} {rates[name][-1]:.1f} img/s", flush=True)
            if name == "hotloop":
                stats = loader.stats
            del loader
    med = {name: statistics.median(v) for name, v in rates.items()}
    print(f"hotloop {hotloop.__file__}")
    print(f"median img/s: torch {med['torch']:.1f}, hotloop {med['hotloop']:.1f}, "
          f"hotloop / torch {med['hotloop'] / med['torch']:.2f}x")
    print(f"hotloop stats: decoder={stats.decoder!r} ring_bytes={stats.ring_bytes:,} "
          f"images_cpu_decoded={stats.images_cpu_decoded}")


if __name__ == "__main__":
    main()

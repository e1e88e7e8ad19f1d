"""Two builds of hotloop on one GPU machine, alternated: the photos loop (gpu_decode) and the ring loader.

For a change that must not move the loader's speed: each build is installed into a folder of its own
(`pip install --no-deps --no-build-isolation --target DIR .`), and this script runs one child process per
build and round, the order flipped each round, all on one folder of distinct files made from real
photographs (hotloop.bench.photos) written once. Each child measures, with the bench's own functions:

* the gpu_decode loader alone (fp16 channels_last, 8 workers), steady img/s and CPU ms per image;
* ResNet-50 AMP fed by it, steady img/s as % of the same step on a resident batch;
* the ring loader alone on the loader bench's in-memory images (12 workers, Normalize on the device).

torch's loader (15 workers) is measured the same way as a third "build", for scale. Prints one table of
medians and ranges per build; --json writes every round.

    python tools/ab_loader.py --build before=/tmp/site-before --build after=/tmp/site-after --rounds 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD_FLAG = "--child"


def child(args):
    """One build's (or torch's) figures, printed as one JSON line."""
    import warnings

    import torch

    import hotloop
    from hotloop.bench import image_loop, loader
    from torchvision.datasets import ImageFolder

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    device = torch.device("cuda")
    dataset = ImageFolder(args.root, transform=image_loop.train_transform())
    torch_way = args.build == ["torch"]  # --build is a list (action="append"): the child is given one

    def photos_loader(dtype):
        if torch_way:
            return image_loop.TorchWay(dataset, 15, device, dtype)
        return image_loop.hotloop_way(dataset, 8, device, dtype)

    out = {"build": args.build, "hotloop": hotloop.__file__}
    alone = image_loop.plain_loop(lambda x, y: None, photos_loader(torch.float16), device)
    out["photos_alone"] = alone["rate"]
    out["photos_cpu_ms"] = 1e3 * alone["cpu_s"] / alone["images"]
    step = image_loop.model_step("resnet50", "fp16", device)
    x, y = next(iter(image_loop.TorchWay(dataset, 2, device, torch.float16)))
    resident = image_loop.resident_rate(step, x, y, device)
    fed = image_loop.plain_loop(step, photos_loader(torch.float16), device)
    out["resnet50_fed_pct"] = 100 * fed["rate"] / resident
    out["resnet50_resident"] = resident
    ds = loader.SyntheticImages(256 * 130, base=512, size=256, crop=224)
    make = (lambda: loader._TorchWay(ds, 256, 12, device)) if torch_way else \
        (lambda: loader._hotloop_way(ds, 256, 12, device))
    out["ring_alone"] = loader.loader_rate(make, 120, 4, device)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(build, site, root):
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
        env["HOTLOOP_CACHE_DIR"] = os.path.join(site, ".kernel-cache")
    cmd = [sys.executable, os.path.abspath(__file__), CHILD_FLAG, "--build", build, "--root", root]
    done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{build}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--build", action="append", default=[], help="NAME=SITE_DIR (repeatable)")
    parser.add_argument("--root", help="a photo folder already written (else one is written)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--files", type=int, default=15_000)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.child:
        return child(args)
    builds = dict(b.split("=", 1) for b in args.build)
    builds["torch"] = builds[list(builds)[-1]]  # torch's loader, with the bench code of the last build
    root = args.root
    if root is None:
        sys.path.insert(0, builds["torch"])
        from hotloop.bench import photos

        root = tempfile.mkdtemp(prefix="hotloop-ab-photos-")
        made = photos.write_photo_dataset(root, args.files)
        print(f"wrote {made['files']} files, mean {made['mean_width']:.0f} x {made['mean_height']:.0f} px", flush=True)
    results = {name: [] for name in builds}
    order = list(builds)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            result = run_child(name, builds[name], root)
            results[name].append(result)
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in result.items()
                                                       if isinstance(v, float)), flush=True)
    keys = ("photos_alone", "photos_cpu_ms", "resnet50_fed_pct", "ring_alone")
    print("\n| build | " + " | ".join(keys) + " |\n|" + " --- |" * (len(keys) + 1))
    for name, rows in results.items():
        cells = []
        for k in keys:
            values = [row[k] for row in rows]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""`python -m hotloop demo`'s JPEG round, run after the small CNN on a GPU: ResNet-50 learns a folder of
photo files, fed by torch's ImageFolder pipeline and by hotloop.DataLoader(gpu_decode=True), an epoch of
each per round, alternated.

Why a second round: on a GPU the small CNN's step is short and its generated 32x32 images cost the loader
next to nothing, so neither loop waits for its data and the rounds cannot tell the loaders apart. A
user's loader is bound elsewhere: torch's workers decode, crop and resize every JPEG with PIL, and a fast
GPU trains ResNet-50 on more images a second than the machine's cores decode. So the round writes a
folder like ImageNet's (bench/photos.py: distinct files made from scikit-image's photographs, ImageNet's
sizes and mix of JPEG kinds; nothing downloaded), measures the model on one batch already on the GPU
(its resident rate, the most any loader can feed), and then times whole epochs: the epoch's seconds, the
steady rate as a share of the resident one (how well the loader keeps the GPU fed), the CPU time of the
process and its workers per image (what the decoding costs the machine) and the wait for the first batch.

Each loader is made once, before the resident rate is measured, so gpu_decode's decoder opens in the
background meanwhile, as it does in a script that builds its model after its loader; each round then runs
one epoch of each, the order flipped each round (NOTE [ The demo's timing ] in demo.py), and the verdict
on the epochs' seconds is rounds.py's: a winner only where every round of one way beat every round of the
other. The pipelines and the timing are the photo bench's (bench/image_loop.py)."""
import sys

from .rounds import print_table, verdict_line

FILES = 4096
LEAST_STEPS = 12  # an epoch's steps: a few to start the workers and fill the queues, the rest timed
# batches of 8 or more, and a file in each of the 100 classes photos.write_photo_dataset makes by default
# (ImageFolder refuses an empty class folder)
LEAST_FILES = 128
MODEL = "ResNet-50 (float16 autocast, channels_last, SGD)"


def batch_size(files, largest):
    """`largest`, or where `files` would give an epoch fewer than LEAST_STEPS steps of it, the largest
    multiple of 8 that gives LEAST_STEPS."""
    return min(largest, files // LEAST_STEPS // 8 * 8)


def window(batches, warmup_most):
    """(warmup, steady) steps of an epoch of `batches` for plain_loop: a quarter of it (2 to `warmup_most`)
    before the timed window, which runs to the epoch's end."""
    warmup = min(warmup_most, max(2, batches // 4))
    return warmup, batches - warmup


def missing():
    """None, or what the round needs that this machine lacks, in words that say how to get it."""
    try:
        import torchvision  # noqa: F401  the pipeline set against gpu_decode is torchvision's
    except ModuleNotFoundError:
        return "needs torchvision (pip install torchvision)"
    except (ImportError, OSError, RuntimeError) as err:  # one built for another torch fails as it loads
        return f"needs torchvision, which failed to import here ({err})"
    from ..bench import photos

    try:
        photos.source_photos()
    except (RuntimeError, OSError) as err:
        return f"needs photographs: {err}"
    return None


def run(device, files, rounds, step=None, model=MODEL, workers=None) -> int:
    """The round on `device` with `files` files and `rounds` rounds. step(x, y): one training step (default:
    ResNet-50, image_loop.model_step), described by `model`; workers: (torch's, hotloop's), by default
    image_loop.worker_counts(). The folder is removed and the loaders closed however the round ends."""
    why = missing()
    if why is not None:
        print(f"hotloop demo: no JPEG round: it {why}", flush=True)
        return 0
    import torch
    from torchvision.datasets import ImageFolder

    from ..bench import image_loop

    cuda = device.type == "cuda"
    batch = batch_size(files, image_loop.BATCH)
    torch_workers, ours_workers = workers or image_loop.worker_counts()
    warmup, steady = window(files // batch, image_loop.WARMUP)
    print(f"\nhotloop demo, JPEG round: {model} learns from {files} photo files in batches of {batch} on "
          f"{torch.cuda.get_device_name(device) if cuda else 'the CPU'}: torch's way (ImageFolder, PIL's decode, "
          f"RandomResizedCrop(224) + flip + ToTensor + Normalize in {_workers(torch_workers)}, pin_memory, "
          f".to(device)) against hotloop's (the same dataset, gpu_decode=True, {_workers(ours_workers)}), "
          f"{rounds} round{'' if rounds == 1 else 's'} of one epoch ({files // batch} steps, {steady} timed after "
          f"{warmup}) of each, alternating",
          flush=True)
    ways = {}
    try:
        with image_loop.photo_folder(files) as (root, made):
            print(f"  files: {made}; removed at the end", flush=True)
            dataset = ImageFolder(root, transform=image_loop.train_transform())
            dtype = torch.float16
            ways["torch"] = image_loop.TorchWay(dataset, torch_workers, device, dtype, batch_size=batch)
            ways["hotloop"] = image_loop.hotloop_way(dataset, ours_workers, device, dtype, batch_size=batch)
            if step is None:
                step = image_loop.model_step("resnet50", "fp16", device)
            x, y = next(iter(image_loop.TorchWay(dataset, min(2, torch_workers), device, dtype, batch_size=batch)))
            resident = image_loop.resident_rate(step, x, y, device)
            del x, y
            print(f"  the model alone, on one batch already on the {'GPU' if cuda else 'CPU'}: {resident:.0f} img/s "
                  "(resident: the most a loader can feed it)", flush=True)
            epochs = []

            def epoch(name):
                got = image_loop.plain_loop(step, ways[name], device, warmup, steady)
                got.update(way=name, fed=100 * got["rate"] / resident)
                epochs.append(got)
                print(f"  round {(len(epochs) + 1) // 2}/{rounds} {name + ':':8} epoch {got['epoch_s']:.2f} s, fed "
                      f"{got['fed']:.1f} % of resident, CPU {got['cpu_ms']:.2f} ms per image, first batch "
                      f"{got['first_s']:.2f} s", flush=True)
                return got

            image_loop.alternated({name: name for name in ways}, epoch, rounds)
    except KeyboardInterrupt:
        print("hotloop demo: JPEG round interrupted; its files are removed", file=sys.stderr)
        return 130
    finally:
        maker = getattr(ways.get("hotloop"), "batch_maker", None)
        if maker is not None:
            maker.close()
    decoder = ways["hotloop"].stats.decoder
    _print_summary(epochs, decoder, torch_workers)
    return 0


def _print_summary(epochs, decoder, torch_workers):
    """The medians of the rounds, what decoded the images, and the verdict on the epochs' seconds."""
    hot = [e for e in epochs if e["way"] == "hotloop"]
    ref = [e for e in epochs if e["way"] == "torch"]
    print()
    print_table([(name, [e[key] for e in hot], [e[key] for e in ref], higher) for name, key, higher in (
        ("epoch time, s", "epoch_s", False), ("fed share, % of resident", "fed", True),
        ("CPU ms per image", "cpu_ms", False), ("time to first batch, s", "first_s", False))])
    print(f"  decoding: hotloop's {decoder}; torch's PIL in its {_workers(torch_workers)}")
    print("  " + verdict_line([e["epoch_s"] for e in hot], [e["epoch_s"] for e in ref], what="epoch"), flush=True)


def _workers(n):
    return f"{n} worker{'' if n == 1 else 's'}"

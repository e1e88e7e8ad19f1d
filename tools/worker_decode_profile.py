"""Where a worker's time goes when it decodes (gpu_decode's CPU backend): one process runs the workers'
sample path (EncodedSamples, as a worker indexes it) over the photos bench's files with torchvision's
RandomResizedCrop(224) pipeline, times it per image, then profiles it and prints the calls that took
the most time, PIL's decode among them.

    python tools/worker_decode_profile.py --files 512
"""
import argparse
import cProfile
import pstats
import shutil
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=512)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    from hotloop.bench import photos
    from hotloop.bench.image_loop import MEAN, STD
    from hotloop.data.image.gpu_decode import ImagePipeline

    root = tempfile.mkdtemp(prefix="hotloop-worker-profile-")
    try:
        photos.write_photo_dataset(root, args.files, classes=8)
        transform = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                               T.Normalize(MEAN, STD)])
        dataset = ImageFolder(root, transform=transform)
        samples = ImagePipeline.make(True, dataset, None, 64, "map").worker_dataset("cpu", 0)
        n = len(samples)
        for i in range(n):  # the files into the page cache, the imports done
            samples[i]
        t0 = time.perf_counter()
        for i in range(n):
            samples[i]
        print(f"the workers' sample path, backend cpu: {1e3 * (time.perf_counter() - t0) / n:.3f} ms per image, "
              f"{n} images, one process")
        profile = cProfile.Profile()
        profile.enable()
        for i in range(n):
            samples[i]
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

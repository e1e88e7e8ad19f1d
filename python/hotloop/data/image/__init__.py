"""gpu_decode's JPEG path, a BatchMaker (../batch_maker.py) of its own: the loader's core never imports it.

gpu_decode (the option, GpuDecode, and what it resolves to for one loader), plan (the transform as
one kernel's parameters), source (the workers' half), maker (the main process's half: ImageMaker),
resize (the kernel), decoder_opening and nvjpeg (the decoder). `make_maker` is what the DataLoader
calls when it is made.
"""
from .gpu_decode import GpuDecode, ImagePipeline
from .maker import ImageMaker
from .source import EncodedImageDataset

__all__ = ["EncodedImageDataset", "GpuDecode", "ImageMaker", "make_maker"]


def make_maker(value, dataset, collate_fn, batch_size, loader_kind, device, stats):
    """(gpu_decode= resolved: None or a GpuDecode; the ImageMaker, or None when gpu_decode is off or
    declined the dataset, with a warning that says why)."""
    config = GpuDecode.from_argument(value)
    pipeline = ImagePipeline.make(config, dataset, collate_fn, batch_size, loader_kind)
    return config, ImageMaker(pipeline, device, stats) if pipeline is not None else None

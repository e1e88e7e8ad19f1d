"""gpu_decode's JPEG path, a BatchStage (../stage.py) of its own: the loader's core never imports it.

gpu_decode (the option, GpuDecode, and what it resolves to for one loader), plan (the transform as
one kernel's parameters), source (the workers' half), stage (the main process's half: ImageStage),
resize (the kernel), decoder_opening and nvjpeg (the decoder). `make_stage` is what the loader's
factory (stage.gpu_decode_stage) calls.
"""
from .gpu_decode import GpuDecode, ImagePipeline
from .source import EncodedImageDataset
from .stage import ImageStage

__all__ = ["EncodedImageDataset", "GpuDecode", "ImageStage", "make_stage"]


def make_stage(value, dataset, collate_fn, batch_size, loader_kind, device, stats):
    """(gpu_decode= resolved: None or a GpuDecode; the ImageStage, or None when gpu_decode is off or
    declined the dataset)."""
    config = GpuDecode.from_argument(value)
    pipeline = ImagePipeline.make(config, dataset, collate_fn, batch_size, loader_kind)
    return config, ImageStage(pipeline, device, stats) if pipeline is not None else None

"""What C calls for a kernel image: load_kernel_image(device, source), registered with _C.set_kernel_loader
at `import hotloop`. The machinery (hotloop.rtc.images) is imported at the first call, so that
importing hotloop finds no NVRTC, reads no source and imports no more of the standard library."""


def load_kernel_image(device: int, source: str) -> bytes:
    """The CUBIN (or PTX) of kernels/<source>.cu for GPU `device`, from the cache or compiled now by
    NVRTC. C calls it with the GIL the first time a kernel of that source is needed on that device,
    and loads what it returns with cuModuleLoadData."""
    from .images import image_for_device

    return image_for_device(device, source)

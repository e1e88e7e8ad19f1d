"""hotloop.Normalize: uint8 HWC image batches to normalised float NCHW or channels_last in one kernel."""
import torch

from .. import _C


class Normalize:
    """uint8 HWC image batches -> (x - mean) / std as float16/bfloat16/float32, NCHW or channels_last.

    `dtype` None (the default) means float16 on a GPU, where autocast consumes it, and float32 on the
    CPU, where a float16 batch would meet a float32 model (CPU autocast casts float32 inputs to
    bfloat16, not float16 ones): a loop written for the GPU runs unchanged without one. Pass a dtype
    to get it everywhere.

    `mean` and `std` are per channel and, as in torchvision, in units of x / 255 (e.g. ImageNet's
    (0.485, 0.456, 0.406) and (0.229, 0.224, 0.225)); `scale` is that 255 (pass scale=1 for means in
    raw 0-255 units). The result equals, bit for bit, torch's

        m = torch.tensor(mean) * scale; s = torch.tensor(std) * scale   # float32
        x.permute(0, 3, 1, 2).float().sub(m.view(1, -1, 1, 1)).div(s.view(1, -1, 1, 1)).to(dtype)

    (then `.contiguous(memory_format=torch.channels_last)` when channels_last). One CUDA kernel on
    the GPU, a C loop on the CPU. As a DataLoader's gpu_transform it applies to every uint8 leaf of
    shape [n, h, w, c] with c == len(mean); other leaves pass unchanged.
    """

    def __init__(self, mean, std, dtype=None, channels_last=True, scale=255.0):
        if dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"Normalize: expected dtype None, float16, bfloat16 or float32, got {dtype}")
        m = torch.as_tensor(mean, dtype=torch.float32).flatten() * scale
        s = torch.as_tensor(std, dtype=torch.float32).flatten() * scale
        if m.numel() != s.numel() or not 1 <= m.numel() <= _C.NORMALIZE_MAX_CHANNELS:
            raise ValueError(f"Normalize: expected mean and std of 1 to {_C.NORMALIZE_MAX_CHANNELS} channels each, "
                             f"got {m.numel()} and {s.numel()}")
        if bool((s == 0).any()):
            raise ValueError("Normalize: std must not contain zeros")
        self.mean, self.std, self.scale = tuple(mean), tuple(std), scale
        self.mean_scaled, self.std_scaled = m, s
        self._m, self._s = m.tolist(), s.tolist()
        self.dtype = dtype
        self.channels_last = channels_last

    def __repr__(self):
        return (f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, "
                f"channels_last={self.channels_last}, scale={self.scale})")

    def output_dtype(self, device) -> torch.dtype:
        """The dtype of what it makes on `device` (see dtype in the class's docstring)."""
        if self.dtype is not None:
            return self.dtype
        return torch.float16 if torch.device(device).type == "cuda" else torch.float32

    def applies_to(self, dtype, shape) -> bool:
        return dtype == torch.uint8 and len(shape) == 4 and shape[-1] == len(self._m)

    def empty_output(self, shape, device):
        """(the NCHW-shaped result, its memory in the kernel's order) for a uint8 [n, h, w, c] input."""
        n, h, w, c = shape
        dtype = self.output_dtype(device)
        if self.channels_last:
            mem = torch.empty((n, h, w, c), dtype=dtype, device=device)
            return mem.permute(0, 3, 1, 2), mem
        mem = torch.empty((n, c, h, w), dtype=dtype, device=device)
        return mem, mem

    def run(self, x, out_mem, stream=0):
        _C.normalize(x, out_mem, self._m, self._s, self.channels_last, stream)

    def __call__(self, x):
        """Normalise one uint8 [n, h, w, c] tensor (CPU or CUDA; on CUDA on the current stream)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Normalize: expected a uint8 tensor [n, h, w, c], got {type(x).__name__}")
        if not self.applies_to(x.dtype, tuple(x.shape)):
            raise ValueError(f"Normalize: expected a uint8 tensor [n, h, w, {len(self._m)}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        x = x.contiguous()
        out, mem = self.empty_output(tuple(x.shape), x.device)
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        self.run(x.detach(), mem, stream)
        return out

    def reference(self, x):
        """torch's own ops for the same result (what tests compare against)."""
        c = len(self._m)
        m = self.mean_scaled.to(x.device).view(1, c, 1, 1)
        s = self.std_scaled.to(x.device).view(1, c, 1, 1)
        y = x.permute(0, 3, 1, 2).float().sub(m).div(s).to(self.output_dtype(x.device))
        return y.contiguous(memory_format=torch.channels_last) if self.channels_last else y.contiguous()

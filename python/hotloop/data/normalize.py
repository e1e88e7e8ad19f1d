"""hotloop.Normalize: uint8 or float image batches, NHWC or NCHW, to normalised float NCHW or channels_last."""
import contextlib

import torch

from .. import _C
from .leaf_transform import LeafTransform

FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LAYOUTS = ("NCHW", "NHWC")
_CHANNEL_DIM = {"NCHW": 1, "NHWC": 3}


class Normalize(LeafTransform):
    """Image batches -> (x - mean) / std as float16/bfloat16/float32, laid out [n, c, h, w] (NCHW
    memory, or channels_last memory when channels_last=True, the default).

    What it takes: a 4-d tensor, uint8 or float (float16, bfloat16, float32, float64), NCHW or NHWC,
    with c == len(mean) channels (1 to NORMALIZE_MAX_CHANNELS: grayscale, RGB, RGBA, ...). It
    normalises as torchvision's ToTensor() then transforms.Normalize(mean, std) would:

    * a uint8 batch is in 0-255 and is divided by 255 (ToTensor's scaling) on the way;
    * a float batch is taken as already scaled (ToTensor's [0, 1]) and is not divided again, so a
      float32 batch gives, bit for bit, torchvision's Normalize(mean, std)(x).

    The channel dimension is the one of size len(mean), dim 1 (NCHW) or the last (NHWC); `layout`
    ("NCHW" or "NHWC") fixes it instead. When both have that size (a 3x3 RGB image, a 1-pixel-wide
    grayscale one) and no layout was given, a float batch is NCHW (what ToTensor gives) and a uint8
    batch NHWC (a numpy/PIL image's layout, and this class's from its start). A uint8 NCHW batch
    stored channels_last (what .contiguous(memory_format=torch.channels_last) makes) is read in place.
    Anything else raises ValueError naming what it got; nothing passes unchanged.

    `dtype` None (the default) means float16 on a GPU, where autocast consumes it, and float32 on the
    CPU, where a float16 batch would meet a float32 model (CPU autocast casts float32 inputs to
    bfloat16, not float16 ones): a loop written for the GPU runs unchanged without one. Pass a dtype
    to get it everywhere. The output dtype does not depend on the input's.

    `mean` and `std` are per channel and, as in torchvision, in units of x / 255 (e.g. ImageNet's
    (0.485, 0.456, 0.406) and (0.229, 0.224, 0.225)); `scale` is that 255 (pass scale=1 for means in
    raw 0-255 units: a float batch is then multiplied by 255 first). The result equals, bit for bit,
    torch's

        uint8:  m = torch.tensor(mean) * scale; s = torch.tensor(std) * scale   # float32
                x_nchw.float().sub(m.view(1, -1, 1, 1)).div(s.view(1, -1, 1, 1)).to(dtype)
        float:  m = torch.tensor(mean); s = torch.tensor(std)                   # float32
                (x_nchw.float() * (255 / scale)).sub(m.view(1, -1, 1, 1)).div(s.view(1, -1, 1, 1)).to(dtype)

    (the multiplication only where 255 / scale != 1; then `.contiguous(memory_format=
    torch.channels_last)` when channels_last). uint8: one CUDA kernel on the GPU, a C loop on the CPU
    (an NCHW batch not stored channels_last is first made so, a uint8 copy); float: torch's ops, on
    the tensor's device. `reference(x)` is that torch formula.

    As a DataLoader's gpu_transform it applies to every leaf of the batch that is a uint8 or float
    tensor of 4 or more dimensions (4 dimensions: the image batches above; more: ValueError); other
    leaves (labels, [n, h, w] masks, feature vectors) pass unchanged, and a batch with no such leaf
    raises ValueError: see `image_leaves`.
    """

    def __init__(self, mean, std, dtype=None, channels_last=True, scale=255.0, layout=None):
        if dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"Normalize: expected dtype None, float16, bfloat16 or float32, got {dtype}")
        if layout not in (None,) + LAYOUTS:
            raise ValueError(f"Normalize: expected layout None, 'NCHW' or 'NHWC', got {layout!r}")
        raw_m = torch.as_tensor(mean, dtype=torch.float32).flatten()
        raw_s = torch.as_tensor(std, dtype=torch.float32).flatten()
        m, s = raw_m * scale, raw_s * scale
        if m.numel() != s.numel() or not 1 <= m.numel() <= _C.NORMALIZE_MAX_CHANNELS:
            raise ValueError(f"Normalize: expected mean and std of 1 to {_C.NORMALIZE_MAX_CHANNELS} channels each, "
                             f"got {m.numel()} and {s.numel()}")
        if bool((s == 0).any()):
            raise ValueError("Normalize: std must not contain zeros")
        self.mean, self.std, self.scale = tuple(mean), tuple(std), scale
        self.mean_scaled, self.std_scaled = m, s
        self._m, self._s = m.tolist(), s.tolist()
        # floats: torchvision's own constants, and the factor that brings x / 255 to x / scale
        self._float_m, self._float_s = raw_m, raw_s
        self._float_factor = 255.0 / float(scale)
        self._on_device = {}  # device -> the float path's constants there
        self.dtype = dtype
        self.channels_last = channels_last
        self.layout = layout

    def __repr__(self):
        return (f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, "
                f"channels_last={self.channels_last}, scale={self.scale}, layout={self.layout!r})")

    def output_dtype(self, device) -> torch.dtype:
        """The dtype of what it makes on `device` (see dtype in the class's docstring)."""
        if self.dtype is not None:
            return self.dtype
        kind = device.type if hasattr(device, "type") else torch.device(device).type
        return torch.float16 if kind == "cuda" else torch.float32

    def _expected(self) -> str:
        c = len(self._m)
        where = {None: f"[n, {c}, h, w] or [n, h, w, {c}]", "NCHW": f"[n, {c}, h, w] (layout='NCHW')",
                 "NHWC": f"[n, h, w, {c}] (layout='NHWC')"}[self.layout]
        return f"a uint8 or float (float16, bfloat16, float32, float64) image batch {where}"

    def takes(self, dtype, shape) -> bool:
        """Whether a loader's batch leaf is the transform's to normalise (or to refuse, by layout_of):
        a uint8 or floating tensor of 4 dimensions or more."""
        return (dtype == torch.uint8 or dtype.is_floating_point) and len(shape) >= 4

    def layout_of(self, dtype, shape) -> str:
        """"NCHW" or "NHWC" for an input it takes (see the class's docstring); ValueError otherwise."""
        shape = tuple(shape)
        if (dtype == torch.uint8 or dtype in FLOAT_INPUTS) and len(shape) == 4:
            c = len(self._m)
            fits = [name for name in LAYOUTS if shape[_CHANNEL_DIM[name]] == c]
            if self.layout is not None:
                if self.layout in fits:
                    return self.layout
            elif len(fits) == 2:  # both dims have c: ToTensor's layout for floats, numpy's for uint8
                return "NHWC" if dtype == torch.uint8 else "NCHW"
            elif fits:
                return fits[0]
        raise ValueError(f"Normalize: expected {self._expected()}, got {dtype} of shape {list(shape)}")

    def image_leaves(self, leaves) -> list:
        """For a loader's batch leaves [(dtype, shape)]: which ones the transform normalises. ValueError
        when one of them is not an image batch it can take, or when none is one (a transform that
        would silently do nothing): raised before anything is copied or launched."""
        leaves = [(dtype, tuple(shape)) for dtype, shape in leaves]
        taken = [self.takes(dtype, shape) for dtype, shape in leaves]
        for (dtype, shape), take in zip(leaves, taken):
            if take:
                try:
                    self.layout_of(dtype, shape)
                except ValueError as exc:
                    raise ValueError(f"DataLoader gpu_transform: a batch leaf it cannot normalise. {exc}") from None
        if not any(taken):
            got = ", ".join(f"{dtype} {list(shape)}" for dtype, shape in leaves) or "no tensors"
            raise ValueError(f"DataLoader gpu_transform: the batch has no image leaf to normalise; {repr(self)} "
                             f"expects {self._expected()} among the batch's tensors, got {got}")
        return taken

    def empty_output(self, dtype, shape, device, empty=None):
        """(the [n, c, h, w] result, its memory in the order run() writes) for an input of `dtype` and
        `shape`, made by `empty(shape, dtype)` (torch.empty on `device` by default)."""
        layout = self.layout_of(dtype, shape)
        n, c, h, w = _nchw(shape, layout)
        out_dtype = self.output_dtype(device)
        if empty is None:
            def empty(size, kind):
                return torch.empty(size, dtype=kind, device=device)
        if self.channels_last:
            mem = empty((n, h, w, c), out_dtype)
            return mem.permute(0, 3, 1, 2), mem
        mem = empty((n, c, h, w), out_dtype)
        return mem, mem

    def run(self, x, out_mem, stream=None):
        """Normalise x into out_mem (empty_output's second tensor) on `stream` (a CUDA stream handle;
        None: the current stream; ignored on the CPU)."""
        layout = self.layout_of(x.dtype, tuple(x.shape))
        x = x.detach()
        if x.dtype == torch.uint8:
            # the kernel reads NHWC: an NCHW batch stored channels_last is that already (no copy)
            src = x if layout == "NHWC" else x.permute(0, 2, 3, 1)
            if not src.is_contiguous():
                with _torch_ops_on(x, stream):
                    src = src.contiguous()
            _C.normalize(src, out_mem, self._m, self._s, self.channels_last, _stream_handle(x, stream))
            return
        self._float_constants(x.device)  # made (once) on the current stream, not on `stream`
        with _torch_ops_on(x, stream):
            out = out_mem.permute(0, 3, 1, 2) if self.channels_last else out_mem
            out.copy_(self._float_nchw(x, layout))

    def _float_nchw(self, x, layout):
        """The float path in float32, [n, c, h, w]: torchvision's sub then div (see the docstring)."""
        x = x if layout == "NCHW" else x.permute(0, 3, 1, 2)
        y = x.float()
        if self._float_factor != 1.0:
            y = y * self._float_factor
        m, s = self._float_constants(x.device)
        return y.sub(m).div_(s)

    def _float_constants(self, device):
        """mean and std as [1, c, 1, 1] float32 on `device`, copied there once: a copy from pageable
        memory per batch could wait for the stream it is queued on."""
        device = torch.device(device)
        found = self._on_device.get(device)
        if found is None:
            c = len(self._m)
            found = self._on_device[device] = (self._float_m.to(device).view(1, c, 1, 1),
                                               self._float_s.to(device).view(1, c, 1, 1))
        return found

    def __call__(self, x):
        """Normalise one image batch (CPU or CUDA; on CUDA on the current stream): see the class."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Normalize: expected {self._expected()}, got {type(x).__name__}")
        out, mem = self.empty_output(x.dtype, tuple(x.shape), x.device)
        self.run(x, mem)  # on the current stream
        return out

    def reference(self, x):
        """torch's own ops for the same result (what tests compare against)."""
        layout = self.layout_of(x.dtype, tuple(x.shape))
        if x.dtype == torch.uint8:
            c = len(self._m)
            m = self.mean_scaled.to(x.device).view(1, c, 1, 1)
            s = self.std_scaled.to(x.device).view(1, c, 1, 1)
            x = x if layout == "NCHW" else x.permute(0, 3, 1, 2)
            y = x.float().sub(m).div(s)
        else:
            y = self._float_nchw(x, layout)
        y = y.to(self.output_dtype(x.device))
        return y.contiguous(memory_format=torch.channels_last) if self.channels_last else y.contiguous()

    # LeafTransform's hooks (leaf_transform.py), as a loader's gpu_transform: the leaves image_leaves
    # takes, normalised on the copy stream once copied
    leaf_outputs = image_leaves
    empty_leaf = empty_output
    transform_leaf = run
    transform = __call__


def _nchw(shape, layout):
    n, a, b, d = shape
    return (n, a, b, d) if layout == "NCHW" else (n, d, a, b)


def _stream_handle(x, stream):
    """The kernel's stream: the one given (a loader's copy stream), else the current one; 0 on the CPU."""
    if not x.is_cuda:
        return 0
    return stream if stream is not None else torch.cuda.current_stream(x.device).cuda_stream


def _torch_ops_on(x, stream):
    """torch's ops (the float path, the uint8 NCHW copy) where the kernel would run: on the stream
    given (a loader's copy stream, right after its copy into x), else the current one."""
    if not x.is_cuda or stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream, device=x.device))

"""What a torchvision transform does to an image, as one crop + resize + window + flip + normalise.

`ImagePlan.of(transform)` reads a Compose of the transforms hotloop can move to the GPU (v1 and v2:
RandomResizedCrop, Resize, CenterCrop, RandomHorizontalFlip, ToTensor, PILToTensor, ToImage,
ConvertImageDtype, ToDtype, Normalize, ToPureTensor, RGB) and returns None for anything else.
`plan.draw(height, width)` then makes, for one image, the random draws the transform itself would
make, with the transform's own methods (get_params / make_params) on the global torch generator, in
the same order: for the same seed, the crop boxes and flips are exactly those of the CPU pipeline.
It returns where the output comes from in the source image (a `Geometry`, the kernel's entry).
"""
import dataclasses

import torch

# (kernel dtype, scale-mode) of the conversions to float: ToTensor divides by 255, ToDtype multiplies
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NeedsCpu(Exception):
    """This image cannot take the GPU path (a CenterCrop larger than the image pads it): the worker
    runs the transform itself, from the RNG state it had before draw()."""


@dataclasses.dataclass
class Geometry:
    """Output window = flip?(window of resize(crop of the source)); integers, as the kernel takes them."""

    box_top: int
    box_left: int
    box_h: int
    box_w: int
    resized_h: int
    resized_w: int
    out_top: int = 0
    out_left: int = 0
    flip: int = 0


def _bilinear(interpolation) -> bool:
    from torchvision.transforms import InterpolationMode
    if isinstance(interpolation, str):  # some v2 releases keep the mode's value
        return interpolation == InterpolationMode.BILINEAR.value
    return interpolation in (InterpolationMode.BILINEAR, 2)  # 2: PIL.Image.BILINEAR, as v1 accepts


def _pair(size):
    if isinstance(size, int):
        return (size, size)
    size = tuple(size)
    return (size[0], size[0]) if len(size) == 1 else (size[0], size[1])


def _classes():
    """{class: kind} of the transforms understood, v1 and v2 (only those importable here)."""
    import torchvision.transforms as v1
    kinds = {v1.RandomResizedCrop: "rrc", v1.Resize: "resize", v1.CenterCrop: "center",
             v1.RandomHorizontalFlip: "flip", v1.ToTensor: "to_tensor", v1.PILToTensor: "pil_to_tensor",
             v1.ConvertImageDtype: "convert_dtype", v1.Normalize: "normalize"}
    try:
        import torchvision.transforms.v2 as v2
    except ImportError:
        return kinds
    kinds.update({v2.RandomResizedCrop: "rrc", v2.Resize: "resize", v2.CenterCrop: "center",
                  v2.RandomHorizontalFlip: "flip", v2.ToImage: "pil_to_tensor", v2.PILToTensor: "pil_to_tensor",
                  v2.ToDtype: "to_dtype", v2.Normalize: "normalize", v2.ToPureTensor: "identity",
                  v2.RGB: "identity"})
    if hasattr(v2, "ToTensor"):
        kinds[v2.ToTensor] = "to_tensor"
    return kinds


def _steps(transform):
    """The transforms a Compose applies, in order (nested Composes flattened)."""
    import torchvision.transforms as v1
    composes = [v1.Compose]
    try:
        import torchvision.transforms.v2 as v2
        composes.append(v2.Compose)
    except ImportError:
        pass
    if type(transform) in composes:
        return [s for t in transform.transforms for s in _steps(t)]
    return [transform]


@dataclasses.dataclass
class ImagePlan:
    """The recognised transform: geometric steps, then how pixels become the output values."""

    geometry: list  # (kind, transform) of rrc / resize / center / flip, in order
    out_size: tuple  # (H, W) of every output image
    dtype: torch.dtype  # the pipeline's output dtype: uint8, or a float type
    scale: float  # the float value is q / scale before normalising (255 for ToTensor, 1 without scaling)
    mean: tuple
    std: tuple
    transform: object  # what it was made from

    @classmethod
    def of(cls, transform):
        """The plan of `transform`, or None when it holds anything hotloop does not move to the GPU."""
        try:
            kinds = _classes()
        except ImportError:
            return None
        geometry, state = [], "pil"  # pixel state: pil / uint8 tensor / float tensor
        dtype, scale, mean, std = torch.uint8, 1.0, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        resamples = 0
        for t in _steps(transform):
            kind = kinds.get(type(t))  # exact types: a subclass may change what it does
            if kind is None:
                return None
            if kind in ("rrc", "resize", "center", "flip"):
                if state == "float" or not _geometry_ok(kind, t):
                    return None
                resamples += kind in ("rrc", "resize")
                geometry.append((kind, t))
            elif kind == "to_tensor":
                if state != "pil":
                    return None
                state, dtype, scale = "float", torch.float32, 255.0
            elif kind == "pil_to_tensor":
                if state != "pil":
                    return None
                state = "uint8"
            elif kind in ("convert_dtype", "to_dtype"):
                to = t.dtype
                do_scale = True if kind == "convert_dtype" else t.scale
                if state != "uint8" or not isinstance(to, torch.dtype) or to not in _FLOAT_DTYPES:
                    return None
                state, dtype, scale = "float", to, 255.0 if do_scale else 1.0
            elif kind == "normalize":
                if state != "float" or mean != (0.0, 0.0, 0.0) or std != (1.0, 1.0, 1.0):
                    return None
                mean, std = _three(t.mean), _three(t.std)
                if mean is None or std is None or 0.0 in std:
                    return None
        if resamples > 1 or state == "pil":
            return None  # two resamplings are not one kernel; a PIL image out is not a batch
        out_size = _static_out_size(geometry)
        if out_size is None:
            return None  # a Resize(int) alone: the size depends on each image (torch could not batch it either)
        return cls(geometry, out_size, dtype, scale, mean, std, transform)

    def draw(self, height, width) -> Geometry:
        """The geometry of one image of this size, drawing from the global torch generator exactly
        as the transform would (the same calls, in the same order). NeedsCpu: pads (see the class)."""
        box = [0, 0, height, width]  # top, left, h, w in the source
        resized = None  # (h, w) once resampled
        window = None  # [top, left, h, w] in the resized crop
        flip = 0
        for kind, t in self.geometry:
            cur_h, cur_w = (window[2], window[3]) if window else (resized if resized else (box[2], box[3]))
            if kind == "flip":
                flip ^= int(bool(torch.rand(1) < t.p))  # v1: flips when < p; v2: keeps when >= p
            elif kind == "rrc":
                top, left, h, w = _rrc_params(t, cur_h, cur_w)
                box = _sub_box(box, top, left, h, w, flip)
                resized = _pair(t.size)
            elif kind == "resize":
                resized = tuple(_resize_size(t, cur_h, cur_w))
            elif kind == "center":
                ch, cw = _pair(t.size)
                if ch > cur_h or cw > cur_w:
                    raise NeedsCpu()
                top, left = int(round((cur_h - ch) / 2.0)), int(round((cur_w - cw) / 2.0))
                if resized is None:
                    box = _sub_box(box, top, left, ch, cw, flip)
                else:
                    base = window or [0, 0, resized[0], resized[1]]
                    window = _sub_box(base, top, left, ch, cw, flip)
        if resized is None:
            resized = (box[2], box[3])
        if window is None:
            window = [0, 0, resized[0], resized[1]]
        if (window[2], window[3]) != tuple(self.out_size):
            raise NeedsCpu()  # a size that is not the batch's (cannot happen for a static out_size)
        return Geometry(box[0], box[1], box[2], box[3], resized[0], resized[1], window[0], window[1], flip)


def _sub_box(box, top, left, h, w, flip):
    """box [top, left, h, w] of (top, left, h, w) taken from the image `box` holds, seen mirrored when flip."""
    if flip:
        left = box[3] - left - w
    return [box[0] + top, box[1] + left, h, w]


def _three(values):
    values = tuple(float(v) for v in (values if hasattr(values, "__len__") else [values]))
    if len(values) == 1:
        values *= 3
    return values if len(values) == 3 else None


def _geometry_ok(kind, t) -> bool:
    if kind in ("rrc", "resize") and not _bilinear(t.interpolation):
        return False
    if kind == "flip":
        return True
    size = getattr(t, "size", None)
    if kind == "resize" and size is None:
        return False
    return True


def _static_out_size(geometry):
    size = None
    for kind, t in geometry:
        if kind == "rrc":
            size = _pair(t.size)
        elif kind == "resize":
            s = t.size
            size = None if isinstance(s, int) or len(s) == 1 else _pair(s)
        elif kind == "center":
            size = _pair(t.size)
    return size


def _rrc_params(t, h, w):
    """(top, left, h, w) from the transform's own parameter method on a stand-in of the image's size."""
    stand_in = torch.zeros(()).expand(3, h, w)  # no memory: only its shape is read
    if hasattr(t, "get_params") and not hasattr(t, "make_params"):  # v1
        return t.get_params(stand_in, t.scale, t.ratio)
    make = getattr(t, "make_params", None) or getattr(t, "_get_params")  # v2 (named _get_params before 0.21)
    p = make([stand_in])
    return p["top"], p["left"], p["height"], p["width"]


def _resize_size(t, h, w):
    size = [t.size] if isinstance(t.size, int) else list(t.size)
    try:
        from torchvision.transforms.functional import _compute_resized_output_size
    except ImportError:  # pragma: no cover - moved in some torchvision
        from torchvision.transforms.v2.functional._geometry import _compute_resized_output_size
    return _compute_resized_output_size((h, w), size, t.max_size)

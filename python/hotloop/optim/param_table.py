"""The parameter table of hotloop.optim's kernels: checks of parameters, gradients, state and the scaler's
tensors, grouping by device, and the packed tables the C call reads."""
import torch

from ..amp import tensor_table

# what the kernels update: a parameter of one of these dtypes, its moments or buffer of its dtype (as torch's
# fused optimizers keep them), its gradient of its dtype, or of any of them for a float32 parameter
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD_DTYPES = PARAM_DTYPES


def _layout(t):
    """strides of the dimensions that have more than one element: what fixes the element order"""
    return tuple(stride for stride, size in zip(t.stride(), t.shape) if size != 1)


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


_EXPECTED_PARAM = "expected a float32, float16 or bfloat16 parameter"


def check_group_dtypes(name, param_group):
    """TypeError for a parameter of a new param group that the kernels cannot update: anything but float32,
    float16 or bfloat16."""
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    for i, p in enumerate(params):
        t = p[1] if isinstance(p, tuple) else p  # named parameters come as (name, tensor)
        if isinstance(t, torch.Tensor) and t.dtype not in _PARAM_DTYPE_SET:
            raise TypeError(f"{name}: params[{i}]: {_EXPECTED_PARAM}, got {t.dtype}")
    return params


_PARAM_DTYPE_SET = frozenset(PARAM_DTYPES)
_GRAD_DTYPE_SET = frozenset(GRAD_DTYPES)


def param_and_grad_plain(p, g) -> bool:
    """True for the common case that check_param would accept, found in a few attribute reads (a step
    over 2,000 parameters reads this for each): a contiguous parameter of a kernel dtype and a gradient
    of its dtype (or of a kernel dtype, for float32) with its shape, strides and device. False says
    nothing: check_param decides."""
    return ((g.dtype is p.dtype or (p.dtype is torch.float32 and g.dtype in _GRAD_DTYPE_SET))
            and p.dtype in _PARAM_DTYPE_SET and g.layout is torch.strided
            and p.layout is torch.strided and g.device == p.device and g.shape == p.shape
            and g.stride() == p.stride() and p.is_contiguous())


def check_param(name, index, p):
    """TypeError/ValueError for a parameter the kernel cannot update; nothing is changed."""
    where = f"{name}: param_groups[{index[0]}]['params'][{index[1]}]"
    if p.dtype not in _PARAM_DTYPE_SET:
        raise TypeError(f"{where}: {_EXPECTED_PARAM}, got {p.dtype}")
    if p.layout is not torch.strided or not tensor_table.is_dense(p):
        raise ValueError(f"{where}: expected a dense (strided, gap-free) parameter")
    g = p.grad
    if g.is_sparse or g.layout is not torch.strided:
        raise TypeError(f"{where}: {name} does not support sparse gradients (got layout {g.layout})")
    if g.dtype not in GRAD_DTYPES:
        raise TypeError(f"{where}: expected a float32, float16 or bfloat16 gradient, got {g.dtype}")
    if p.dtype is not torch.float32 and g.dtype is not p.dtype:
        raise TypeError(f"{where}: expected a {_dtype_name(p.dtype)} gradient (the parameter's dtype; only a float32 "
                        f"parameter takes a gradient of another), got {g.dtype}")
    if g.shape != p.shape:
        raise ValueError(f"{where}: gradient shape {tuple(g.shape)} differs from the parameter's {tuple(p.shape)}")
    if g.device != p.device:
        raise ValueError(f"{where}: gradient on {g.device}, parameter on {p.device}")
    if not tensor_table.is_dense(g) or _layout(g) != _layout(p):
        raise ValueError(f"{where}: expected a gradient laid out as its parameter (strides {p.stride()}), "
                         f"got strides {g.stride()}")


def check_state(name, p, tensor, key):
    """ValueError unless a state tensor has its parameter's dtype, shape, layout and device"""
    if tensor.dtype is not p.dtype or tensor.shape != p.shape or tensor.device != p.device or \
            _layout(tensor) != _layout(p) or not tensor_table.is_dense(tensor):
        raise ValueError(f"{name}: state '{key}' must be a {_dtype_name(p.dtype)} tensor laid out as its parameter "
                         f"({tuple(p.shape)}, strides {p.stride()}, {p.device}); got {tensor.dtype} "
                         f"{tuple(tensor.shape)}, strides {tensor.stride()}, {tensor.device}")


def scaler_tensor(value, argname, device):
    """grad_scale / found_inf for the parameters on `device`: None, or one float32 element there. A tensor
    on another GPU is copied (no host sync), as torch's fused optimizers do; another device type is a
    ValueError."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{argname}: expected None or a float32 tensor of one element, got {type(value).__name__}")
    if value.dtype is not torch.float32:
        raise TypeError(f"{argname}: expected a float32 tensor, got {value.dtype}")
    if value.numel() != 1:
        raise ValueError(f"{argname}: expected one element, got {value.numel()}")
    if value.device.type != device.type:
        raise ValueError(f"{argname}: expected a tensor on {device.type} (the parameters' device {device}), "
                         f"got one on {value.device}")
    if value.device != device:
        value = value.to(device, non_blocking=True)
    return value.detach().reshape(())


def host_scalar(value, argname, capture=False):
    """A float hyperparameter. A CPU tensor is read on the host (no device sync), except during a graph
    capture, where its value would be frozen into the graph (RuntimeError); a device tensor is not
    supported (NotImplementedError)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise NotImplementedError(f"{argname}: a device tensor is not supported (pass a float or a CPU tensor)")
        if capture:
            raise RuntimeError(f"{argname}: a CPU tensor is read on the host, so a CUDA graph would replay the "
                               f"value it had at capture; pass a float (a constant of the graph)")
    return float(value)


def lr_args(value, device, capture=False):
    """(lr as a float, lr tensor or None) for the parameters on `device`. A one-element float32 tensor on
    `device` (or copied there from another GPU, no host sync) is read by the kernel when it runs, so a
    graph replays its current value; a CPU tensor is read now (torch's lr.item()), which a capture of a
    CUDA step refuses; numbers are constants."""
    if not isinstance(value, torch.Tensor):
        return float(value), None
    if value.numel() != 1:
        raise ValueError(f"lr: expected a tensor of one element, got {value.numel()}")
    if value.device.type == "cpu" and (device.type != "cpu" or value.dtype is not torch.float32):
        if capture:
            raise RuntimeError("lr: a CPU tensor is read on the host, so a CUDA graph would replay the value it "
                               "had at capture; pass a one-element float32 tensor on the parameters' GPU, which "
                               "the kernel reads at every replay")
        return float(value), None
    if value.dtype is not torch.float32:
        raise TypeError(f"lr: expected a float32 tensor on {device}, got {value.dtype}")
    if value.device.type != device.type:
        raise ValueError(f"lr: expected a float or a tensor on the CPU or {device} (the parameters' device), "
                         f"got one on {value.device}")
    if value.device != device:
        value = value.to(device, non_blocking=True)
    return 1.0, value.detach().reshape(())


def pack(tensors):
    return tensor_table.packed_bytes(tensors)


def by_device(params):
    """{device: [parameters there]}, in the order they came"""
    out = {}
    for p in params:
        out.setdefault(p.device, []).append(p)
    return out


def threads_of(device):
    """the threads the C reference may use for CPU tensors: torch's intra-op count (torch.set_num_threads)"""
    return torch.get_num_threads() if device.type == "cpu" else 1


def stream_of(device):
    """the current CUDA stream of `device` as an int for C (0 for the CPU)"""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0

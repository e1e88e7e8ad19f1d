"""Single kernels over many tensors at once, for code that wants them without the GradScaler around them."""
import torch

from .. import _C
from . import tensor_table


@tensor_table.runs_eagerly  # see NOTE [ hotloop under torch.compile ]
def non_finite_check(tensors) -> torch.Tensor:
    """A one-element float32 tensor on the tensors' device: 1.0 if any element of any tensor is inf
    or NaN, else 0.0.

    `tensors` is a tensor or an iterable of float32, float16 and bfloat16 tensors (mixed is fine),
    all on one device and dense (contiguous in some order of their dimensions, channels_last
    included). On CUDA one kernel on the current stream reads them all and the host does not wait
    for it; on the CPU vectorised C loops on torch's intra-op threads do the same. Tensors that require grad are
    read as they are (nothing is recorded for autograd).
    """
    tensors = tensor_table.as_tensor_list(tensors)
    packed = tensor_table.pack(tensors)
    if not tensors:
        # C raises the ValueError for an empty table; this keeps the message in one place
        _C.non_finite_check(packed, None, None, 0)
    device = tensors[0].device
    found = torch.zeros(1, dtype=torch.float32, device=device)
    if device.type == "cuda":
        scratch = tensor_table.device_scratch(len(tensors), device)
        stream = torch.cuda.current_stream(device).cuda_stream
    else:
        scratch, stream = None, 0
    # on the CPU as many threads as torch's own ops use
    _C.non_finite_check(packed, found, scratch, stream, torch.get_num_threads() if device.type == "cpu" else 0)
    return found

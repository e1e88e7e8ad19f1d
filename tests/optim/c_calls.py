"""The C entry points of hotloop.optim called directly, as the optimizers call them: write the table, put
it where the tensors are, launch. For the kernel-against-C-reference tests."""
import torch

from hotloop import _C
from hotloop.amp import tensor_table

pack = tensor_table.packed_bytes


def _table(write, count, entry_bytes, device):
    host = torch.empty(count * entry_bytes, dtype=torch.uint8)
    count, chunks, dev = write(host)
    table = host if device.type == "cpu" else host.to(device)
    return table, count, chunks, dev


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def adam(params, grads, states, grad_scale=None, found_inf=None, amsgrad=False, lr_tensor=None, threads=1, **hyper):
    """One step of the C reference (CPU tensors) or the kernels (CUDA tensors); states are dicts as
    torch's (exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad, step). `threads`: the C reference's most."""
    h = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False)
    h.update(hyper)
    device = params[0].device
    packed = (pack(params), pack(grads), pack([s["exp_avg"] for s in states]), pack([s["exp_avg_sq"] for s in states]),
              pack([s["max_exp_avg_sq"] for s in states]) if amsgrad else None, pack([s["step"] for s in states]))
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps")
    table, count, chunks, dev = _table(lambda dst: _C.optim_adam_table(**dict(zip(names, packed)), dst=dst),
                                       len(params), _C.OPTIM_ADAM_ENTRY_BYTES, device)
    _C.optim_adam(table=table, count=count, total_chunks=chunks, device=dev, lr_tensor=lr_tensor, grad_scale=grad_scale,
                  found_inf=found_inf, stream=_stream(device), threads=threads, **h)


def sgd(params, grads, bufs, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-2, nesterov=True, maximize=False,
        first_step=False, grad_scale=None, found_inf=None, lr_tensor=None, threads=1):
    device = params[0].device
    packed = (pack(params), pack(grads), pack(bufs) if bufs is not None else None)
    table, count, chunks, dev = _table(lambda dst: _C.optim_sgd_table(*packed, dst), len(params),
                                       _C.OPTIM_SGD_ENTRY_BYTES, device)
    _C.optim_sgd(table=table, count=count, total_chunks=chunks, device=dev, lr=lr, lr_tensor=lr_tensor,
                 momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                 maximize=maximize, first_step=first_step, grad_scale=grad_scale, found_inf=found_inf,
                 stream=_stream(device), threads=threads)

"""Activation memory per module, read from torch's allocator in forward hooks (no host sync)."""
import functools

from .report import ModuleMemory


class ModuleHooks:
    """Hooks on every submodule of `model`: what each forward kept allocated, and whether autocast
    and float32 matmuls were seen. `allocated`: a callable giving allocated bytes, or None (then a
    module's output bytes stand in)."""

    def __init__(self, model, allocated):
        import torch

        self.torch = torch
        self.allocated = allocated  # callable -> bytes, or None: then outputs' bytes are the estimate
        self.stats = {}
        self.stack = {}
        self.handles = []
        self.autocast_seen = False
        self.fp32_matmul_seen = False
        matmul_types = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                        torch.nn.MultiheadAttention)
        for name, module in model.named_modules():
            if module is model:
                continue
            self.handles.append(module.register_forward_pre_hook(functools.partial(self._pre, name)))
            self.handles.append(module.register_forward_hook(
                functools.partial(self._post, name, isinstance(module, matmul_types))))

    def _tensors(self, out):
        t = self.torch
        if isinstance(out, t.Tensor):
            return [out]
        if isinstance(out, (list, tuple)):
            return [x for x in out if isinstance(x, t.Tensor)]
        if isinstance(out, dict):
            return [x for x in out.values() if isinstance(x, t.Tensor)]
        return []

    def _pre(self, name, module, args):
        self.stack.setdefault(name, []).append(self.allocated() if self.allocated else 0)

    def _post(self, name, is_matmul, module, args, out):
        t = self.torch
        before = self.stack[name].pop() if self.stack.get(name) else 0
        tensors = self._tensors(out)
        out_bytes = sum(x.numel() * x.element_size() for x in tensors)
        act = (self.allocated() - before) if self.allocated else out_bytes
        # memory freed meanwhile by another thread or the garbage collector counts against the
        # module; what it kept is never below nothing
        act = max(act, 0)
        s = self.stats.get(name)
        if s is None:
            s = self.stats[name] = ModuleMemory(name, act, out_bytes, 0)
        s.activation_bytes = max(s.activation_bytes, act)
        s.output_bytes = max(s.output_bytes, out_bytes)
        s.calls += 1
        device_type = tensors[0].device.type if tensors else "cuda"
        try:
            autocast = t.is_autocast_enabled(device_type)
        except TypeError:  # torch < 2.4
            autocast = t.is_autocast_enabled()
        self.autocast_seen |= bool(autocast)
        if is_matmul and not autocast and any(x.dtype == t.float32 for x in tensors):
            self.fp32_matmul_seen = True
        # backward reaches this module when the gradient of its output is computed
        if self.allocated and tensors and tensors[0].requires_grad and t.is_grad_enabled():
            tensors[0].register_hook(functools.partial(self._backward, s))

    def _backward(self, s, grad):
        s.backward_allocated_bytes = max(s.backward_allocated_bytes, self.allocated())

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def modules(self):
        return list(self.stats.values())

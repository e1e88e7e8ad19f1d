"""The kernels' table of one optimizer step on one device: written by C, uploaded once and reused while
its tensors stay where they are, and what a CUDA-graph capture of the step may and may not do.

A step captured in a graph replays its kernels with the arguments they had at capture: the table's
address, the hyperparameters given as numbers, and the addresses of the lr, grad_scale and found_inf
tensors, which the kernels read at every replay, as they read each tensor's step count. So a capture
may reuse a table uploaded before it, but must not upload one (a copy from host memory would be
replayed from memory that is gone) nor make state (a zero fill would be replayed too): those raise.
"""
import dataclasses

import torch

from ..amp import tensor_table


def capturing(device) -> bool:
    """True while the current stream of `device` (a CUDA device) is capturing a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def refuse_in_capture(name, what):
    raise RuntimeError(f"{name}: cannot capture this step in a CUDA graph: {what}. Take one step outside the "
                       f"capture first (a warm-up step with the same parameters, gradients and state), then capture")


@dataclasses.dataclass
class _Table:
    key: tuple
    table: torch.Tensor  # the entries, on the device (host memory for the C reference)
    count: int
    total_chunks: int
    stream: object  # the CUDA stream the upload ran on (None on the CPU)
    uploaded: object  # a CUDA event after the upload (None on the CPU)


class StepTables:
    """The tables of one optimizer, one per slot (param group index, device). `key` is what the entries
    were written from (the packed tables: addresses, sizes, dtypes); a step whose key differs writes and
    uploads a new table, which a graph capture refuses."""

    def __init__(self, name):
        self._name = name
        self._slots = {}
        self._in_graphs = {}  # id -> table a captured graph reads: kept while the optimizer lives

    def get(self, slot, key, device, nbytes, write):
        """The table for `key`: the cached one, or `write(dst)` (which fills a host uint8 tensor of `nbytes`
        and returns (count, total_chunks, device index)) uploaded to `device`."""
        capture = capturing(device)
        cached = self._slots.get(slot)
        if cached is None or cached.key != key:
            if capture:
                refuse_in_capture(self._name, "its parameters, gradients or state are not those of the last step, "
                                  "so their table would be uploaded from host memory during the capture")
            cached = self._slots[slot] = self._upload(key, device, nbytes, write)
        if capture:
            self._in_graphs[id(cached.table)] = cached.table
        elif cached.stream is not None:
            stream = torch.cuda.current_stream(device)
            if stream != cached.stream:
                # another stream reads the table: after its upload, and it is not freed before that stream is done
                stream.wait_event(cached.uploaded)
                cached.table.record_stream(stream)
        return cached.table, cached.count, cached.total_chunks

    @staticmethod
    def _upload(key, device, nbytes, write):
        table, (count, total_chunks, _) = tensor_table.upload(nbytes, device, write)
        if device.type != "cuda":
            return _Table(key, table, count, total_chunks, None, None)
        stream = torch.cuda.current_stream(device)
        uploaded = torch.cuda.Event()
        uploaded.record(stream)
        return _Table(key, table, count, total_chunks, stream, uploaded)

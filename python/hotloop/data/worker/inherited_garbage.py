"""A forked worker never collects the garbage it inherits.

A fork copies every object of the parent, garbage included: a reference cycle the parent's collector
has not reached yet (an earlier loader, a model's leftovers). When the child's collector frees it,
its finalizers run there: a CUDA tensor's or event's calls into CUDA, which a forked child cannot
use. Such a worker can abort (cudaErrorInitializationError, from a torch.cuda.Event of an inherited
loader), and one whose parent had a thread allocating CUDA memory at the moment of the fork
may block for good on the caching allocator's lock, copied locked into the child.

So the child of one of hotloop's forks calls gc.freeze() first thing, in an at-fork hook (before any
Python code of multiprocessing runs there): every inherited object moves to a generation the
collector never looks at (O(1)); the child's own objects are collected as usual. The collector is
off in the parent from just before the fork to just after it, so that no collection starts in the
child before that hook (the at-fork hooks registered before it, threading's among them, allocate);
the hook turns it back on there. The parent is otherwise left alone: freezing it around the fork
and unfreezing after would move all its objects to the oldest generation, and a young cycle holding
a loader's ring (hundreds of MB of shared memory) would then live until the next full collection.
"""
import contextlib
import gc
import os
import threading

_forking = threading.local()  # .collector_was_on: this thread is forking a launcher or a worker (None: not)


def _freeze_if_ours():
    was_on = getattr(_forking, "collector_was_on", None)
    if was_on is not None:
        # a worker forked by multiprocessing never leaves forking_a_worker: a fork of its own (the
        # dataset's) is not one of ours
        _forking.collector_was_on = None
        gc.freeze()
        if was_on:
            gc.enable()


os.register_at_fork(after_in_child=_freeze_if_ours)


@contextlib.contextmanager
def forking_a_worker():
    """Around a fork (os.fork, or a fork-context Process.start) of a launcher or a worker: the child
    freezes what it inherits. Here the collector is off meanwhile (a program's gc.disable() kept)."""
    _forking.collector_was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _forking.collector_was_on:
            gc.enable()
        _forking.collector_was_on = None

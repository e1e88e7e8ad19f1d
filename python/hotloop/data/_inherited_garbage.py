"""A forked worker never collects the garbage it inherits.

A fork copies every object of the parent, garbage included: a reference cycle the parent's collector
has not reached yet (an earlier loader, a model's leftovers). When the child's collector frees it,
its finalizers run there: a CUDA tensor's or event's calls into CUDA, which a forked child cannot
use. On the H200 such a worker aborted (cudaErrorInitializationError, from a torch.cuda.Event of an
inherited loader), and one whose parent had a thread allocating CUDA memory at the moment of the fork
may block for good on the caching allocator's lock, copied locked into the child.

gc.freeze() moves every tracked object to a generation the collector never looks at (O(1)): the
parent freezes around its forks, so that nothing inherited is collectable in the child from its first
instruction, and unfreezes after; the child freezes what it inherited as it starts, which covers a
program that froze objects itself (then the parent leaves its frozen set alone). The child's own
objects are collected as usual.
"""
import contextlib
import gc


@contextlib.contextmanager
def frozen_for_fork():
    """Around a fork (os.fork, or a fork-context Process.start) of the main process."""
    if gc.get_freeze_count() > 0:  # the program's own frozen set: not ours to unfreeze
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def freeze_inherited():
    """First thing in a forked child: what it inherited stays uncollected for its whole life."""
    gc.freeze()

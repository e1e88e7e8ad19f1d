"""What hotloop.DataLoader still runs at interpreter exit, ended by one atexit hook in one order:
prefetch threads first (none may be queueing copies out of a pool being closed), then worker pools
(workers told to exit and reaped, copies waited for, rings closed), then single-process rings, then
gpu_decode's decoders still opening (each waited for and closed: image/decoder_opening.py)."""
import atexit
import os
import weakref

PREFETCH_THREADS, WORKER_POOLS, LOCAL_RINGS, DECODER_OPENINGS = 0, 1, 2, 3
_live = (weakref.WeakSet(), weakref.WeakSet(), weakref.WeakSet(), weakref.WeakSet())


def close_at_exit(obj, stage):
    """obj.close() runs at exit, in `stage`'s turn, unless obj is gone or forgotten by then."""
    _live[stage].add(obj)


def forget(obj):
    """obj was closed: nothing to do for it at exit."""
    for live in _live:
        live.discard(obj)


@atexit.register
def _close_all():
    for live in _live:
        for obj in list(live):
            obj.close()


def forked_copy(obj) -> bool:
    """True in a process forked from the one that made `obj` (another loader's worker, a multiprocessing
    child) when its copy of obj is collected there: that copy owns none of obj's threads, workers or
    CUDA state, and its locks may stay held by a thread that the fork did not copy (the prefetch
    thread's), so a finaliser that took one would wait forever."""
    return getattr(obj, "_hl_pid", None) not in (None, os.getpid())

"""The C reference's thread pool (csrc/thread_pool.c, NOTE [ The C reference's thread pool ]): passes on it,
passes from two Python threads at once, and a child forked while it exists, each giving one thread's bits."""
import os
import threading

import pytest
import torch

from ..forked import wait_for_child
from ..seeding import derived_seed
from . import c_calls

# several chunks (32768 elements) a tensor, so that every thread of a pass takes some
SHAPES = [(6 * 32768 + 3,), (5,), (5 * 32768,), (65537,)]


def _problem(seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    bufs = [torch.randn(s, generator=gen) for s in SHAPES]
    return params, grads, bufs


def _steps(seed, threads, count):
    """`count` SGD steps with momentum on `threads` threads: the parameters and buffers"""
    params, grads, bufs = _problem(seed)
    for _ in range(count):
        c_calls.sgd(params, grads, bufs, threads=threads)
    return params + bufs


def _same(a, b):
    """bit for bit, without a torch op: torch's own OpenMP threads, used from several Python threads before a
    fork (test_two_python_threads_at_once), can hang a forked child's next parallel op"""
    return len(a) == len(b) and all(x.numpy().tobytes() == y.numpy().tobytes() for x, y in zip(a, b, strict=True))


def test_many_passes_give_one_threads_bits():
    seed = derived_seed()
    assert _same(_steps(seed, 4, 30), _steps(seed, 1, 30))


def test_two_python_threads_at_once():
    """Two threads step at once without the GIL: one holds the pool, the other finds it busy and steps
    alone; both get one thread's bits."""
    seed = derived_seed()
    want = _steps(seed, 1, 20)
    got = [None, None]

    def run(k):
        got[k] = _steps(seed, 2, 20)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers)
    assert _same(got[0], want) and _same(got[1], want)


def test_forked_child_steps_on_its_own_pool():
    """A child forked after a threaded step (the parent's workers sleeping in the pool) steps on several
    threads and gets one thread's bits; a hang would be a child still running at the deadline."""
    seed = derived_seed()
    _steps(seed, 4, 2)  # the pool's workers exist now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if _same(_steps(seed, 4, 3), _steps(seed, 1, 3)) else 2
        finally:
            os._exit(code)
    code = wait_for_child(pid, timeout=120)
    assert code is not None, "the forked child hung in its step"
    assert code == 0, code
    # and the parent's pool still works
    assert _same(_steps(seed, 4, 2), _steps(seed, 1, 2))


def test_flush_denormal_reaches_the_workers():
    """torch.set_flush_denormal(True) sets the calling thread's flush-to-zero modes; the pool's workers, started
    before, take them with each job, so subnormal results flush whichever thread made them."""
    seed = derived_seed()
    _steps(seed, 4, 1)  # the workers exist, started without flushing
    gen = torch.Generator().manual_seed(seed)
    tiny = [torch.randn(s, generator=gen) * 1e-39 for s in SHAPES]  # subnormal parameters, gradients, buffers

    def run(threads):
        params, grads, bufs = [t.clone() for t in tiny], [t.clone() for t in tiny], [t.clone() for t in tiny]
        c_calls.sgd(params, grads, bufs, threads=threads)
        return params + bufs

    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        one, four = run(1), run(4)
    finally:
        torch.set_flush_denormal(False)
    assert all(bool((t == 0).all()) for t in one)  # flushed: the case is real
    assert _same(one, four)

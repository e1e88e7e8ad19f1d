"""Run a test body on several ranks of a torch.distributed process group, one process each.

    def body(rank, world_size, arg): ...          # module level: spawned processes import it
    results = run_ranks(body, 2, args=(arg,))     # [what body returned on rank 0, on rank 1]

Gloo on the CPU (what CI runs); backend="nccl" with one GPU per rank for the gpu-marked tests.
A rank that raises fails the test with its traceback, one that dies says so; a rank that hangs (a
collective another rank never joined) fails it after `timeout` seconds, every process killed,
instead of hanging CI.
"""
import multiprocessing
import os
import queue
import socket
import time
import traceback


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """A rank outlives a killed test run otherwise (pytest-timeout, Ctrl-C), waiting in a collective."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _rank_main(body, rank, world_size, backend, port, args, results):
    _die_with_parent()
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            results.put((rank, "ok", body(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(body, world_size=2, *, args=(), backend="gloo", timeout=120):
    """body(rank, world_size, *args) on each rank; the list of what each returned (picklable)."""
    ctx = multiprocessing.get_context("spawn")  # no fork: the parent's threads and CUDA state stay home
    results = ctx.Queue()
    port = _free_port()
    # not daemonic: a rank may start DataLoader workers (children of a daemon are refused); they are
    # killed at the end below, or with this process (_die_with_parent)
    procs = [ctx.Process(target=_rank_main, args=(body, r, world_size, backend, port, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size and not errors:
            try:
                rank, status, value = results.get(timeout=1)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if dead:  # a crash (a segfault, os._exit) or a result that could not be pickled
                    raise AssertionError(f"rank {dead[0][0]} exited with code {dead[0][1]} and no result")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(got))
                    raise AssertionError(f"ranks {missing} gave no result in {timeout} s (a collective left waiting?)")
                continue
            if status == "ok":
                got[rank] = value
            else:
                errors.append((rank, value))  # the others may wait forever in a collective the failed rank left
        if errors:
            rank, tb = errors[0]
            for p in procs:  # a rank that died first caused the others' errors: name it
                p.join(1)
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            first = f"rank {dead[0][0]} exited with code {dead[0][1]} and no result; then " if dead else ""
            raise AssertionError(f"{first}rank {rank} raised:\n{tb}")
        for p in procs:
            p.join(timeout)
        return [got[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)

"""Run a test body on several ranks of a torch.distributed process group, one process each.

    def body(rank, world_size, arg): ...          # module level: spawned processes import it
    results = run_ranks(body, 2, args=(arg,))     # [what body returned on rank 0, on rank 1]

Gloo on the CPU (what CI runs); backend="nccl" with one GPU per rank for the gpu-marked tests. The
ranks are `python -m hotloop bench distributed`'s launcher (hotloop.bench.rank_launch.launch): a rank
that raises fails the test with its traceback, one that dies says so, and a rank that hangs (a
collective another rank never joined) fails it after `timeout` seconds, every process ended, instead
of hanging CI.
"""
from hotloop.bench.rank_launch import RankFailed, launch


def _body_of_a_test(rank, world_size, say, note, body, *args):
    say("the test's body")  # the phase a failure names; the group is up
    return body(rank, world_size, *args)


def run_ranks(body, world_size=2, *, args=(), backend="gloo", timeout=120):
    """body(rank, world_size, *args) on each rank; the list of what each returned (picklable)."""
    try:
        return launch(_body_of_a_test, world_size, args=(body, *args), backend=backend, timeout=timeout)
    except RankFailed as err:
        then = "".join(f"\nthen: {line}" for line in err.then)
        raise AssertionError(f"{err}\n{err.detail}{then}") from None

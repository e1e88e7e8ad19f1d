"""One spawned process per rank, in one process group, watched by the parent: the launcher of `bench
distributed` and of the multi-rank tests. Each rank says which phase it enters; a rank that raises or dies,
or stays in a phase past the timeout (a collective another rank never joined), ends every rank and
raises RankFailed in the parent with its traceback and where the others were."""
import dataclasses
import datetime
import os
import queue
import socket
import threading
import time
import traceback


POLL_S = 0.2  # how often the parent looks at its ranks while none speaks
GRACE_S = 1.0  # after a rank fails, how long the parent listens to the others before ending them
START_S = 120.0  # the least a rank's start (a fresh interpreter importing torch) may take: no collective in it


# messages from a rank to the parent
@dataclasses.dataclass(frozen=True)
class Phase:
    rank: int
    name: str


@dataclasses.dataclass(frozen=True)
class Note:
    rank: int
    text: str


@dataclasses.dataclass(frozen=True)
class Done:
    rank: int
    value: object


@dataclasses.dataclass(frozen=True)
class Failed:
    rank: int
    phase: str
    traceback: str


class RankFailed(Exception):
    """A rank raised, died, or stayed in one phase past the timeout; the others were ended."""

    def __init__(self, rank, phase, detail):
        lines = detail.strip().splitlines()
        super().__init__(f"rank {rank} failed in phase {phase!r}: {lines[-1] if lines else 'no detail'}")
        self.rank, self.phase, self.detail = rank, phase, detail
        self.then = []  # lines: what the other ranks reported after it (their symptoms, most often), where they were


# -- the parent: spawn the ranks, watch them ------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_parent(parent_pid):
    """End this rank when the parent is gone (killed, Ctrl-C): nobody would read what it says."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="hotloop-parent-watch", daemon=True).start()


def _rank_entry(body, rank, world_size, backend, port, timeout, args, messages, parent_pid):
    phase = "start"

    def say(name):
        nonlocal phase
        phase = name
        messages.put(Phase(rank, name))

    def note(text):
        messages.put(Note(rank, text))

    _watch_parent(parent_pid)
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        # ranks that each take every core slow each other down: a share each on GPUs, one thread on the CPU
        # (torchrun's default there; OpenMP threads of several ranks spinning on the same cores make a
        # CPU step many times slower)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size) if backend == "nccl" else 1)
        say("init_process_group")
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # the group's own timeout is a backstop, later than the parent's: the parent sees every rank's phase
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=2 * timeout))
        value = body(rank, world_size, say, note, *args)
    except BaseException:
        # said before anything else can hang (tearing down a group with a collective in flight): the
        # parent ends every rank once it reads this
        messages.put(Failed(rank, phase, traceback.format_exc()))
        return
    messages.put(Done(rank, value))
    dist.destroy_process_group()


def launch(body, world_size, *, args=(), backend="gloo", timeout=300.0):
    """Run body(rank, world_size, say, note, *args) in one spawned process per rank, in one process group;
    say(name) tells the parent which phase the rank enters, note(text) leaves it a line to show should
    the run fail. Returns what each rank returned, by rank. Raises RankFailed, every rank ended, when one
    raises, dies, or spends more than `timeout` seconds in a phase (a collective another rank never joined)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # fresh interpreters: no CUDA state or threads inherited from here
    messages = ctx.Queue()
    port = _free_port()
    # not daemonic: a rank's DataLoader starts worker processes of its own
    procs = [ctx.Process(target=_rank_entry, args=(body, r, world_size, backend, port, timeout, args, messages,
                                                   os.getpid()), name=f"hotloop-bench-rank{r}")
             for r in range(world_size)]
    for p in procs:
        p.start()
    phases = {r: ("start", time.monotonic()) for r in range(world_size)}
    notes, results, failures = [], {}, []

    def take(message):
        if isinstance(message, Phase):
            phases[message.rank] = (message.name, time.monotonic())
        elif isinstance(message, Note):
            notes.append(f"rank {message.rank} noted: {message.text}")
        elif isinstance(message, Done):
            results[message.rank] = message.value
        elif isinstance(message, Failed):
            failures.append(RankFailed(message.rank, message.phase, message.traceback))

    def silent_deaths():
        said = set(results) | {f.rank for f in failures}
        return [r for r, p in enumerate(procs) if r not in said and p.exitcode is not None]

    try:
        while len(results) < world_size:
            try:
                take(messages.get(timeout=POLL_S))
            except queue.Empty:
                pass
            if failures or silent_deaths():
                # the others notice within moments (a peer's closed connection): hear them, then name the
                # cause, a rank that died without a word before one that raised
                _drain(messages, take, GRACE_S)
                dead = [RankFailed(r, phases[r][0], f"its process {_how(procs[r].exitcode)} without a result")
                        for r in silent_deaths()]
                first, *then = dead + failures
                first.then = [str(f) for f in then] + [f"rank {q} was in {phases[q][0]!r}" for q in phases
                                                       if q != first.rank and q not in results] + notes
                raise first
            now = time.monotonic()
            for r in range(world_size):
                name, since = phases[r]
                limit = timeout if name != "start" else max(timeout, START_S)
                if r not in results and now - since > limit:
                    others = [f"rank {q} in {phases[q][0]!r}" for q in phases if q != r and q not in results]
                    raise RankFailed(r, name, "; ".join([f"no progress in {limit:g} s (a collective left "
                                                         f"waiting?)", *others, *notes]))
        for p in procs:
            p.join(timeout)
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)


def _how(exitcode):
    return f"killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"


def _drain(messages, take, wait_s=1.0):
    deadline = time.monotonic() + wait_s
    while True:
        try:
            take(messages.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            return

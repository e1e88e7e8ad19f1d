"""hotloop.find_max_batch_size: the largest batch a training step fits in, found in few trials, with headroom.

Doubling then bisecting (Lightning's BatchSizeFinder) costs about 2·log2(limit) trials and returns a
size that ran once at the edge of memory, so the real run, with a little more fragmentation, can run
out. Activation memory grows linearly with the batch, so after two sizes have run the peak is fitted
as a + b·size and the next trial goes straight to where the line meets the memory available, less a
margin; a short bracketed search confirms it: the fitted guess where it lands inside the bracket (a
parabola where the peaks curve, the line moved up where they step), or, where a size the peaks said
would fit runs out of memory (a workspace the sizes below do not show), a bisection of the octaves
between the largest size that ran and that one. The answer is always a size that ran, never an
extrapolation.

Under torch.distributed every rank runs the same sizes, and after each trial the ranks exchange what
it did (one all_gather_object, reached whether the trial ran, ran out of memory or raised): a trial
fails if it failed on any rank, the peak that counts is the largest over ranks, so every rank takes
the same next size and returns the same answer, one that fits the rank with the least room.
"""
import dataclasses
import gc
import logging
import time
import traceback

from .._arguments import expect_count, expect_positive
from .batch_search import Search
from .ranks import group_rank

_logger = logging.getLogger(__name__)

# what CUDA libraries say when an allocation of theirs fails (torch raises these as plain RuntimeError):
# the caching allocator says "CUDA out of memory", a raw cudaMalloc "CUDA error: out of memory", cuBLAS
# and cuFFT/cuSOLVER an ALLOC_FAILED status, and cuDNN either asks for more workspace or, when its own
# allocation fails inside a call, reports an internal error
OOM_MARKERS = ("out of memory", "cudaErrorMemoryAllocation", "CUBLAS_STATUS_ALLOC_FAILED",
               "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE", "CUDNN_STATUS_ALLOC_FAILED", "CUDNN_STATUS_INTERNAL_ERROR",
               "CUFFT_ALLOC_FAILED", "CUSOLVER_STATUS_ALLOC_FAILED")


def is_out_of_memory(err) -> bool:
    """True for torch.OutOfMemoryError and for the CUDA, cuBLAS and cuDNN allocation failures torch
    raises as RuntimeError."""
    try:
        import torch

        if isinstance(err, torch.OutOfMemoryError):
            return True
    except ImportError:
        pass
    return isinstance(err, RuntimeError) and any(m in str(err) for m in OOM_MARKERS)


class CudaMemory:
    """The default memory source: torch's caching allocator on one CUDA device.

    peak() is torch.cuda.max_memory_reserved since the last reset(): what the allocator held from the
    device, fragmentation included, which is what runs out (NVML's figure would add other processes
    and could not be reset). capacity() is what the allocator could hold now: free device memory plus
    what it already holds (so the CUDA context, cuBLAS/cuDNN handles and other processes are left out).
    """

    def __init__(self, device=None):
        import torch

        self.torch = torch
        if not torch.cuda.is_available():
            raise RuntimeError("find_max_batch_size: torch sees no CUDA device (pass memory= to measure another one)")
        device = torch.device("cuda") if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"find_max_batch_size: expected a CUDA device, got {device} (pass memory= "
                             f"to measure another one)")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)

    def reset(self):
        cuda = self.torch.cuda
        cuda.synchronize(self.device)
        cuda.empty_cache()
        cuda.reset_peak_memory_stats(self.device)

    def in_use(self) -> int:
        return self.torch.cuda.memory_reserved(self.device)

    def peak(self) -> int:
        self.torch.cuda.synchronize(self.device)
        return self.torch.cuda.max_memory_reserved(self.device)

    def capacity(self) -> int:
        free, _ = self.torch.cuda.mem_get_info(self.device)
        return free + self.torch.cuda.memory_reserved(self.device)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One call of step_fn: its batch size, torch's peak (None when it ran out of memory), how long.

    Under torch.distributed: oom when it ran out on any rank; peak_bytes the largest over ranks, each
    rank's taken against the smallest capacity (its peak + the smallest capacity - its own: with
    equal GPUs, the largest peak); rank_peaks each rank's own peak (None where it ran out); seconds
    the slowest rank's."""

    batch_size: int
    peak_bytes: int | None
    oom: bool
    seconds: float
    error: str = ""  # the first line of the out-of-memory error ("rank N: ..." under torch.distributed)
    rank_peaks: tuple = ()


@dataclasses.dataclass
class BatchSizeResult:
    """What find_max_batch_size found: `int(result)` is the batch size; `trials` lists every trial in
    order. capacity_bytes: what torch could hold; margin_bytes: the headroom the answer keeps below
    it; intercept_bytes + bytes_per_sample·size: the fitted peak (None with fewer than two sizes run).
    world_size: the ranks that agreed on it (1 without torch.distributed); capacity_bytes is then the
    smallest rank's."""

    batch_size: int
    trials: list
    capacity_bytes: int
    margin_bytes: int
    intercept_bytes: float | None
    bytes_per_sample: float | None
    world_size: int = 1

    def __int__(self):
        return self.batch_size

    __index__ = __int__

    def status(self, trial) -> str:
        """"fits", "over margin" (it ran, but with less headroom than the answer keeps) or "OOM"."""
        if trial.oom:
            return "OOM"
        return "fits" if trial.peak_bytes <= self.capacity_bytes - self.margin_bytes else "over margin"

    def predicted_peak(self, batch_size):
        if self.bytes_per_sample is None:
            return None
        return self.intercept_bytes + self.bytes_per_sample * batch_size

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, "world_size": self.world_size, "capacity_bytes": self.capacity_bytes,
                "margin_bytes": self.margin_bytes, "intercept_bytes": self.intercept_bytes,
                "bytes_per_sample": self.bytes_per_sample,
                "trials": [dict(dataclasses.asdict(t), status=self.status(t)) for t in self.trials]}

    def __str__(self):
        gib = 2**30
        ranks = f" on each of {self.world_size} ranks" if self.world_size > 1 else ""
        lines = [f"batch size {self.batch_size}{ranks}: {len(self.trials)} trials; torch may hold "
                 f"{self.capacity_bytes / gib:.2f} GiB, the answer keeps {self.margin_bytes / gib:.2f} GiB free"]
        if self.bytes_per_sample is not None:
            lines[0] += (f"; peak ≈ {self.intercept_bytes / gib:.2f} GiB + "
                         f"{self.bytes_per_sample / 2**20:.2f} MiB per sample")
        for i, t in enumerate(self.trials, 1):
            peak = "-" if t.peak_bytes is None else f"{t.peak_bytes / gib:.2f} GiB"
            where = [r for r, p in enumerate(t.rank_peaks) if p is None]
            status = self.status(t) + (f" (rank{'s' * (len(where) > 1)} {', '.join(map(str, where))})"
                                       if where and len(where) < len(t.rank_peaks) else "")
            lines.append(f"  {i:>2}. batch {t.batch_size:>6}  peak {peak:>10}  {status:<11}  {t.seconds:.2f} s")
        return "\n".join(lines)


def _drop_frames(err):
    """An out-of-memory error's traceback holds the frames of the failed step, and through them its
    activations: clear them, along the whole chain of causes, so the memory can go back."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


@dataclasses.dataclass(frozen=True)
class _RankTrial:
    """What one rank's trial did, as the ranks exchange it: status "ran", "oom" or "error" (any other
    exception, from the step or the memory source); in_use only on the first trial."""

    batch_size: int
    status: str
    peak: int | None
    capacity: int | None
    in_use: int | None
    seconds: float
    error: str = ""


def _run_trial(step_fn, size, memory, first):
    """This rank's trial, reset and capacity included: (_RankTrial, the exception it raised other than
    running out of memory, or None). Never raises, so that every rank reaches the exchange after it."""
    t0 = time.perf_counter()
    peak = capacity = in_use = None
    status, error, raised = "ran", "", None
    try:
        memory.reset()
        if first and hasattr(memory, "in_use"):
            in_use = int(memory.in_use())
        capacity = int(memory.capacity())
        try:
            step_fn(size)
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            status, error = "oom", str(err).strip().split("\n")[0][:300]
            _drop_frames(err)
        else:
            peak = int(memory.peak())
    except Exception as err:
        status, error, raised = "error", f"{type(err).__name__}: {err}".split("\n")[0][:300], err
    return _RankTrial(size, status, peak, capacity, in_use, time.perf_counter() - t0, error), raised


class _Ranks:
    """The ranks of a process group that search together: exchange() gives every rank every rank's
    _RankTrial (one all_gather_object, the collective each trial ends with on every rank)."""

    def __init__(self, process_group, rank, world_size):
        import torch.distributed as dist

        self.dist, self.group, self.rank, self.world_size = dist, process_group, rank, world_size

    def exchange(self, mine):
        out = [None] * self.world_size
        self.dist.all_gather_object(out, mine, group=self.group)
        return out


def _combine(ranks, own_error):
    """One Trial and the capacity, baseline it leaves the search, from every rank's _RankTrial. Raises
    on every rank where any rank raised (that rank its own exception) or the ranks ran different sizes."""
    failed = [r for r, t in enumerate(ranks) if t.status == "error"]
    if failed:
        if own_error is not None:
            raise own_error
        raise RuntimeError(f"find_max_batch_size: rank {failed[0]} raised in its trial of batch size "
                           f"{ranks[failed[0]].batch_size}: {ranks[failed[0]].error} (raised on every rank, so "
                           "that none waits for it)")
    sizes = [t.batch_size for t in ranks]
    if len(set(sizes)) > 1:
        raise ValueError(f"find_max_batch_size: the ranks ran different batch sizes {sizes}: call it on every rank "
                         "with the same start, max_batch_size, headroom and max_trials")
    capacity = min(t.capacity for t in ranks)
    # each rank's figures against the smallest capacity: a rank with more room counts for less
    shift = [capacity - t.capacity for t in ranks]
    oom = [r for r, t in enumerate(ranks) if t.status == "oom"]
    peak = None if oom else max(t.peak + d for t, d in zip(ranks, shift))
    error = ""
    if oom:
        error = ranks[oom[0]].error if len(ranks) == 1 else f"rank {oom[0]}: {ranks[oom[0]].error}"[:300]
    baseline = None
    if peak is not None and all(t.in_use is not None for t in ranks):
        # the one-size model is the line from (0, baseline) through (size, peak): its slope the largest
        # rank's growth over what it held before, so that the line passes above every rank's own
        baseline = peak - max(t.peak - t.in_use for t in ranks)
    rank_peaks = tuple(t.peak for t in ranks) if len(ranks) > 1 else ()
    trial = Trial(sizes[0], peak, bool(oom), max(t.seconds for t in ranks), error, rank_peaks)
    return trial, capacity, baseline


def _search_group(all_ranks, process_group):
    """The _Ranks to search with, or None to search alone."""
    if not isinstance(all_ranks, bool) and all_ranks is not None:
        raise TypeError(f"find_max_batch_size: expected all_ranks to be True, False or None, got {all_ranks!r}")
    if all_ranks is False:
        if process_group is not None:
            raise ValueError("find_max_batch_size: process_group= with all_ranks=False: the search would not use it")
        return None
    where = group_rank(process_group)
    if where is None:
        if all_ranks or process_group is not None:
            raise ValueError("find_max_batch_size: all_ranks=True or process_group= needs torch.distributed "
                             "initialized (torch.distributed.init_process_group)")
        return None
    rank, world_size = where
    if rank < 0:
        raise ValueError("find_max_batch_size: this process is not a member of process_group")
    if world_size == 1 and not all_ranks:
        return None
    return _Ranks(process_group, rank, world_size)


def find_max_batch_size(step_fn, *, start=1, max_batch_size=None, device=None, memory=None, headroom=0.03,
                        max_trials=16, all_ranks=None, process_group=None) -> BatchSizeResult:
    """The largest batch size at which `step_fn(batch_size)` (a few real training steps at that size:
    forward, backward, optimizer step) fits in device memory, with headroom for the real run.

    The first trial runs `start`; its peak over what was held before it bounds the memory per sample,
    so the second trial jumps to where that bound says memory runs out. From two sizes on, the peaks
    are fitted as a + b·size and each trial goes where the line meets the usable memory; a size just
    above the answer confirms it. No guess goes more than 16 times past the largest size that ran.
    Inside the bracket, peaks that curve are followed by a parabola and a step up moves the line; a
    size the peaks said would fit that runs out of memory (a workspace or an allocator block the sizes
    below do not show) turns the search into a bisection of the octaves between. On a linear model
    this takes 4-7 trials where doubling and bisecting takes about 2·log2(limit) (22 for a limit near
    1500), and 5-10 on noisy, stepped or curved ones. Where memory runs out far below the line's
    limit, no search can promise half the trials of doubling and bisecting for every size it may run
    out at, nor that half plus 2.5 (the tests count why); this one takes at most that half plus 6.5.

    The margin: the answer's measured peak stays below capacity - margin, where the margin is the
    larger of `headroom` (a share of the capacity, default 3%: fragmentation a longer run adds, a
    cuDNN algorithm with a larger workspace) and three standard deviations of the measured peaks about
    the fitted line (noisy or non-linear peaks: the line is trusted less). Sizes that ran but above that
    line count as too big, so most trials near the edge do not even run out of memory.

    Between trials: gc (after a failed trial) and torch.cuda.empty_cache, and torch's peak is reset. torch.OutOfMemoryError and
    the CUDA, cuBLAS and cuDNN allocation failures torch raises as RuntimeError end a trial (their
    traceback frames, which hold the step's tensors, are cleared); any other error propagates.

    memory: where peaks come from: an object with reset(), peak() -> bytes since the reset,
    capacity() -> bytes that could be held, and optionally in_use() -> bytes held after reset()
    (default: CudaMemory(device), torch's allocator). max_batch_size bounds the answer. The search stops
    once the bracket is within 1/64 of the size (or within what the margin itself is known to, where
    it is three standard deviations), or after max_trials. Raises RuntimeError when even `start` does
    not fit.

    Under torch.distributed (all_ranks=None: where a process group is initialized with more than one
    rank; True: always; False: this rank searches alone) call it on every rank of `process_group`
    (default: the default group) with the same arguments. Every rank runs the same sizes; after each
    trial the ranks exchange what it did (an all_gather_object over the group, which every rank reaches
    whether its step ran, ran out of memory or raised): a trial fails if it ran out on any rank, its
    peak is the largest over ranks (each against the smallest rank's capacity: the answer keeps every
    rank within its own capacity less the margin), so every rank returns the same answer. Where the
    ranks' peaks cross (one holds more at small sizes, another grows faster), the peak that counts
    bends there, which the search takes as curving peaks: a wider margin and more trials. An error
    other than running out of memory, on any rank, is raised on every rank: the rank's own where it
    raised, a RuntimeError naming that rank and its error on the others. The step's own collectives
    (DDP's gradient all-reduce, FSDP's all-gathers) are the step's: a rank that runs out of memory
    before reaching one leaves the others waiting in it, which nothing outside the step can undo. Ranks
    with equal GPUs and equal batches run out at the same allocation; where they may not, run the
    trials without the gradient all-reduce (DDP's `no_sync()`), whose memory hardly differs.
    """
    expect_count("find_max_batch_size", "start", start, least=1)
    if max_batch_size is not None:
        expect_count("find_max_batch_size", "max_batch_size", max_batch_size, least=start)
    expect_positive("find_max_batch_size", "headroom", headroom, zero_ok=True)
    if headroom >= 1:
        raise ValueError(f"find_max_batch_size: expected headroom < 1 (a share of the memory), got {headroom!r}")
    expect_count("find_max_batch_size", "max_trials", max_trials, least=2)
    if not callable(step_fn):
        raise TypeError(f"find_max_batch_size: expected step_fn to be callable, got {type(step_fn).__name__}")
    ranks = _search_group(all_ranks, process_group)
    if memory is None:
        memory = CudaMemory(device)
    search = Search(start, max_batch_size, headroom)
    size = start
    try:
        while size is not None and len(search.trials) < max_trials:
            mine, raised = _run_trial(step_fn, size, memory, first=not search.trials)
            if mine.status == "oom":
                # a failed step leaves reference cycles (its traceback's frames) that hold tensors: free
                # them before the exchange allocates; a step that returned freed its own (a full
                # collection with torch loaded walks all of torch's objects: not free)
                gc.collect()
            trial, capacity, baseline = _combine(ranks.exchange(mine) if ranks else [mine], raised)
            raised = None  # its frames hold the step's tensors
            if not search.trials and baseline is not None:
                search.baseline = baseline
            search.add(trial, capacity)
            _logger.info("find_max_batch_size: batch %d: %s", size,
                         "out of memory" if trial.oom else f"peak {trial.peak_bytes} bytes")
            size = search.next_size()
    finally:
        gc.collect()
        memory.reset()  # the caller's real run starts from a clean cache
    lo, _ = search.bracket()
    fit = search.fit
    result = BatchSizeResult(lo or 0, search.trials, search.capacity, search.margin,
                             fit[0] if fit else None, fit[1] if fit else None, ranks.world_size if ranks else 1)
    if lo is None:
        raise RuntimeError(f"find_max_batch_size: even batch size {start} does not fit "
                           f"({result.status(search.trials[0])}: {search.trials[0].error or 'peak above the margin'})")
    return result

"""`python -m hotloop bench distributed`: a DDP step and an FSDP2 (`fully_shard`) step of a GPT-2-small-sized
model with hotloop's three helpers (hotloop.DataLoader, hotloop.GradScaler, hotloop.MemoryMonitor) against
the same step with torch's (DataLoader with pinned memory and a copy, torch.amp.GradScaler, no monitor):
the same seed, model, data (DistributedSampler) and steps, fp16 autocast (fp32 on the CPU, a smoke run),
gradients clipped to norm 1. Both sides live in each rank and take turns in blocks of steps (the order
swaps every round), so clocks and neighbours weigh on both alike; a block is timed from one device sync
to the next. That is done at world size 1 and at world size N: ms/step, samples/s, hotloop ÷ torch, and
how each side scales from 1 to N ranks. An FSDP2 side whose build or warm-up raises (an FSDP2 that
refuses the model, say) is shown n/a with the error, the ranks agreeing to leave it out; anything
else that raises ends the command.

One process per rank, spawned by rank_launch.py (NCCL and one GPU each on CUDA, gloo on the CPU); rank 0 prints. The
parent only watches: each rank says which phase it enters, a rank that raises ends the command with its
traceback, and a phase that outlasts --timeout (a rank left waiting in a collective) ends it too.
The monitor runs across each of hotloop's blocks; its start (a device sync, torch's peak reset) and
its stop (the report) fall outside the timed span, as a run's one start and stop would.
"""
import dataclasses
import gc
import json
import math
import sys
import time

from . import loop, train, workloads
from .harness import Row, format_table
from .rank_launch import RankFailed, launch
from .workloads import BenchError, Workload

MODES = ("ddp", "fsdp2")
SIDES = ("torch", "hotloop")
ROUNDS = 5  # alternated blocks per side: a run's steps are split into this many (fewer with fewer steps)
MAX_NORM = 1.0

# workloads.MODELS' entries this bench runs; their batch size is per rank
MODELS = {name: workloads.MODELS[name] for name in ("gpt2-small", "tiny-gpt")}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every rank of one run needs to know."""

    model: str
    device: str  # "cuda" or "cpu"
    batch_size: int  # per rank
    steps: int  # timed steps per side
    warmup: int
    workers: int
    timeout: float  # seconds a phase may last
    header: bool  # rank 0 prints the header line (the first run)
    world_sizes: tuple = ()  # of every run, in order
    earlier: tuple = ()  # the results of the runs before this one: the last run prints the table
    last: bool = True


# -- a rank: both sides of each mode, alternated --------------------------------------------------------

def build(name, device, seed=0) -> Workload:
    import torch

    builder, kind, shape, classes, default_batch = MODELS[name]
    torch.manual_seed(seed)
    if str(device) == "meta":  # its shapes only: nothing allocated, nothing initialised
        with torch.device("meta"):
            model, source = builder(torch)
    else:
        model, source = builder(torch)
    return Workload(name, model.to(device), source, kind, shape, classes, default_batch)


class Side:
    """One side of one mode in one rank: a wrapped model, its optimizer, scaler, loader (and monitor)."""

    def __init__(self, side, mode, settings, rank, world_size, device, dataset):
        import torch

        import hotloop

        self.torch, self.side, self.device = torch, side, device
        cuda = device.type == "cuda"
        self.amp_dtype = torch.float16 if cuda else None  # the CPU's bf16 kernels are far slower than its fp32 ones
        self.workload = build(settings.model, device)
        model = self.workload.model
        if mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (world_size,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        self.workload.model = wrapped  # the loss runs the wrapped model: its hooks reduce the gradients
        self.params = list(wrapped.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, fused=cuda)
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                                      seed=0, drop_last=True)
        common = dict(batch_size=settings.batch_size, sampler=sampler, num_workers=settings.workers, drop_last=True)
        if side == "hotloop":
            self.loader = hotloop.DataLoader(dataset, device=device if cuda else None, **common)
            self.scaler = hotloop.GradScaler(device.type)
            self.monitor = hotloop.MemoryMonitor(device=device, report=None) if cuda else None
        else:
            self.loader = torch.utils.data.DataLoader(dataset, pin_memory=cuda, **common)
            self.scaler = torch.amp.GradScaler(device.type)
            self.monitor = None
        self.it = iter(self.loader)
        self.loss = None
        self.block_s = []
        self.util = []

    def step(self):
        torch = self.torch
        inputs, targets = next(self.it)
        if self.side == "torch" and self.device.type == "cuda":
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            loss = self.workload.loss(inputs, targets)
        self.scaler.scale(loss).backward()
        if self.side == "hotloop":
            self.scaler.clip_grad_norm_(self.optimizer, max_norm=MAX_NORM)
        else:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, max_norm=MAX_NORM)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.loss = loss.detach()

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def block(self, steps):
        """Time `steps` steps, from one device sync to the next (the monitor across them, on hotloop's side)."""
        self.sync()
        if self.monitor is not None:
            self.monitor.start()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        self.block_s.append(time.perf_counter() - t0)
        if self.monitor is not None:
            self.util.append(self.monitor.stop().util_mean)

    def close(self):
        self.it = None  # ends the loader's workers
        self.loader = self.optimizer = self.workload = self.params = self.monitor = None


def blocks(steps):
    """The block sizes `steps` timed steps are split into: ROUNDS nearly equal ones (fewer if few steps)."""
    n = min(steps, ROUNDS)
    return [steps // n + (1 if i < steps % n else 0) for i in range(n)]


def _first_line(err):
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0] if text else type(err).__name__


def _measure_mode(mode, settings, rank, world_size, device, dataset, say, note):
    """This rank's figures of both sides of one mode: {side: {"error", "block_s", "final_loss", "util"}}."""
    import torch
    import torch.distributed as dist

    sides, errors = {}, {}
    for side in SIDES:
        say(f"{mode} {side}: build and {settings.warmup} warm-up steps")
        try:
            s = sides[side] = Side(side, mode, settings, rank, world_size, device, dataset)
            for _ in range(settings.warmup):
                s.step()
            s.sync()
        except Exception as err:
            # FSDP2 may not be takeable here (hotloop's scaler and DTensor gradients, a backend without
            # reduce-scatter): its row says why. A DDP failure ends the command.
            if mode != "fsdp2":
                raise
            errors[side] = f"rank {rank}: {_first_line(err)}"
            note(f"{mode} {side} left out: {errors[side]}")
            failed = sides.pop(side, None)
            if failed is not None:
                failed.close()
    if mode == "fsdp2":  # every rank must leave out the same sides, or the next collective waits forever
        say(f"{mode}: agree on the sides that run")
        everyone = [None] * world_size
        dist.all_gather_object(everyone, errors)
        for theirs in everyone:
            for side, message in theirs.items():
                errors.setdefault(side, message)
                if side in sides:
                    sides.pop(side).close()
    for i, size in enumerate(blocks(settings.steps)):
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        for side in order:
            if side in sides:
                say(f"{mode} {side}: timed block {i + 1} ({size} steps)")
                sides[side].block(size)
    figures = {}
    for side in SIDES:
        if side in sides:
            s = sides[side]
            figures[side] = {"error": None, "block_s": s.block_s, "final_loss": float(s.loss),
                             "util": [u for u in s.util if u is not None]}
            s.close()
        else:
            figures[side] = {"error": errors[side]}
    sides.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figures


def _combine(per_rank, settings, world_size):
    """One mode's figures from every rank's: a block lasts as long as its slowest rank."""
    sizes = blocks(settings.steps)
    out = {}
    for side in SIDES:
        mine = [r[side] for r in per_rank]
        if any(m["error"] for m in mine):
            out[side] = {"status": "n/a", "error": next(m["error"] for m in mine if m["error"])}
            continue
        block_s = [max(m["block_s"][i] for m in mine) for i in range(len(sizes))]
        total = sum(block_s)
        util = [u for m in mine for u in m["util"]]
        out[side] = {
            "status": "ok", "error": None, "seconds": total,
            "ms_per_step": total * 1e3 / settings.steps,
            "samples_per_s": settings.batch_size * world_size * settings.steps / total,
            "block_ms_per_step": [t * 1e3 / n for t, n in zip(block_s, sizes)],
            "rank_seconds": [sum(m["block_s"]) for m in mine],
            "final_loss": mine[0]["final_loss"],
            "gpu_util_pct": sum(util) / len(util) if util else None,
        }
    return out


def _rank_body(rank, world_size, say, note, settings):
    import torch
    import torch.distributed as dist

    cuda = settings.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    probe = build(settings.model, "meta")
    total_steps = settings.warmup + settings.steps
    dataset = loop.Samples(probe, total_steps * settings.batch_size * world_size)
    if rank == 0 and settings.header:
        name = f"{max(settings.world_sizes)} × {torch.cuda.get_device_name(device)}" if cuda else "CPU"
        print(f"hotloop bench distributed: {probe.name} ({probe.source}, {probe.parameters / 1e6:.3g} M parameters), "
              f"on {settings.device} ({name}), world size {' then '.join(map(str, settings.world_sizes))}, "
              f"torch {torch.__version__}, {dist.get_backend()}, "
              f"{'fp16 autocast' if cuda else 'fp32'}, batch {settings.batch_size} per rank, "
              f"{settings.warmup} warm-up + {settings.steps} timed steps per side in {len(blocks(settings.steps))} "
              f"alternated blocks, {settings.workers} loader workers per side"
              + ("" if cuda else ", no monitor on the CPU"), flush=True)
    del probe
    run = {"world_size": world_size, "modes": {}}
    for mode in MODES:
        mine = _measure_mode(mode, settings, rank, world_size, device, dataset, say, note)
        say(f"{mode}: gather the figures on rank 0")
        everyone = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        if rank == 0:
            run["modes"][mode] = _combine(everyone, settings, world_size)
            print("  " + progress_line(mode, run), flush=True)
    if rank != 0:
        return None
    if settings.last:
        print()
        print(format_table(summary_rows([*settings.earlier, run], settings.device)), flush=True)
    return run


# -- what rank 0 prints ----------------------------------------------------------------------------------

def _ranks(n, device):
    return f"{n} GPU{'s' if n > 1 else ''}" if device == "cuda" else f"{n} rank{'s' if n > 1 else ''}"


def progress_line(mode, run):
    figures = run["modes"][mode]
    parts = []
    for side in SIDES:
        f = figures[side]
        parts.append(f"{side} n/a ({f['error']})" if f["status"] != "ok" else
                     f"{side} {f['ms_per_step']:.1f} ms/step ({f['samples_per_s']:.1f} samples/s)")
    line = f"{mode}, world size {run['world_size']}: " + ", ".join(parts)
    if all(figures[s]["status"] == "ok" for s in SIDES):
        ratio = figures["hotloop"]["ms_per_step"] / figures["torch"]["ms_per_step"]
        line += f"; hotloop ÷ torch {ratio:.3f} in ms/step"
    return line


def summary_rows(runs, device):
    """The table: per mode, ms/step and samples/s at each world size, then the scaling from the first
    run's world size to the last's (samples/s over samples/s) for each side."""
    nan = float("nan")
    rows = []
    for mode in MODES:
        for run in runs:
            n = run["world_size"]
            figures = run["modes"][mode]
            note = "; ".join(f"{s} n/a: {figures[s]['error']}" for s in SIDES if figures[s]["status"] != "ok")
            for key, label, unit in (("ms_per_step", "ms/step", "ms"), ("samples_per_s", "samples/s", "samples/s")):
                value = {s: figures[s][key] if figures[s]["status"] == "ok" else nan for s in SIDES}
                rows.append(Row(mode, f"{label}, {_ranks(n, device)}", value["hotloop"], value["torch"], unit, note))
        if len(runs) > 1:
            first, last = runs[0], runs[-1]
            factor = last["world_size"] / first["world_size"]
            scaling = {}
            for s in SIDES:
                a, b = first["modes"][mode][s], last["modes"][mode][s]
                ok = a["status"] == "ok" and b["status"] == "ok"
                scaling[s] = b["samples_per_s"] / a["samples_per_s"] if ok else nan
            note = ", ".join(f"{s} {scaling[s] / factor:.0%}" for s in SIDES if not math.isnan(scaling[s]))
            rows.append(Row(mode, f"scaling {_ranks(first['world_size'], device)} → {last['world_size']}",
                            scaling["hotloop"], scaling["torch"], "x",
                            f"samples/s ratio; per-rank efficiency: {note}" if note else "n/a"))
    return rows


def _row_dict(row):
    out = dataclasses.asdict(row)
    out["ratio"] = row.ratio
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


# -- the command -----------------------------------------------------------------------------------------

def run(args, device):
    import torch

    cuda = device.type == "cuda"
    if args.device and ":" in args.device:
        raise BenchError(f"--device {args.device}: expected cuda or cpu (rank r runs on cuda:r)")
    model = args.model or ("gpt2-small" if cuda else "tiny-gpt")
    if model not in MODELS:
        raise BenchError(f"--model: unknown model {model!r} (choose from {', '.join(MODELS)})")
    gpus = torch.cuda.device_count() if cuda else None
    world_size = args.world_size or (min(2, gpus) if cuda else 2)
    if cuda and world_size > gpus:
        raise BenchError(f"--world-size {world_size}: one GPU per rank, and torch sees {gpus} here")
    workers = args.workers if args.workers is not None else (2 if cuda else 0)
    if workers < 0:
        raise BenchError(f"--workers: expected 0 or more, got {workers}")
    if args.timeout <= 0:
        raise BenchError(f"--timeout: expected a number of seconds > 0, got {args.timeout:g}")
    steps = args.steps or (30 if cuda else 3)
    batch = args.batch_size or MODELS[model][4]
    sizes = [1, world_size] if world_size > 1 else [1]
    runs = []
    base = Settings(model=model, device=device.type, batch_size=batch, steps=steps,
                    warmup=train.WARMUP_STEPS if cuda else 1,
                    workers=workers, timeout=float(args.timeout), header=True, world_sizes=tuple(sizes))
    for i, n in enumerate(sizes):
        settings = dataclasses.replace(base, header=i == 0, earlier=tuple(runs), last=i == len(sizes) - 1)
        try:
            results = launch(_rank_body, n, args=(settings,), backend="nccl" if cuda else "gloo",
                             timeout=settings.timeout)
        except RankFailed as err:
            sys.stdout.flush()
            print(f"\nrank {err.rank}, in phase {err.phase!r}:\n{err.detail.rstrip()}", file=sys.stderr)
            for line in err.then:
                print(line, file=sys.stderr)
            print(f"hotloop bench distributed: world size {n}: {err}", file=sys.stderr)
            return 1
        runs.append(results[0])
    if args.json:
        rows = summary_rows(runs, device.type)
        meta = {"model": model, "device": device.type, "torch": torch.__version__,
                "device_name": torch.cuda.get_device_name(device) if cuda else "CPU",
                "backend": "nccl" if cuda else "gloo", "amp_dtype": "float16" if cuda else None,
                "batch_size_per_rank": batch, "steps": steps, "warmup_steps": base.warmup, "workers": workers,
                "blocks": blocks(steps), "max_norm": MAX_NORM, "world_sizes": sizes}
        with open(args.json, "w") as f:
            json.dump({**meta, "runs": runs, "rows": [_row_dict(r) for r in rows]}, f, indent=2)
    return 0

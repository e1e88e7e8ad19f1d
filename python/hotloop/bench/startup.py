"""Benchmark rows for start-up: what a fresh process pays before its first step, hotloop's kernels
compiled by NVRTC (an empty cache) or read from the cache, against torch's own first step.

Each figure is one fresh interpreter per side (the cost is once per process), alternated, median of
a few; the GPU is initialised before the clock starts in both, so torch's CUDA start is not counted.

NOTE [ First compile on a machine ]
The empty-cache row compiles with NVRTC's library already in the page cache: a process before them
filled the cache, and its time is in the row's note. The first compile after a machine starts also reads NVRTC's ~100 MB from disk as
its pages are first touched, which costs seconds more, once per boot rather than once per process;
`hotloop compile` on a login node, or a warm cache, spares a training job both."""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

from .harness import Row

# One side's first step in a fresh process, after torch itself is warm (one step of torch's own on
# other tensors first: its lazily loaded kernels, cuBLAS and autograd are then paid for): hotloop's
# side imports hotloop, makes its AdamW and GradScaler and takes one step (its kernels are loaded, or
# compiled, at their first launch, inside it); torch's side makes a new fused AdamW and GradScaler
# and takes the same step. Timed to its completion on the GPU.
FIRST_STEP_SCRIPT = textwrap.dedent("""
    import json, sys, time
    side, device = sys.argv[1], sys.argv[2]
    import torch

    def one_step(make):
        p = torch.nn.Parameter(torch.randn(1 << 20, device=device))
        opt, scaler = make([p])
        scaler.scale((p * p).sum()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        torch.cuda.synchronize()

    def torch_way(params):
        return torch.optim.AdamW(params, lr=1e-3, fused=True), torch.amp.GradScaler(device)

    one_step(torch_way)
    t0 = time.perf_counter()
    parts = {}
    if side == "hotloop":
        import hotloop, hotloop.amp, hotloop.optim
        t1 = time.perf_counter()
        index = torch.device(device).index or 0
        for source in ("amp", "optim"):  # what the step would load at its first launch
            hotloop._C.kernels_load(index, source)
        t2 = time.perf_counter()
        one_step(lambda params: (hotloop.optim.AdamW(params, lr=1e-3), hotloop.GradScaler(device)))
        parts = {"imports_ms": (t1 - t0) * 1e3, "kernels_ms": (t2 - t1) * 1e3,
                 "step_ms": (time.perf_counter() - t2) * 1e3}
        loaded = hotloop._C.kernels_loaded(index)
    else:
        one_step(torch_way)
        loaded = []
    print(json.dumps({"first_step_ms": (time.perf_counter() - t0) * 1e3, "loaded": loaded, **parts}))
""")

# `import torch` alone and with hotloop after it: what hotloop adds to a script's start
IMPORT_SCRIPT = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    if sys.argv[1] == "hotloop":
        import hotloop
    t2 = time.perf_counter()
    print(json.dumps({"torch_ms": (t1 - t0) * 1e3, "hotloop_ms": (t2 - t1) * 1e3}))
""")


def _fresh(script, *args, env=None):
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600,
                         env=env)
    if out.returncode != 0:
        raise RuntimeError(f"the start-up bench's child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rows(ctx):
    reps = 1 if ctx.quick else 3
    imports = [_fresh(IMPORT_SCRIPT, "hotloop") for _ in range(reps)]
    torch_ms = statistics.median(i["torch_ms"] for i in imports)
    added = statistics.median(i["hotloop_ms"] for i in imports)
    # the same job on both sides, a script's imports: torch and hotloop, against torch alone
    yield Row("startup", "import torch + hotloop vs import torch alone, fresh process", torch_ms + added, torch_ms,
              "ms", note=f"hotloop adds {added:.1f} ms (median of {reps})")
    if not ctx.is_cuda:
        return
    device = str(ctx.device)
    with tempfile.TemporaryDirectory() as root:
        cached_env = dict(os.environ, HOTLOOP_CACHE_DIR=os.path.join(root, "cached"))
        # fills the cache, and reads NVRTC from disk once (see NOTE [ First compile on a machine ])
        first_on_machine = _fresh(FIRST_STEP_SCRIPT, "hotloop", device, env=cached_env)
        cold, cached, theirs = [], [], []
        for k in range(reps):
            # a new empty cache each time: every kernel source the step needs is compiled by NVRTC
            cold_env = dict(os.environ, HOTLOOP_CACHE_DIR=os.path.join(root, f"cold{k}"))
            cold.append(_fresh(FIRST_STEP_SCRIPT, "hotloop", device, env=cold_env))
            cached.append(_fresh(FIRST_STEP_SCRIPT, "hotloop", device, env=cached_env))
            theirs.append(_fresh(FIRST_STEP_SCRIPT, "torch", device))
    torch_ms = statistics.median(t["first_step_ms"] for t in theirs)
    loaded = ", ".join(cold[0]["loaded"])

    def median(part):
        return statistics.median(c[part] for c in cached)

    yield Row("startup", "first GradScaler + fused AdamW step, kernels in the cache", median("first_step_ms"),
              torch_ms, "ms", note=f"fresh process, torch warm in both; hotloop: imports {median('imports_ms'):.1f} "
                                   f"+ kernel load ({loaded}) {median('kernels_ms'):.1f} + step {median('step_ms'):.1f} ms")
    yield Row("startup", "first GradScaler + fused AdamW step, empty cache (NVRTC compiles)",
              statistics.median(c["first_step_ms"] for c in cold), torch_ms, "ms",
              note="runs: " + ", ".join(f"{c['first_step_ms']:.0f}" for c in cold) + " ms; once per machine and "
                   "kernel version; `hotloop compile` does it ahead; NVRTC already in the page cache (the "
                   f"process before them, which filled the cache: {first_on_machine['first_step_ms']:.0f} ms; "
                   "NOTE [ First compile on a machine ])")

"""`python -m hotloop bench inference`: the seed's inference comparison: eager fp32, fp16 channels_last,
CUDA graphs, torch.compile and Torch-TensorRT (when importable), as latency percentiles and throughput."""
import json
import time

from .workloads import BenchError, build, percentile

VARIANTS = ("eager", "fp16", "graphs", "compile", "tensorrt")
WARMUP = 20


def _fp16_channels_last(torch, model, x):
    return model.half().to(memory_format=torch.channels_last), x.half().contiguous(memory_format=torch.channels_last)


def _graphed(torch, model, x):
    """The fp16 channels_last model captured in a CUDA graph: a call is one replay, no per-kernel launches."""
    model, x = _fp16_channels_last(torch, model, x)
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream before capture, as torch's docs ask
        for _ in range(3):
            model(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(static)

    def call(inp):
        static.copy_(inp)
        graph.replay()
        return out
    return call, x


def _prepare(variant, torch, model, x, cuda):
    """(callable, input) for a variant, or a string saying why it is skipped here."""
    if variant == "eager":
        return model, x
    if not cuda and variant in ("fp16", "graphs", "tensorrt"):
        return {"fp16": "fp16 inference is a GPU path (the CPU has no fast fp16 convolutions)",
                "graphs": "CUDA graphs need a GPU", "tensorrt": "TensorRT needs a GPU"}[variant]
    if variant == "fp16":
        return _fp16_channels_last(torch, model, x)
    if variant == "graphs":
        return _graphed(torch, model, x)
    if variant == "compile":
        if cuda:
            model, x = _fp16_channels_last(torch, model, x)
        return torch.compile(model), x
    try:
        import torch_tensorrt
    except ImportError as err:
        return f"torch_tensorrt is not importable here ({err})"
    model, x = _fp16_channels_last(torch, model, x)
    trt = torch_tensorrt.compile(model, inputs=[torch_tensorrt.Input(tuple(x.shape), dtype=torch.half)],
                                 enabled_precisions={torch.half})
    return trt, x


LABELS = {"eager": "eager fp32", "fp16": "eager fp16 channels_last", "graphs": "CUDA graph fp16 channels_last",
          "compile": "torch.compile", "tensorrt": "Torch-TensorRT fp16"}


def latencies(torch, fn, x, iterations, cuda):
    """Milliseconds per call, each call timed alone (CUDA events around it on a GPU)."""
    with torch.inference_mode():
        for _ in range(WARMUP):
            fn(x)
        times = []
        for _ in range(iterations):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(x)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(x)
                times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)


def run(args, device):
    import torch

    cuda = device.type == "cuda"
    name = args.model or ("resnet18" if cuda else "tiny-cnn")
    if name not in ("resnet18", "resnet50", "tiny-cnn"):
        raise BenchError(f"--model: unknown model {name!r} for inference (choose from resnet18, resnet50, tiny-cnn)")
    variants = VARIANTS if args.variants is None else [v.strip() for v in args.variants.split(",")]
    for v in variants:
        if v not in VARIANTS:
            raise BenchError(f"--variants: unknown variant {v!r} (choose from {', '.join(VARIANTS)})")
    device_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"hotloop bench inference: {name}, batch {args.batch_size}, on {device} ({device_name}), "
          f"torch {torch.__version__}, {args.iterations} timed calls after {WARMUP}", flush=True)
    print(f"{'variant':<30} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'samples/s':>10}")
    rows = []
    for variant in variants:
        workload = build(name, device)
        model = workload.model.eval()
        x, _ = workload.batch(args.batch_size, device, torch.Generator(device=device).manual_seed(0))
        with torch.inference_mode():
            prepared = _prepare(variant, torch, model, x, cuda)
        if isinstance(prepared, str):
            print(f"{LABELS[variant]:<30} skipped: {prepared}", flush=True)
            rows.append({"variant": variant, "skipped": prepared})
            continue
        fn, inp = prepared
        times = latencies(torch, fn, inp, args.iterations, cuda)
        row = {"variant": variant, "p50_ms": percentile(times, 50), "p90_ms": percentile(times, 90),
               "p99_ms": percentile(times, 99), "samples_per_s": args.batch_size * 1e3 * len(times) / sum(times)}
        rows.append(row)
        print(f"{LABELS[variant]:<30} {row['p50_ms']:>8.3f} {row['p90_ms']:>8.3f} {row['p99_ms']:>8.3f} "
              f"{row['samples_per_s']:>10.1f}", flush=True)
        del fn, inp, prepared, model
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "batch_size": args.batch_size, "device": str(device),
                       "device_name": device_name, "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0

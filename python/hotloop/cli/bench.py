"""`python -m hotloop bench {components,train,loop,inference,distributed,report}`: components alternates hotloop's
way and torch's way of each job in one process (hotloop ÷ torch per figure; the rows are in hotloop/bench/);
train, loop and inference measure whole models (hotloop/bench/train.py, loop.py, inference.py); distributed
a DDP and an FSDP2 step in one process per rank (hotloop/bench/distributed.py); report writes the docs'
performance page and the README's table from components' JSON files (hotloop/bench/report.py)."""
import importlib
import math
import os
import sys
import time

from .. import _C, cuda_available
from ..bench import COMPONENTS


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive integer"  # argparse names the type in its message


def add_arguments(parser):
    sub = parser.add_subparsers(dest="what", metavar="{components,train,loop,inference,distributed,report}",
                                required=True)
    components = sub.add_parser("components", help="each component against torch's way of the same job")
    components.add_argument("--only", action="append", choices=sorted(COMPONENTS),
                            help="run only this component (repeatable)")
    components.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda when usable)")
    components.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run)")
    components.add_argument("--json", metavar="FILE",
                            help="also write the rows and settings (machine, versions, date, command) to this JSON file")

    train = sub.add_parser("train", help="samples/s, memory, utilisation and power per precision and batch size")
    train.add_argument("--model", default=None,
                       help="resnet50 (default on a GPU), vit_b_16, gpt2-medium, tiny-cnn (default on the CPU), tiny-gpt")
    train.add_argument("--precision", default=None,
                       help="comma-separated fp32,tf32,fp16,bf16 (default: those the device has)")
    train.add_argument("--batch-size", default=None,
                       help="'auto' (the largest that fits, per precision) or N,... (default: the model's seed size)")
    train.add_argument("--steps", type=_positive_int, default=20, help="timed steps per run (default 20)")
    train.add_argument("--channels-last", action="store_true", help="image models in channels_last")
    train.add_argument("--compile", action="store_true", help="torch.compile the model")
    train.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when usable)")
    train.add_argument("--csv", metavar="FILE", help="also write the rows to this CSV file")
    train.add_argument("--json", metavar="FILE", help="also write the rows and settings to this JSON file")
    train.add_argument("--plot", metavar="FILE.png", help="draw samples/s against batch size per precision")

    loop = sub.add_parser("loop", help="a whole training loop with hotloop's three pieces against torch's")
    loop.add_argument("--case", action="append", default=None,
                      help="resnet50, resnet50-jpeg, gpt2-medium (the default on a GPU), tiny-cnn, tiny-gpt (the "
                           "default on the CPU), tiny-cnn-jpeg; -jpeg: a folder of generated JPEGs, "
                           "gpu_decode against torchvision's transform in torch's workers")
    loop.add_argument("--steps", type=_positive_int, default=None, help="timed steps per loop (default 60; 6 on the CPU)")
    loop.add_argument("--workers", type=int, default=None, help="DataLoader workers (default min(8, cores))")
    loop.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when usable)")
    loop.add_argument("--json", metavar="FILE", help="also write the figures to this JSON file")

    inference = sub.add_parser("inference", help="latency percentiles of eager, fp16, CUDA graphs, compile, TensorRT")
    inference.add_argument("--model", default=None, help="resnet18 (default on a GPU), resnet50, tiny-cnn (default on the CPU)")
    inference.add_argument("--batch-size", type=_positive_int, default=1)
    inference.add_argument("--iterations", type=_positive_int, default=200, help="timed calls per variant (default 200)")
    inference.add_argument("--variants", default=None,
                           help="comma-separated eager,fp16,graphs,compile,tensorrt (default all)")
    inference.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when usable)")
    inference.add_argument("--json", metavar="FILE", help="also write the figures to this JSON file")

    distributed = sub.add_parser("distributed", help="a DDP and an FSDP2 step with hotloop's three pieces against "
                                                     "torch's, at world size 1 and N (one process per GPU)")
    distributed.add_argument("--model", default=None,
                             help="gpt2-small (default on GPUs), tiny-gpt (default on the CPU: a smoke run)")
    distributed.add_argument("--world-size", type=_positive_int, default=None,
                             help="ranks of the second run, one GPU each (default: 2, or 1 with one GPU)")
    distributed.add_argument("--steps", type=_positive_int, default=None,
                             help="timed steps per side and run (default 30; 3 on the CPU)")
    distributed.add_argument("--batch-size", type=_positive_int, default=None,
                             help="samples per rank and step (default: the model's, 8 for gpt2-small)")
    distributed.add_argument("--workers", type=int, default=None,
                             help="DataLoader workers per loader and rank (default 2; 0 on the CPU)")
    distributed.add_argument("--timeout", type=float, default=300.0,
                             help="seconds a rank may spend in one phase before the command ends (default 300)")
    distributed.add_argument("--device", default=None, help="cuda (NCCL) or cpu (gloo) (default: cuda when usable)")
    distributed.add_argument("--json", metavar="FILE", help="also write the figures to this JSON file")

    report = sub.add_parser("report", help="write docs/performance.md and the README's performance table from "
                                           "`bench components --json` files")
    report.add_argument("files", nargs="+", metavar="FILE.json", help="result files (docs/results/*.json)")
    report.add_argument("--readme", default="README.md", help="the README whose table to rewrite (default README.md)")
    report.add_argument("--performance", default=os.path.join("docs", "performance.md"), metavar="FILE",
                        help="the page to write (default docs/performance.md)")
    report.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each file that differs from what the results make")


def _device(args, command):
    """The torch.device to measure on, or None after saying on stderr why there is none."""
    import torch

    gpu = cuda_available() and torch.cuda.is_available()
    device = args.device or ("cuda" if gpu else "cpu")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        print(f"{command}: --device: expected cpu, cuda or cuda:N, got {device!r}", file=sys.stderr)
        return None
    if kind == "cuda" and not gpu:
        reason = _C.cuda_unavailable_reason() or "torch sees no CUDA device"
        print(f"{command}: --device {device}: no usable GPU here ({reason})", file=sys.stderr)
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _components(args, device):
    import torch

    from ..bench import results
    from ..bench.harness import Context, format_table

    ctx = Context(device, quick=args.quick)
    settings = results.components_settings(args, ctx)
    rows = []
    print(f"hotloop bench components on {args.device or device.type}"
          + (f" ({torch.cuda.get_device_name(ctx.device)})" if ctx.is_cuda else "")
          + f", torch {torch.__version__}", flush=True)
    started = time.perf_counter()
    for name in args.only or list(COMPONENTS):
        for row in importlib.import_module(COMPONENTS[name]).rows(ctx):
            rows.append(row)
            # the elapsed time says which rows a run's time goes to (a limit on it cuts the last ones)
            figures = (f"hotloop {row.hotloop:.4g} {row.unit}, torch {row.torch:.4g} {row.unit}"
                       if math.isfinite(row.hotloop) else row.note)  # a row that does not apply here has no figure
            print(f"  [{time.perf_counter() - started:.0f} s] {row.component}: {row.figure}: {figures}", flush=True)
    print()
    print(format_table(rows))
    if args.json:
        results.write_components(args.json, settings, rows)
    return 0


def _train(args, device):
    from ..bench import train, workloads

    args.model = args.model or ("resnet50" if device.type == "cuda" else "tiny-cnn")
    if args.model not in workloads.MODELS or args.model == "resnet18":
        raise workloads.BenchError(f"--model: unknown model {args.model!r} (choose from resnet50, vit_b_16, "
                                   f"gpt2-medium, gpt2-small, tiny-cnn, tiny-gpt)")
    args.precisions = (workloads.parse_list(args.precision, "precision") if args.precision
                       else workloads.default_precisions(device))
    args.batch_sizes = workloads.parse_batch_sizes(args.batch_size) if args.batch_size else None
    return train.run(args, device)


def _loop(args, device):
    from ..bench import loop

    return loop.run(args, device)


def _inference(args, device):
    from ..bench import inference

    return inference.run(args, device)


def _distributed(args, device):
    from ..bench import distributed

    return distributed.run(args, device)


SUBCOMMANDS = {"components": _components, "train": _train, "loop": _loop, "inference": _inference,
               "distributed": _distributed}


OUTPUT_FILES = ("csv", "json", "plot")  # the options that name a file written once the benchmark ends


def unwritable_output(args):
    """(option, error) for the first output file that cannot be written, or None. Checked before the
    benchmark runs, not after it (minutes later, its figures lost): opened for appending, which
    changes no file that exists, and removed again if this made it."""
    for option in OUTPUT_FILES:
        path = getattr(args, option, None)
        if not path:
            continue
        existed = os.path.lexists(path)
        try:
            with open(path, "a"):
                pass
        except OSError as err:
            return option, err
        if not existed:
            os.unlink(path)
    return None


def main(args) -> int:
    from ..bench.workloads import BenchError

    command = f"hotloop bench {args.what}" if args.what != "components" else "hotloop bench"
    bad = unwritable_output(args)
    if bad is not None:
        option, err = bad
        print(f"{command}: --{option} {getattr(args, option)}: cannot write it: {err.strerror or err}",
              file=sys.stderr)
        return 1
    try:
        if args.what == "report":  # measures nothing: no device, no torch
            from ..bench import report

            return report.run(args)
        device = _device(args, command)
        if device is None:
            return 2
        return SUBCOMMANDS[args.what](args, device)
    except BenchError as err:
        # after a benchmark's progress lines, on a line of its own
        print(f"\n{command}: {err}" if args.what not in ("components", "report") else f"{command}: {err}",
              file=sys.stderr)
        return 2
    except OSError as err:
        if isinstance(err, BrokenPipeError):
            raise  # stdout's reader went away: the command line says so
        print(f"{command}: cannot write {err.filename or 'a file'}: {err.strerror or err}", file=sys.stderr)
        return 1

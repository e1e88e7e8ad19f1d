"""`python -m hotloop bench components`: hotloop's way and torch's way of each job, alternated in one
process, printed as hotloop ÷ torch per figure (the rows are in hotloop/bench/)."""
import importlib
import sys

from .. import _C, cuda_available
from ..bench import COMPONENTS


def add_arguments(parser):
    sub = parser.add_subparsers(dest="what", metavar="{components}", required=True)
    components = sub.add_parser("components", help="each component against torch's way of the same job")
    components.add_argument("--only", action="append", choices=sorted(COMPONENTS),
                            help="run only this component (repeatable)")
    components.add_argument("--device", default=None, help="cuda:N or cpu (default: cuda when usable)")
    components.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run)")


def main(args) -> int:
    import torch

    from ..bench.harness import Context, format_table

    gpu = cuda_available() and torch.cuda.is_available()
    device = args.device or ("cuda" if gpu else "cpu")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        print(f"hotloop bench: --device: expected cpu, cuda or cuda:N, got {device!r}", file=sys.stderr)
        return 2
    if kind == "cuda" and not gpu:
        reason = _C.cuda_unavailable_reason() or "torch sees no CUDA device"
        print(f"hotloop bench: --device {device}: no usable GPU here ({reason})", file=sys.stderr)
        return 2
    ctx = Context(device, quick=args.quick)
    rows = []
    print(f"hotloop bench components on {device}"
          + (f" ({torch.cuda.get_device_name(ctx.device)})" if ctx.is_cuda else "")
          + f", torch {torch.__version__}", flush=True)
    for name in args.only or list(COMPONENTS):
        for row in importlib.import_module(COMPONENTS[name]).rows(ctx):
            rows.append(row)
            print(f"  {row.component}: {row.figure}: hotloop {row.hotloop:.4g} {row.unit}, "
                  f"torch {row.torch:.4g} {row.unit}", flush=True)
    print()
    print(format_table(rows))
    return 0

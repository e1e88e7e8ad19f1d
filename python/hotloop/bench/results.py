"""The JSON file of `bench components --json FILE`: its rows and the settings they were measured under
(machine, versions, date, the command that reproduces it), laid out as `bench train --json` lays out its
own: the settings at the top level beside "rows"."""
import dataclasses
import datetime
import json
import os
import platform
import shlex

from .._version import __version__


def cpu_name() -> str:
    """The processor's model name as the kernel reports it, or what platform knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def load_average():
    """The 1, 5 and 15 minute load averages (None where the system has none): how busy the machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def components_command(args) -> str:
    """The command line that measures the same rows again, rebuilt from the parsed options (so it is the
    same whether the command ran as `hotloop`, `python -m hotloop` or through cli.main(argv))."""
    words = ["python", "-m", "hotloop", "bench", "components"]
    for name in args.only or []:
        words += ["--only", name]
    if args.device:
        words += ["--device", args.device]
    if args.quick:
        words.append("--quick")
    if args.json:
        words += ["--json", args.json]
    return shlex.join(words)


def components_settings(args, ctx) -> dict:
    """What a row's figures depend on besides the code, taken when the run starts."""
    torch = ctx.torch
    return {
        "command": components_command(args),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(ctx.device),
        "device_name": torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else cpu_name(),
        "cpu_name": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load_average(),
        "hotloop": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "quick": bool(args.quick),
        "only": list(args.only) if args.only else None,
    }


def write_components(path, settings, rows):
    """Write the settings and rows; the load average at the end joins the settings (a busy machine's
    figures read differently)."""
    document = {**settings, "load_average_at_end": load_average(),
                "rows": [dataclasses.asdict(row) for row in rows]}
    with open(path, "w") as f:
        json.dump(document, f, indent=2)
        f.write("\n")

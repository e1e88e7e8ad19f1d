"""The command line, `python -m hotloop [--version] {demo,info,doctor,monitor,bench}`: one module per
command, each with add_arguments(parser) and main(args) -> exit code."""
import argparse
import importlib
import os
import sys

from .._version import __version__

# command -> (module, help)
COMMANDS = {
    "demo": ("hotloop.cli.demo", "a small CNN trained with hotloop and with torch alone, in alternated rounds: see what changes"),
    "info": ("hotloop.cli.info", "what hotloop was built with and what this machine offers"),
    "doctor": ("hotloop.cli.doctor", "check driver, torch, GPUs, PCIe, power and host settings; advise"),
    "monitor": ("hotloop.cli.monitor", "an nvidia-smi -l like logger: memory, utilisation, power, clocks, PCIe"),
    "bench": ("hotloop.cli.bench", "hotloop against torch, side by side in one process"),
    "compile": ("hotloop.cli.compile", "compile the CUDA kernels into the cache ahead of time (NVRTC)"),
}


def program_name() -> str:
    """How the user called us: `hotloop` (the console script) or `python -m hotloop`."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m hotloop" if name in ("__main__.py", "-c", "-m", "") else name


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommands (made with its class) refuse what they do not know
    themselves, with their own usage: argparse hands a subparser's unknown arguments back to the top
    parser, whose message then shows the top-level usage (`hotloop demo --nosuch` listed the
    commands, not demo's options). Everything after a subcommand's name is that subcommand's, so
    nothing it refuses could have been the parent's."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog=program_name(), description="hotloop: keep the GPU busy.")
    parser.add_argument("--version", action="version", version=f"hotloop {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # as argparse answers a missing required argument
        parser.print_help(sys.stderr)
        return 2
    command = f"{parser.prog} {args.command}"
    try:
        return importlib.import_module(args.module).main(args) or 0
    except BrokenPipeError:
        # the reader went away (`... | head`): nothing more goes to stdout, not even at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"{command}: its output was closed by the reader", file=sys.stderr)
        return 1
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        print(f"{command}: needs torch, which is not installed here (pip install torch)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

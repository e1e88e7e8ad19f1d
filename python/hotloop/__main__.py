"""The command line: `python -m hotloop [--version] {info,bench,...}`."""
import argparse
import importlib
import sys

from ._version import __version__

# subcommand -> (module, help); each module offers add_arguments(parser) (optional) and main(args)
SUBCOMMANDS = {
    "info": ("hotloop.info", "what hotloop was built with and what this machine offers"),
    "bench": ("hotloop.bench", "hotloop against torch, side by side in one process"),
    "monitor": ("hotloop.monitor_cli", "an nvidia-smi -l like logger: memory, utilisation, power, clocks, PCIe"),
    "doctor": ("hotloop.doctor", "check driver, torch, GPUs, PCIe, power and host settings; advise"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hotloop", description="hotloop: keep the GPU busy.")
    parser.add_argument("--version", action="version", version=f"hotloop {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(module=module)
        if name == "info":
            p.add_argument("--json", action="store_true", help="print the facts as JSON")
        else:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return importlib.import_module(args.module).main(args) or 0


if __name__ == "__main__":
    sys.exit(main())

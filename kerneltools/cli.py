"""``kerneltools <subcommand>`` (the console script scripts/setup-env.sh installs; ``python -m kerneltools`` is the
same): one module per subcommand.

Each module listed in SUBCOMMANDS defines ``add_parser(subparsers)``, which adds its subparser and calls
``set_defaults(_main=main)``, and ``main(args) -> int``. Keep module-level imports light (import torch,
huggingface_hub, ... inside ``main``): every module is imported to build the parser.
To add a subcommand, add one line below.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "kerneltools.build",  # build
    "kerneltools.hub.server",  # serve
    "kerneltools.hub.auth",  # hub-auth
    "kerneltools.publish",  # publish
    "kerneltools.bench",  # bench
    "kerneltools.demo",  # demo
    "kerneltools.bench.profile",  # profile
    "kerneltools.lock",  # prefetch
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kerneltools", description="Tooling for the GeGLU kernel package "
                                     "(also run as python -m kerneltools).")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_main", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args._main(args) or 0)

"""``python -m kerneltools <command>``: the repository's tooling entry point."""

import argparse
import sys

from . import build


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kerneltools", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m kerneltools.bench.model`` is not the command: it says which one is."""

import sys

if __name__ == "__main__":  # pragma: no cover
    print("use: python -m kerneltools bench --model NAME", file=sys.stderr)
    sys.exit(2)

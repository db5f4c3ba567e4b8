import sys

from kerneltools.cli import main

sys.exit(main())

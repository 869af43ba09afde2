"""`python -m fittrain`: the same command line as the `fittrain` console script."""

import sys

from fittrain.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())

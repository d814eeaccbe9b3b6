"""`python -m bcg ...`: the `bcg` command."""

import sys

from bcg.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m hpcpipe ...`: the command line (hpcpipe/cli/main.py)."""

import sys

from hpcpipe.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

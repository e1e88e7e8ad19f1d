"""`python -m hotloop`: the command line (hotloop/cli/)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

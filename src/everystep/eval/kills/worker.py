"""Entry point of a supervised training child: ``python -m everystep.eval.kills.worker SPEC JOURNAL``."""

import sys

from .train import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))

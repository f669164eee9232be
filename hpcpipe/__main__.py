"""`python -m hpcpipe ...`: the command line (hpcpipe/cli/main.py)."""

import signal
import sys

if __name__ == "__main__" and sys.argv[1:2] == ["train"] and hasattr(signal, "pthread_sigmask"):
    # Held until train's handlers are in (preemption.PreemptionWatch): a preemption signal
    # while the modules load and MPI starts (seconds on a busy node or a parallel file
    # system) killed the process (status 143), which a job script cannot tell from a
    # crash. Held from here, it waits for the handlers and is honoured.
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT))

from hpcpipe.cli.main import main  # noqa: E402 (after the signals are held)

if __name__ == "__main__":
    sys.exit(main())

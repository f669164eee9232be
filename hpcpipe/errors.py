"""The one base class for errors that are the user's to fix (bad config, missing data,
wrong launch). The command line prints them as one message from one rank and exits
non-zero; anything else is a bug and keeps its traceback."""


class HpcpipeError(Exception):
    """An error whose message is meant for the user as is."""


class LayoutError(HpcpipeError):
    """The job was launched with ranks that do not fit the config."""


# Exit status of a run that stopped on a preemption signal (SIGTERM or SIGUSR1) after
# writing a checkpoint: "try again later" (sysexits' EX_TEMPFAIL). Job scripts requeue on it.
EXIT_PREEMPTED = 75


def root_does(comm, fn):
    """Run fn on rank 0 only and share its user-facing failure with every rank, so all
    ranks stop together with the same message instead of the others waiting forever."""
    error = None
    result = None
    if comm.rank == 0:
        try:
            result = fn()
        except HpcpipeError as e:
            error = (type(e), str(e))
    error = comm.bcast(error, root=0)
    if error is not None:
        kind, message = error
        try:
            exc = kind(message)
        except TypeError:  # an error type built from more than its message
            exc = HpcpipeError(message)
        raise exc
    return result

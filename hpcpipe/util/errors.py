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


def os_error_text(error: BaseException) -> str:
    """An OSError in words, 'FILE: FILE2: what went wrong' (the file names it carries)."""
    names = [n for n in (getattr(error, "filename", None), getattr(error, "filename2", None))
             if n]
    what = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return ": ".join([*map(str, names), what])


def _described(error: BaseException):
    """(type, message) of a user-facing failure, to re-raise on other ranks."""
    if isinstance(error, HpcpipeError):
        return type(error), str(error)
    return HpcpipeError, os_error_text(error)


def _raise(error):
    kind, message = error
    try:
        exc = kind(message)
    except TypeError:  # an error type built from more than its message
        exc = HpcpipeError(message)
    raise exc


# What a rank may fail with that is the user's to fix, and so is shared with the others.
SHARED_FAILURES = (HpcpipeError, OSError, MemoryError)


def root_does(comm, fn):
    """Run fn on rank 0 only and share its user-facing failure (an HpcpipeError, or an
    OSError such as a full disk) with every rank, so all ranks stop together with the
    same message instead of the others waiting forever."""
    error = None
    result = None
    if comm.rank == 0:
        try:
            result = fn()
        except SHARED_FAILURES as e:
            error = _described(e)
    error = comm.bcast(error, root=0)
    if error is not None:
        _raise(error)
    return result


def every_rank_does(comm, fn):
    """Run fn on every rank; when it fails on any of them with a user-facing error, every
    rank raises the first such error (by rank), so that a problem one node sees alone
    (e.g. too little memory there) still stops the whole job together."""
    error = result = None
    try:
        result = fn()
    except SHARED_FAILURES as e:
        error = _described(e)
    errors = [e for e in comm.allgather(error) if e is not None]
    if errors:
        _raise(errors[0])
    return result


class ConfigError(HpcpipeError, ValueError):
    """A configuration the run cannot use; the message is meant for the user as is."""

    def __init__(self, source: str, key: str, value, problem: str):
        self.source, self.key, self.value, self.problem = source, key, value, problem
        shown = repr(value)
        if len(shown) > 80:  # a hostile value must not flood the one error line
            shown = shown[:77] + "..."
        super().__init__(f"{source}: {key} = {shown}: {problem}")

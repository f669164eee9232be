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

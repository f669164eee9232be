"""The last resort of an in-launcher pytest session (inlauncher.py): end the whole MPI job,
saying why, rather than let it hang until the allocation runs out.

A rank blocked in an MPI call cannot be interrupted, and its partners may be blocked too:
only MPI_Abort, which the launcher turns into the end of every rank, reliably stops them.
It is called when a test outlives its timeout (this timer, armed on every rank of the
test: each then says where it is), when a failed rank's partners do not reach the end of
the phase, or when the ranks disagree on which test comes next.
"""

import sys
import sysconfig
import threading
import time
import traceback

ABORT_STATUS = 1  # what the launcher returns: tests failed
LAST_WORDS_S = 1.0  # a timed-out rank waits this long before aborting: the others speak too
# Frames of the interpreter's library and installed packages (pytest, pluggy, mpi4py's
# runner) say nothing about where a test is stuck.
_LIBRARIES = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")}
                   | {"<frozen"})


def main_thread_stack() -> str:
    """Where this rank's main thread is: the frames of the tests and the code they test."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    frames = [f for f in traceback.extract_stack(frame) if not f.filename.startswith(_LIBRARIES)]
    return "".join(traceback.format_list(frames))


class Watchdog:
    def __init__(self, config, world):
        self._capture = config.pluginmanager.getplugin("capturemanager")
        self._world = world
        self._timer = None
        self.waiting = ""  # what the harness waits for, when the test itself is done

    def arm(self, what: str, seconds: float):
        """Abort the job unless disarmed within `seconds`."""
        self._timer = threading.Timer(seconds, self._expired, args=(what, seconds))
        self._timer.daemon = True
        self._timer.start()

    def disarm(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.waiting = ""

    def _expired(self, what: str, seconds: float):
        where = (f"this rank is done and waits for {self.waiting}" if self.waiting else
                 f"this rank is at:\n{main_thread_stack()}")
        self.abort(f"{what} still runs after its timeout of {seconds:g} s", where,
                   pause=LAST_WORDS_S)

    def abort(self, message: str, detail: str = "", pause: float = 0.0):
        """Print why on the real stderr (and `detail`), then MPI_Abort. Never returns."""
        if self._capture is not None:
            # The test's output capture holds stderr; what is said here must reach the
            # launcher's output before the job ends.
            self._capture.suspend_global_capture(in_=True)
        sys.stderr.write(f"\n[rank {self._world.rank} of {self._world.size}] {message}: "
                         f"aborting the MPI job\n{detail.rstrip()}\n")
        sys.stderr.flush()
        time.sleep(pause)
        self._world.Abort(ABORT_STATUS)

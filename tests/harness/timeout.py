"""`--test-timeout SECONDS`: a test that runs longer fails, named, instead of hanging the
whole run (make gpu-check's device tests run under it: a hung test costs its own time
limit and shows in the report as itself). A SIGALRM in the main thread, so it interrupts
Python code and waits on subprocesses alike; 0 (the default) sets no limit."""

import signal
import threading

import pytest


def pytest_addoption(parser):
    parser.addoption("--test-timeout", type=float, default=0.0, metavar="SECONDS",
                     help="fail a test that runs longer than this, naming it (0: no limit)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = item.config.getoption("--test-timeout")
    if not limit or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran past its {limit:g} s (--test-timeout)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

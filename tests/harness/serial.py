"""Which test modules launch MPI jobs, for conftest.py's `serial` split: a module is serial
when it can reach harness.mpirun's launchers (`run`, `launcher`, or the `mpirun` module
itself), directly or through a function of another test module (test_checkpoint_mpi's
`train`, say), or imports them inside a function. The plain helpers (`ROOT`, `job_env`,
`stop`, `launcher_variable`, and `run_python`, one process with no launcher) start
nothing across the cores and do not count.

What a module's functions use is read from their code objects (the global names each
looks up, nested functions included), following only functions defined under tests/,
so that hpcpipe's own code is never walked."""

import inspect
import os
import types

from harness import mpirun

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHERS = (mpirun.run, mpirun.launcher)
_LAUNCHER_NAMES = {f.__name__ for f in LAUNCHERS}


def launches(item, seen: dict) -> bool:
    """Whether the test `item` launches an MPI job: its module's namespace holds a launcher
    (its fixtures and helpers included), or its own function reaches one (an import inside
    it: then that test alone is serial, not its one-process neighbours). `seen` caches the
    functions already judged, across modules, and breaks cycles between test modules."""
    module = getattr(item, "module", None)
    if module is not None and any(_launches(value, seen) for name, value
                                  in list(vars(module).items()) if not _a_test(name)):
        return True
    return _launches(getattr(item, "function", None), seen)


def _a_test(name: str) -> bool:
    """A test function or class of the module: judged per test, by `launches`."""
    return name.startswith(("test", "Test"))


def _launches(value, seen: dict) -> bool:
    if value is mpirun or any(value is f for f in LAUNCHERS):
        return True
    if isinstance(value, type) and _in_tests(value):
        return any(_launches(v, seen) for v in vars(value).values())
    function = _test_function(value)
    if function is None:
        return False
    key = id(function)
    if key not in seen:
        seen[key] = False  # a cycle back here adds nothing
        seen[key] = _code_launches(function, function.__code__, seen)
    return seen[key]


def _test_function(value):
    """The plain function behind `value` (a fixture, a decorated test) when it is defined
    under tests/, else None."""
    function = inspect.unwrap(getattr(value, "_get_wrapped_function", lambda: value)())
    function = getattr(function, "__func__", function)  # a method, bound or static
    if not isinstance(function, types.FunctionType) or not _in_tests(function):
        return None
    return function


def _in_tests(value) -> bool:
    try:
        path = inspect.getfile(value)
    except (TypeError, OSError):
        return False
    return os.path.abspath(path).startswith(TESTS + os.sep)


def _code_launches(function, code: types.CodeType, seen: dict) -> bool:
    names = set(code.co_names)
    if (mpirun.__name__ in names and names & _LAUNCHER_NAMES) or {"harness", "mpirun"} <= names:
        return True  # `from harness.mpirun import run` (or `from harness import mpirun`) inside
    if any(name in function.__globals__ and _launches(function.__globals__[name], seen)
           for name in names):
        return True
    return any(_code_launches(function, const, seen) for const in code.co_consts
               if isinstance(const, types.CodeType))

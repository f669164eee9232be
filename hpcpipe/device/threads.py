"""A CPU rank's own thread pool: the independent pieces of a pass, spread over its cores.

BLAS would run the GEMMs on every core of the rank, but everything else in NumPy runs on
one core, and OpenBLAS's idle workers spin for a long while after each call, taking the
very cores other threads would need. So a rank runs BLAS on one thread
(`backend.limit_threads`) and spreads the work over this pool instead: `for_each` hands
the independent pieces of a pass (row blocks, sequences, GEMM chunks) to the threads;
NumPy and BLAS release the GIL while they compute, so the pieces run in parallel. The
pieces are cut from the shapes alone, never from the thread count, so the results are
bitwise the same on one core or many.

A pool belongs to one Backend (backend.py); nothing here is shared between pools.
"""

from __future__ import annotations

import itertools
import os
import threading


class _Worker:
    """One pool thread. It sleeps on a lock of its own and signals the end of a job on
    another: a job costs two lock handoffs (~15 µs), half of what a
    concurrent.futures pool takes, which adds up over a few hundred passes a step."""

    def __init__(self, slot: int, local: threading.local):
        self._slot, self._local = slot, local
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job = None
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name=f"hpcpipe-pool-{slot}", daemon=True).start()

    def _loop(self):
        self._local.slot = self._slot
        while True:
            self._go.acquire()
            job = self._job
            if job is None:  # stop()
                return
            try:
                job()
            except BaseException as error:  # handed to the caller by join()
                self._error = error
            self._done.release()

    def start(self, job):
        self._job = job
        self._go.release()

    def join(self) -> BaseException | None:
        self._done.acquire()
        error, self._error = self._error, None
        return error

    def stop(self):
        self.start(None)


class ThreadPool:
    """`size` threads (the caller's own among them) that share out the items of a pass.

    Workers start on the first parallel `for_each` and live until `stop`. A forked child
    has none of its parent's threads: the pool notices the new process and starts its own,
    never waiting on a lock a parent's thread held at the fork."""

    def __init__(self, size: int = 1):
        self.size = max(1, int(size))
        self._workers: list[_Worker] | None = None
        self._lock = threading.Lock()
        self._local = threading.local()  # .slot: a pool thread's, or a caller's inside for_each
        self._pid = os.getpid()

    def slot(self):
        """The slot of the calling thread inside a `for_each` item, else None."""
        return getattr(self._local, "slot", None)

    def stop(self):
        """End the worker threads (a later parallel `for_each` starts new ones)."""
        with self._lock:
            for worker in self._workers or ():
                worker.stop()
            self._workers = None

    def _after_fork(self):
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._workers, self._lock = None, threading.Lock()
            self._local = threading.local()

    def for_each(self, items, fn) -> None:
        """Call fn(item, slot) for every item: in order on one thread, or with several
        threads, each taking the next item not yet taken until none is left.

        Taking items as they come (rather than a fixed share each) keeps a thread that woke
        late, or met slower memory, from holding up the others. Which thread computes an
        item never changes its numbers: fn must only write what belongs to its item.
        `slot` (0 .. size - 1) names the thread: a temporary that `fn` takes from a
        scratch must carry it in its name, or two threads would share the buffer. A call
        from inside a pool thread, or while another thread's call holds the pool, runs in
        order on the calling thread."""
        self._after_fork()
        items = list(items)
        n = min(self.size, len(items))
        mine = self.slot()  # set: a call nested in a for_each item
        if n <= 1 or mine is not None or not self._lock.acquire(blocking=False):
            # In order, here. A nested call keeps its thread's slot; a thread of the user's
            # own, finding the pool busy, takes a slot named after itself.
            slot = mine if mine is not None else (
                0 if n <= 1 else f"thread-{threading.get_ident()}")
            for item in items:
                fn(item, slot)
            return
        self._local.slot = 0
        try:
            self._run_parallel(items, fn, n)
        finally:
            self._local.slot = None
            self._lock.release()

    def _run_parallel(self, items, fn, n: int):
        if self._workers is None:
            self._workers = [_Worker(k, self._local) for k in range(1, self.size)]
        taken = itertools.count()  # next() on it is atomic under the GIL
        count = len(items)

        def run(slot):
            while (i := next(taken)) < count:
                fn(items[i], slot)

        workers = self._workers[: n - 1]
        for slot, worker in enumerate(workers, start=1):
            worker.start(lambda slot=slot: run(slot))
        try:
            run(0)  # the calling thread starts at once
        finally:
            # No worker may still write when this returns or raises.
            errors = [worker.join() for worker in workers]
        for error in errors:
            if error is not None:
                raise error

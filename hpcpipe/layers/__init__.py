"""Hand-written transformer layers, each split into forward, B and W passes.

Every layer module offers the same three functions:

    forward(x, params, ...)        -> (y, cache)   cache: what the backward passes need
    backward_input(dy, cache)      -> dx           the B pass: gradient of the input only;
                                                   stores in `cache` what W still needs and
                                                   drops what only B needed
    backward_weight(dy, cache, grads)              the W pass: weight gradients, *added*
                                                   into `grads` (views of a flat buffer)

`params` and `grads` are dicts keyed by the layer's local parameter names ("weight",
"c_attn.bias", ...); `scope()` cuts a model-wide dict down to one layer's names. W of one
microbatch may run after the F and B of later microbatches: each call touches only its own
cache. Arrays handed to a cache are never modified afterwards.

Shape legend used throughout: B batch, T time (sequence), C channels (n_embd),
NH heads, HS head size (C // NH), V vocabulary.

Speed on the CPU comes from touching memory as little as possible: chains of elementwise
operations run `out=` / in place over row blocks small enough to stay in a core's L2
cache (`row_blocks`), and temporaries that die within one call live in `workspace`
buffers reused from call to call. What a cache keeps is always a fresh array, since W of
a microbatch may run after later microbatches' F and B have reused every workspace.

Threads on the CPU: BLAS would run the GEMMs on every core of the rank, but everything
else in NumPy runs on one core, and OpenBLAS's idle workers spin for a long while after
each call, taking the very cores other threads would need. So a rank runs BLAS on one
thread (`backend.limit_threads`) and spreads the work over its own pool instead:
`for_each` hands the independent pieces of a pass (row blocks, sequences, GEMM chunks)
to `threads()` threads; NumPy and BLAS release the GIL while they compute, so the pieces
run in parallel. The pieces are cut from the shapes alone, never from the thread count,
so the results are bitwise the same on one core or many.
"""

import itertools
import os
import threading

import numpy as np

# Target size of one row block on the CPU. Two opposite pulls: a chain of passes over a
# block should find it in cache (a core's L2, or its share of L3), and each NumPy call
# should run long enough that the threads rarely hand the GIL to each other, which costs
# tens of microseconds on a busy machine. 512 KiB measured best for GELU and LayerNorm on
# two threads (bench step's tiny and medium shapes; 128 KiB was 15-75 % slower).
# A GPU takes everything in one block: there, each pass is a kernel launch, which costs
# more than the memory traffic saved.
BLOCK_BYTES = 1 << 19

_workspaces: dict = {}
_threads = 1
_pool: list | None = None  # the _Workers, threads() - 1 of them
_pool_lock = threading.Lock()


def scope(named: dict, prefix: str) -> dict:
    """The entries of `named` under `prefix`, keyed by the rest of their name.

    scope({"h.0.ln_1.weight": w, ...}, "h.0.ln_1.") == {"weight": w}. The values are the
    same objects, so in-place updates reach the flat buffer behind them.
    """
    n = len(prefix)
    return {name[n:]: value for name, value in named.items() if name.startswith(prefix)}


def row_blocks(xp, rows: int, row_bytes: int):
    """Slices covering range(rows) in blocks of about BLOCK_BYTES (one block on a GPU).

    Depends only on the shapes, so every stage cuts the same tensor the same way."""
    step = max(1, rows) if xp is not np else max(1, BLOCK_BYTES // max(1, row_bytes))
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


def workspace(xp, name: str, shape, dtype):
    """A scratch array for temporaries that die within one call, reused across calls.

    One buffer per (name, shape, dtype): two uses alive at once need two names. Never hand
    a workspace to a cache or return it: the next call overwrites it.
    """
    key = (xp.__name__, name, tuple(shape), np.dtype(dtype).str)
    buf = _workspaces.get(key)
    if buf is None:
        buf = _workspaces[key] = xp.empty(shape, dtype=dtype)
    return buf


class _Worker:
    """One pool thread. It sleeps on a lock of its own and signals the end of a job on
    another: a job costs two lock handoffs (~15 µs), half of what a
    concurrent.futures pool takes, which adds up over a few hundred passes a step."""

    def __init__(self, slot: int):
        self._slot = slot
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job = None
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name=f"hpcpipe-pool-{slot}", daemon=True).start()

    def _loop(self):
        _local.slot = self._slot
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


_local = threading.local()  # .slot: the slot of a pool thread, or of a caller inside for_each


def _forget_pool_in_child():
    """A forked child has none of the parent's threads: start a pool of its own if it
    needs one, and never wait on a lock a parent's thread held at the fork."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()
    _local.__dict__.clear()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def set_threads(n: int) -> None:
    """Threads `for_each` uses on the CPU: the rank's cores, as for BLAS (limit_threads)."""
    global _threads, _pool
    n = max(1, int(n))
    with _pool_lock:
        if n != _threads and _pool is not None:
            for worker in _pool:
                worker.stop()
            _pool = None
        _threads = n


def threads() -> int:
    return _threads


def for_each(xp, items, fn) -> None:
    """Call fn(item, slot) for every item: in order on one thread, or on the CPU with
    several threads, each thread taking the next item not yet taken until none is left.

    Taking items as they come (rather than a fixed share each) keeps a thread that woke
    late, or met slower memory, from holding up the others. Which thread computes an
    item never changes its numbers: fn must only write what belongs to its item.
    `slot` (0 .. threads - 1) names the thread: a temporary that `fn` takes from
    `workspace` must carry it in its name, or two threads would share the buffer.
    A GPU runs everything in one stream, in order. A call from inside a pool thread, or
    while another thread's call holds the pool, runs in order on the calling thread.
    """
    items = list(items)
    n = min(_threads, len(items)) if xp is np else 1
    mine = getattr(_local, "slot", None)  # set: a call nested in a for_each item
    if n <= 1 or mine is not None or not _pool_lock.acquire(blocking=False):
        # In order, here. A nested call keeps its thread's slot; a thread of the user's
        # own, finding the pool busy, takes a slot named after itself.
        slot = mine if mine is not None else (
            0 if n <= 1 else f"thread-{threading.get_ident()}")
        for item in items:
            fn(item, slot)
        return
    global _pool
    _local.slot = 0
    try:
        if _pool is None:
            _pool = [_Worker(k) for k in range(1, _threads)]
        taken = itertools.count()  # next() on it is atomic under the GIL
        count = len(items)

        def run(slot):
            while (i := next(taken)) < count:
                fn(items[i], slot)

        workers = _pool[: n - 1]
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
    finally:
        _local.slot = None
        _pool_lock.release()


# Work is cut into chunks of about this many flops (~1 ms of one core; an elementwise
# pass counts one flop per element), a power of two in number so that they divide evenly
# among 1, 2, 4, ... threads, and at most MAX_CHUNKS.
CHUNK_FLOPS = 1 << 26
MAX_CHUNKS = 16
GEMM_SMALLEST = 64  # rows or columns of a GEMM chunk: thinner ones waste BLAS's kernels
K_SMALLEST = 256  # a chunk of the summed dimension: shorter ones make BLAS repack too often
MAX_K_CHUNKS = 8  # each one a partial product as large as the output


def cuts(size: int, work: float, smallest: int = 16, most: int = MAX_CHUNKS) -> list[slice]:
    """Slices cutting range(size) into a power-of-two number of near-equal chunks, as many
    as `work` (flops in all) pays for, none under `smallest` long, at most `most`.
    Shapes in, cuts out."""
    chunks = 1
    while (chunks * 2 <= most and work / (chunks * 2) >= CHUNK_FLOPS
           and size // (chunks * 2) >= smallest):
        chunks *= 2
    return [slice(size * k // chunks, size * (k + 1) // chunks) for k in range(chunks)]


def matmul(xp, a, b, out=None, bias=None):
    """out = a @ b (+ bias, broadcast over rows) for 2-D operands (any strides BLAS
    takes), into the 2-D array `out` (a fresh one, which the caller owns, when None).

    On the CPU the product is cut into chunks, one BLAS call each, spread over the
    threads. Where the summed dimension K is the long one (the weight gradients: x^T dy
    sums over every token), K is cut and the partial products are added in order: cutting
    the small output instead would make every chunk repack all of x. Otherwise the larger
    dimension of `out` is cut into whole rows or columns, and each chunk adds its bias
    while it is still in cache. The cuts depend only on the shapes, so the result is
    bitwise the same for any thread count. A GPU runs one call.
    """
    (M, K), N = a.shape, b.shape[1]
    if out is None:
        out = xp.empty((M, N), dtype=a.dtype)
    if xp is not np:
        xp.matmul(a, b, out=out)
        if bias is not None:
            out += bias
        return out
    work = 2.0 * M * N * K
    if bias is None and K >= 2 * max(M, N):
        ks = cuts(K, work, smallest=K_SMALLEST, most=MAX_K_CHUNKS)
        if len(ks) > 1:
            partial = workspace(xp, f"matmul.partial{getattr(_local, 'slot', None)}",
                                (len(ks), M, N), out.dtype)
            for_each(xp, range(len(ks)),
                     lambda i, slot: np.matmul(a[:, ks[i]], b[ks[i]], out=partial[i]))
            # Sum in chunk order, element by element, over row blocks on the threads.
            for_each(xp, row_blocks(xp, M, N * out.itemsize),
                     lambda r, slot: np.sum(partial[:, r], axis=0, out=out[r]))
            return out
    by_rows = M >= N
    parts = cuts(M if by_rows else N, work, smallest=GEMM_SMALLEST)

    def chunk(c, slot):
        if by_rows:
            np.matmul(a[c], b, out=out[c])
            if bias is not None:
                out[c] += bias
        else:
            np.matmul(a, b[:, c], out=out[:, c])
            if bias is not None:
                out[:, c] += bias[c]

    for_each(xp, parts, chunk)
    return out


def column_sums(xp, x, out):
    """out += x.sum(axis=0) for 2-D x (N, C): the bias gradients.

    Cut by columns over the threads; every column is summed over the rows in order, as
    NumPy does, whatever the cut. (NumPy's sum down the rows is a plain vectorised pass:
    faster here than a ones-vector product through BLAS.)"""
    if xp is not np:
        out += x.sum(axis=0)
        return

    def chunk(c, slot):
        out[c] += x[:, c].sum(axis=0)

    for_each(xp, cuts(x.shape[1], x.size, smallest=64), chunk)

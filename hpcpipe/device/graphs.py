"""CUDA graphs: a device call captured once its shapes are fixed, replayed after, so that
one graph launch replaces its hundreds of kernel launches (an H100's host took 45 µs per
CuPy launch, an H200's 91: 353 of them a step are 16-32 ms of host time).

    graphs = Graphs(be)                  # refused (GraphError) where none can run
    out = graphs.run(key, fn, x)         # 1st: eager; 2nd: captured; then replayed

`x`: device arrays the caller passes anew each time (copied into the graph's own before a
replay); arrays `fn` reads that stay the same objects call after call (parameters,
gradient buffers, a batch buffer) it closes over instead, read in place.

`key` names the call: its shapes and every host value `fn` bakes into its launches (a
kernel's scalar arguments are recorded by value); a new key is a new graph. The first call
of a key runs `fn` eagerly (kernels compiled and looked up, workspaces made, the memory
pool warm), the second captures it and launches the graph, later ones copy their inputs
into the graph's own and launch it. What `fn` returns is the same arrays at every replay,
rewritten in place: the caller is done with one replay's outputs before the next.

What capture cannot take, and the reason it is refused with:
- a backend without stream capture: NumPy (the CPU) has no graphs;
- a host synchronisation or transfer inside (`.get()`, `float()`, a stream sync, `.set()`):
  capture fails on a GPU; the device stand-in raises at the first one;
- MPI inside (tensor parallelism's collectives, ZeRO-3's gathers): a captured graph never
  calls the host again, so no message would be sent — callers refuse those layouts;
- memory: every array made during capture stays the graph's (a private memory pool per
  graph, as PyTorch's), so what a replay writes is never another array's; after a
  capture the default pool gives back the blocks the eager call left cached, and
  `forget` drops a graph with what its pool holds.

On the device stand-in (tests) a "capture" runs `fn` with the device's host syncs and
transfers forbidden, and a "replay" runs it again and copies its results into the captured
outputs: the discipline (no sync, fixed inputs and outputs) is checked, the speed is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcpipe.util.errors import HpcpipeError


class GraphError(HpcpipeError):
    """A call that cannot be captured (the reason says why)."""


def _arrays(out):
    """The device arrays of a call's result (an array, a tuple of them, or None)."""
    if out is None:
        return ()
    if isinstance(out, (tuple, list)):
        return tuple(a for a in out if hasattr(a, "shape"))
    return (out,) if hasattr(out, "shape") else ()


@dataclass
class _Graph:
    inputs: tuple           # the graph's own input arrays (static addresses)
    out: object             # what fn returned at capture
    graph: object = None    # cupy.cuda.graph.Graph; None on the stand-in
    pool: object = None     # its private memory pool (CuPy)
    fn: object = None       # the stand-in replays the call itself
    replays: int = 0


@dataclass
class Graphs:
    """The graphs of one backend, by key."""

    be: object
    _seen: set = field(default_factory=set)
    _graphs: dict = field(default_factory=dict)

    def __post_init__(self):
        why = refusal(self.be)
        if why:
            raise GraphError(why)

    def run(self, key, fn, *inputs):
        """fn(*inputs), eagerly the first time for `key`, captured the second, replayed
        after (inputs copied into the graph's own arrays first)."""
        if key not in self._seen:
            self._seen.add(key)
            return fn(*inputs)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(key, fn, inputs)
            return graph.out
        self._replay(graph, inputs)
        return graph.out

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def forget(self, key):
        """Drop `key`'s graph and give back what its pool holds that nothing else
        references: the next call of `key` is eager again, then captured."""
        self._seen.discard(key)
        graph = self._graphs.pop(key, None)
        if graph is not None and graph.pool is not None:
            pool = graph.pool
            del graph
            pool.free_all_blocks()

    def _capture(self, key, fn, inputs) -> _Graph:
        xp = self.be.xp
        own = tuple(xp.empty_like(x) for x in inputs)
        for mine, x in zip(own, inputs):
            mine[...] = x
        if is_standin(xp):
            with _no_host_work(xp, key):
                out = fn(*own)
            return _Graph(own, out, fn=fn)
        return _capture_cupy(xp, key, fn, own)

    def _replay(self, graph: _Graph, inputs):
        for mine, x in zip(graph.inputs, inputs):
            mine[...] = x
        graph.replays += 1
        if graph.graph is not None:
            graph.graph.launch(self.be.xp.cuda.get_current_stream())
            return
        with _no_host_work(self.be.xp, "a replay"):
            fresh = _arrays(graph.fn(*graph.inputs))
        for kept, new in zip(_arrays(graph.out), fresh):
            if kept is not new:
                kept[...] = new  # the same arrays at every replay, as a graph's are


def is_standin(xp) -> bool:
    """Whether `xp` is the device stand-in (hpcpipe/devtools/standin.py)."""
    return getattr(xp, "__version__", "") == "stand-in"


def refusal(be) -> str | None:
    """Why `be` cannot run CUDA graphs, or None."""
    if not getattr(be, "is_gpu", False):
        return "CUDA graphs need a GPU (the CPU's NumPy has no stream capture)"
    xp = be.xp
    if is_standin(xp):
        return None
    stream = getattr(getattr(xp, "cuda", None), "Stream", None)
    if stream is None or not hasattr(stream, "begin_capture"):
        return (f"this device library ({getattr(xp, '__name__', xp)}) has no stream "
                f"capture (CuPy 10 or later has)")
    return None


class _no_host_work:
    """Inside: the stand-in's host syncs and transfers raise (a capture could not have
    them)."""

    def __init__(self, xp, what):
        self.xp, self.what = xp, what

    def __enter__(self):
        self.before = {k: self.xp.counts.get(k, 0) for k in
                       ("synchronize", "host_to_device", "device_to_host")}

    def __exit__(self, kind, value, tb):
        after = {k: self.xp.counts.get(k, 0) for k in self.before}
        moved = {k: after[k] - self.before[k] for k in after if after[k] != self.before[k]}
        if moved and kind is None:
            raise GraphError(f"cannot capture {self.what} as a CUDA graph: it synchronises "
                             f"with the host or moves data between host and device inside "
                             f"({', '.join(f'{k} ×{n}' for k, n in moved.items())})")
        return False


def _capture_cupy(xp, key, fn, own) -> _Graph:
    """fn(*own) captured on a side stream, its allocations from a pool of its own."""
    pool = xp.cuda.MemoryPool()
    xp.cuda.get_current_stream().synchronize()  # (once, at capture: the inputs are ready)
    stream = xp.cuda.Stream(non_blocking=True)
    try:
        with xp.cuda.using_allocator(pool.malloc), stream:
            stream.begin_capture()
            try:
                out = fn(*own)
            finally:
                graph = stream.end_capture()
    except Exception as e:  # CUDA refuses what it cannot capture: say which call
        raise GraphError(f"cannot capture {key} as a CUDA graph: {e}") from e
    graph.launch(xp.cuda.get_current_stream())
    # What the eager call left cached in the default pool, the graph's pool now holds its
    # own copy of: give it back, or a graphed step would reserve its working set twice.
    xp.get_default_memory_pool().free_all_blocks()
    return _Graph(own, out, graph=graph, pool=pool)

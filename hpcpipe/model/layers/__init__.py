"""Hand-written transformer layers, each split into forward, B and W passes.

Every layer module offers the same three functions:

    forward(x, params, ..., be=None) -> (y, cache)   cache: what the backward passes need
    backward_input(dy, cache)        -> dx           the B pass: gradient of the input only
    backward_weight(dy, cache, grads)                the W pass: weight gradients, *added*
                                                     into `grads` (views of a flat buffer)

`params` and `grads` are dicts keyed by the layer's local parameter names ("weight",
"c_attn.bias", ...); `scope()` cuts a model-wide dict down to one layer's names. `be` is
the rank's Backend (backend.py): its array library, its thread pool and its scratch
arrays. F records it in the cache (`cache["be"]`), so B and W compute on the backend F
ran on; a layer called on its own, without one, gets a one-thread backend for its input's
library (`Backend.of`).

The B → W hand-off. W of one microbatch may run after the F and B of later microbatches,
so everything W needs travels in that microbatch's own cache, never in shared state:
- F stores what both backward passes read (the inputs of the weight GEMMs, normalised
  activations, statistics).
- B reads it, drops what only B needed (attention's probabilities, GELU's derivative,
  the loss's softmax, LayerNorm's normalised input: freed as early as possible) and
  *adds* to the cache what only W needs: the output gradients of its weight GEMMs
  (`cache["dqkv"]`, `cache["dh"]`; a block keeps its sublayers' output gradients under
  `cache["d"]`). LayerNorm's weight gradients are two sums over the rows, cheap next to a
  GEMM: B takes them at once (`cache["dparams"]`) rather than keep xhat and dy for W.
- W pops those gradients and multiplies them with the stashed inputs.
So after B a cache holds exactly what the weight GEMMs need — the zero-bubble paper's
M_W, less than F's M_B — and after W nothing of the microbatch is left but what the
caller still references. Arrays handed to a cache are never modified afterwards.

Shape legend used throughout: B batch, T time (sequence), C channels (n_embd),
NH heads, HS head size (C // NH), V vocabulary.

Speed on the CPU comes from touching memory as little as possible: chains of elementwise
operations run `out=` / in place over row blocks small enough to stay in a core's L2
cache (`row_blocks`), and temporaries that die within one call live in the backend's
workspaces (`be.scratch.workspace`), reused from call to call. What a cache keeps is
always a fresh array, since W of a microbatch may run after later microbatches' F and B
have reused every workspace. The independent pieces of a pass (row blocks, sequences,
GEMM chunks) go to the rank's threads (`be.for_each`, threads.py); the pieces are cut
from the shapes alone, never from the thread count, so the results are bitwise the same
on one core or many.
"""

import numpy as np

from hpcpipe.device import gemm
from hpcpipe.device.backend import Backend
from hpcpipe.device.dtypes import is_16bit

# Target size of one row block on the CPU. Two opposite pulls: a chain of passes over a
# block should find it in cache (a core's L2, or its share of L3), and each NumPy call
# should run long enough that the threads rarely hand the GIL to each other, which costs
# tens of microseconds on a busy machine. 512 KiB measured best for GELU and LayerNorm on
# two threads (bench step's tiny and medium shapes; 128 KiB was 15-75 % slower).
# A GPU takes everything in one block: there, each pass is a kernel launch, which costs
# more than the memory traffic saved.
BLOCK_BYTES = 1 << 19


def scope(named: dict, prefix: str) -> dict:
    """The entries of `named` under `prefix`, keyed by the rest of their name.

    scope({"h.0.ln_1.weight": w, ...}, "h.0.ln_1.") == {"weight": w}. The values are the
    same objects, so in-place updates reach the flat buffer behind them.
    """
    n = len(prefix)
    return {name[n:]: value for name, value in named.items() if name.startswith(prefix)}


def backend_for(x, be: Backend | None) -> Backend:
    """The backend a forward pass runs on: the caller's, or one for `x`'s library."""
    return be if be is not None else Backend.of(x)


def row_blocks(be: Backend, rows: int, row_bytes: int):
    """Slices covering range(rows) in blocks of about BLOCK_BYTES (one block on a GPU).

    Depends only on the shapes, so every stage cuts the same tensor the same way."""
    step = max(1, rows) if be.is_gpu else max(1, BLOCK_BYTES // max(1, row_bytes))
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


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


def wide(dtype) -> np.dtype:
    """The dtype a layer computes in for arrays stored as `dtype`: float32 for 16-bit
    storage (GEMMs accumulate and statistics are taken in float32, as GPUs do), the
    storage dtype otherwise."""
    return np.dtype(np.float32) if is_16bit(dtype) else np.dtype(dtype)


def widen(be: Backend, a, name: str):
    """`a` in its compute dtype (`wide`): itself, or a float32 copy in workspace `name`
    (which must carry the caller's thread slot)."""
    if not is_16bit(a.dtype):
        return a
    out = be.scratch.workspace(name, a.shape, np.float32)
    out[...] = a
    return out


def matmul(be: Backend, a, b, out=None, bias=None):
    """out = a @ b (+ bias, broadcast over rows) for 2-D operands (any strides BLAS
    takes), into the 2-D array `out` (a fresh one of a's dtype, which the caller owns,
    when None).

    16-bit operands are multiplied in float32 and the result rounded once into `out`
    (bias included): GPUs accumulate 16-bit GEMMs in float32 too, and NumPy has no 16-bit
    BLAS (its float16 matmul is a plain loop, 50x slower than float32's).

    On the CPU the product is cut into chunks, one BLAS call each, spread over the
    threads. Where the summed dimension K is the long one (the weight gradients: x^T dy
    sums over every token), K is cut and the partial products are added in order: cutting
    the small output instead would make every chunk repack all of x. Otherwise the larger
    dimension of `out` is cut into whole rows or columns, and each chunk adds its bias
    while it is still in cache. The cuts depend only on the shapes, so the result is
    bitwise the same for any thread count. A GPU runs one call.
    """
    xp = be.xp
    (M, K), N = a.shape, b.shape[1]
    if out is None:
        out = xp.empty((M, N), dtype=a.dtype)
    compute = wide(out.dtype) if is_16bit(a.dtype) or is_16bit(b.dtype) else out.dtype
    if be.is_gpu:
        _gpu_matmul(be, a, b, out, bias)
        return out
    if compute != b.dtype:
        b = b.astype(compute)  # once: every chunk reads all of b
    if bias is not None and bias.dtype != compute:
        bias = bias.astype(compute)
    work = 2.0 * M * N * K
    if bias is None and K >= 2 * max(M, N):
        ks = cuts(K, work, smallest=K_SMALLEST, most=MAX_K_CHUNKS)
        if len(ks) > 1:
            _matmul_by_k(be, a, b, out, ks, compute)
            return out
    by_rows = M >= N
    parts = cuts(M if by_rows else N, work, smallest=GEMM_SMALLEST)
    if not by_rows and a.dtype != compute:
        a = a.astype(compute)

    def chunk(c, slot):
        rows = a[c] if by_rows else a
        if rows.dtype != compute:
            rows = widen(be, rows, f"matmul.a{slot}")
        cols = b if by_rows else b[:, c]
        target = out[c] if by_rows else out[:, c]
        product = target if out.dtype == compute else be.scratch.workspace(
            f"matmul.out{slot}", target.shape, compute)
        np.matmul(rows, cols, out=product)
        if bias is not None:
            product += bias if by_rows else bias[c]
        if product is not target:
            target[...] = product

    be.for_each(parts, chunk)
    return out


def _matmul_by_k(be: Backend, a, b, out, ks, compute):
    """out = a @ b as partial products over the cuts `ks` of K, added in chunk order."""
    M, N = out.shape
    partial = be.scratch.workspace(f"matmul.partial{be.slot()}", (len(ks), M, N), compute)

    def product(i, slot):
        piece = a[:, ks[i]]
        if piece.dtype != compute:
            piece = widen(be, piece, f"matmul.k{slot}")
        np.matmul(piece, b[ks[i]], out=partial[i])

    be.for_each(range(len(ks)), product)

    # Sum in chunk order, element by element, over row blocks on the threads.
    def add(r, slot):
        if out.dtype == compute:
            np.sum(partial[:, r], axis=0, out=out[r])
        else:
            out[r] = np.sum(partial[:, r], axis=0)

    be.for_each(row_blocks(be, M, N * out.itemsize), add)


def _gpu_matmul(be: Backend, a, b, out, bias):
    """One library call. Operands and output of one dtype go as they are (cuBLAS
    accumulates 16-bit GEMMs in float32 and rounds once); 16-bit operands with a wider
    output (the weight gradients, accumulated in float32) are widened first."""
    xp = be.xp
    if not (a.dtype == b.dtype == out.dtype):
        a, b = a.astype(out.dtype, copy=False), b.astype(out.dtype, copy=False)
    xp.matmul(a, b, out=out)
    if bias is not None:
        out += bias


def matmul_accumulate(be: Backend, a, b, out, workspace: str):
    """out += a @ b for 2-D operands: the weight gradients, added into the gradient
    buffer. On a device, 16-bit operands into a float32 `out` are one cuBLAS gemmEx with
    beta = 1 (tensor cores, fp32 accumulation, no widened copies, no separate add:
    device/gemm.py); otherwise the product goes through workspace `workspace` and is
    added after (`matmul`'s rules, the CPU's bits; also a device backend made with
    fused=False, the cost model's "before")."""
    if (be.is_gpu and be.fused and is_16bit(a.dtype) and a.dtype == b.dtype
            and np.dtype(out.dtype) == np.float32):
        gemm.accumulate(be.xp, a, b, out)
        return
    product = be.scratch.workspace(workspace, out.shape, out.dtype)
    matmul(be, a, b, product)
    out += product


def column_sums(be: Backend, x, out):
    """out += x.sum(axis=0) for 2-D x (N, C): the bias gradients.

    Cut by columns over the threads; every column is summed over the rows in order, as
    NumPy does, whatever the cut. (NumPy's sum down the rows is a plain vectorised pass:
    faster here than a ones-vector product through BLAS.)"""
    if be.is_gpu:
        out += x.sum(axis=0, dtype=out.dtype)
        return

    def chunk(c, slot):
        out[c] += x[:, c].sum(axis=0, dtype=out.dtype)

    be.for_each(cuts(x.shape[1], x.size, smallest=64), chunk)

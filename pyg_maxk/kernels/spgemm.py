"""Forward SpGEMM (CSR x CBSR -> dense) and backward SSpMM (the gradient of
the CBSR values), both row-wise over the same balanced work items.

A work item is a run of at most ``max_edges`` edges of one CSR row (see
:class:`pyg_maxk.graph.WorkSchedule`); one thread block takes one item at a
time (grid-stride), so a row of 50,000 edges is spread over many blocks while
short rows cost one block each.

Forward, for item (row r, edges e0..e1)::

    buf[:] = 0                                  # shared memory, dim floats
    for every (edge e, slot j), one per thread:
        buf[indices[col[e], j]] += a_e * values[col[e], j]   # shared atomics
    out[r, :] = buf      (atomic adds when the row spans several items)

Backward (outer-product style, from the same CSR)::

    buf[:] = grad_out[r, :]                     # staged once per item
    for every (edge e, slot j):
        grad_values[col[e], j] += a_e * buf[indices[col[e], j]]   # global atomics

The threads of a block walk the ``(edge, slot)`` pairs in order, so the ``k``
slots of one neighbour are read and (backward) updated by adjacent threads:
coalesced loads of ``values``/``indices`` and coalesced atomics. The CBSR
arrays are passed flattened (``[N * k]``) and indexed with uint32 arithmetic.
"""
from __future__ import annotations

import functools

from ._numba import cuda_module

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32, uint32  # noqa: E402 (after the numpy shim)


WARP = 32


@functools.lru_cache(maxsize=None)
def _pair_function(k: int):
    """Device function: pair ``t`` of the item starting at edge ``e0`` ->
    (edge, flat CBSR slot ``source * k + j``), in uint32 arithmetic."""
    kk = uint32(k)

    @cuda.jit(device=True, inline=True)
    def pair(t, e0, col):
        q = t // kk
        e = e0 + q
        return e, uint32(col[e]) * kk + (t - q * kk)

    return pair


@functools.lru_cache(maxsize=None)
def spgemm_kernel(dim: int, k: int, threads: int, weighted: bool):
    """The compiled forward kernel for one ``(dim, k, threads, weighted)``.

    ``values``/``indices`` are the flattened ``[N * k]`` CBSR arrays. Every
    warp accumulates into a private shared row (``warps x dim`` floats), so
    warps never contend for one address. Measured on an H200 (Reddit-shaped
    graph, k=32, dim 256): uint32 index arithmetic (no negative-index
    wraparound code) took the kernel from 21.7 to 16.5 ms; the private rows
    changed nothing measurable (16.6 ms), so contention between warps is not
    the limit; the shared atomics themselves are (6.7 ms with plain, racy
    stores instead).
    """
    warps = threads // WARP
    kk = uint32(k)
    pair = _pair_function(k)

    @cuda.jit
    def spgemm(item_row, item_start, item_end, item_split, col, weight,
               values, indices, out, num_items):
        buf = cuda.shared.array((warps, dim), float32)
        tid = cuda.threadIdx.x
        warp = tid // WARP
        for item in range(cuda.blockIdx.x, num_items, cuda.gridDim.x):
            r = item_row[item]
            for d in range(tid, dim, threads):
                for w in range(warps):
                    buf[w, d] = float32(0.0)
            cuda.syncthreads()
            e0 = uint32(item_start[item])
            num_pairs = uint32(item_end[item] - item_start[item]) * kk
            t = uint32(tid)
            while t < num_pairs:
                e, slot = pair(t, e0, col)
                v = values[slot]
                if weighted:
                    v *= weight[e]
                cuda.atomic.add(buf, (warp, indices[slot]), v)
                t += uint32(threads)
            cuda.syncthreads()
            split = item_split[item]
            for d in range(tid, dim, threads):
                acc = buf[0, d]
                for w in range(1, warps):
                    acc += buf[w, d]
                if split:
                    if acc != 0:
                        cuda.atomic.add(out, (r, d), acc)
                else:
                    out[r, d] = acc
            cuda.syncthreads()

    return spgemm


@functools.lru_cache(maxsize=None)
def sspmm_kernel(dim: int, k: int, threads: int, weighted: bool):
    """The compiled backward kernel for one ``(dim, k, threads, weighted)``;
    ``indices`` and ``grad_values`` are flattened ``[N * k]`` arrays."""
    kk = uint32(k)
    pair = _pair_function(k)

    @cuda.jit
    def sspmm(item_row, item_start, item_end, col, weight, indices, grad_out,
              grad_values, num_items):
        buf = cuda.shared.array(dim, float32)
        tid = cuda.threadIdx.x
        for item in range(cuda.blockIdx.x, num_items, cuda.gridDim.x):
            r = item_row[item]
            for d in range(tid, dim, threads):
                buf[d] = grad_out[r, d]
            cuda.syncthreads()
            e0 = uint32(item_start[item])
            num_pairs = uint32(item_end[item] - item_start[item]) * kk
            t = uint32(tid)
            while t < num_pairs:
                e, slot = pair(t, e0, col)
                g = buf[indices[slot]]
                if weighted:
                    g *= weight[e]
                cuda.atomic.add(grad_values, slot, g)
                t += uint32(threads)
            cuda.syncthreads()

    return sspmm

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
coalesced loads of ``values``/``indices`` and coalesced atomics.
"""
from __future__ import annotations

import functools

from ._numba import cuda_module

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32  # noqa: E402 (after the numpy shim)


@functools.lru_cache(maxsize=None)
def _pair_function(k: int, weighted: bool):
    """Device function: pair ``t`` of an item starting at edge ``e0`` ->
    (source node, CBSR slot, edge value)."""

    @cuda.jit(device=True, inline=True)
    def pair(t, e0, col, weight):
        q = t // k
        e = e0 + q
        a = weight[e] if weighted else float32(1.0)
        return col[e], t - q * k, a

    return pair


@functools.lru_cache(maxsize=None)
def spgemm_kernel(dim: int, k: int, threads: int, weighted: bool):
    """The compiled forward kernel for one ``(dim, k, threads, weighted)``."""
    _pair = _pair_function(k, weighted)

    @cuda.jit
    def spgemm(item_row, item_start, item_end, item_split, col, weight,
               values, indices, out, num_items):
        buf = cuda.shared.array(dim, float32)
        tid = cuda.threadIdx.x
        for item in range(cuda.blockIdx.x, num_items, cuda.gridDim.x):
            r = item_row[item]
            e0 = item_start[item]
            for d in range(tid, dim, threads):
                buf[d] = float32(0.0)
            cuda.syncthreads()
            num_pairs = (item_end[item] - e0) * k
            # Four independent pairs per thread and round: their loads are
            # issued together, so memory latency overlaps (the kernel is
            # latency-bound otherwise).
            for t0 in range(tid, num_pairs, threads * 4):
                t1 = t0 + threads
                t2 = t1 + threads
                t3 = t2 + threads
                c0, j0, a0 = _pair(t0, e0, col, weight)
                c1, j1, a1 = _pair(min(t1, num_pairs - 1), e0, col, weight)
                c2, j2, a2 = _pair(min(t2, num_pairs - 1), e0, col, weight)
                c3, j3, a3 = _pair(min(t3, num_pairs - 1), e0, col, weight)
                v0 = values[c0, j0] * a0
                v1 = values[c1, j1] * a1
                v2 = values[c2, j2] * a2
                v3 = values[c3, j3] * a3
                i0 = indices[c0, j0]
                i1 = indices[c1, j1]
                i2 = indices[c2, j2]
                i3 = indices[c3, j3]
                cuda.atomic.add(buf, i0, v0)
                if t1 < num_pairs:
                    cuda.atomic.add(buf, i1, v1)
                if t2 < num_pairs:
                    cuda.atomic.add(buf, i2, v2)
                if t3 < num_pairs:
                    cuda.atomic.add(buf, i3, v3)
            cuda.syncthreads()
            if item_split[item]:
                for d in range(tid, dim, threads):
                    if buf[d] != 0:
                        cuda.atomic.add(out, (r, d), buf[d])
            else:
                for d in range(tid, dim, threads):
                    out[r, d] = buf[d]
            cuda.syncthreads()

    return spgemm


@functools.lru_cache(maxsize=None)
def sspmm_kernel(dim: int, k: int, threads: int, weighted: bool):
    """The compiled backward kernel for one ``(dim, k, threads, weighted)``."""
    _pair = _pair_function(k, weighted)

    @cuda.jit
    def sspmm(item_row, item_start, item_end, col, weight, indices, grad_out,
              grad_values, num_items):
        buf = cuda.shared.array(dim, float32)
        tid = cuda.threadIdx.x
        for item in range(cuda.blockIdx.x, num_items, cuda.gridDim.x):
            r = item_row[item]
            e0 = item_start[item]
            for d in range(tid, dim, threads):
                buf[d] = grad_out[r, d]
            cuda.syncthreads()
            num_pairs = (item_end[item] - e0) * k
            for t0 in range(tid, num_pairs, threads * 4):  # 4 pairs per round, as above
                t1 = t0 + threads
                t2 = t1 + threads
                t3 = t2 + threads
                c0, j0, a0 = _pair(t0, e0, col, weight)
                c1, j1, a1 = _pair(min(t1, num_pairs - 1), e0, col, weight)
                c2, j2, a2 = _pair(min(t2, num_pairs - 1), e0, col, weight)
                c3, j3, a3 = _pair(min(t3, num_pairs - 1), e0, col, weight)
                g0 = buf[indices[c0, j0]] * a0
                g1 = buf[indices[c1, j1]] * a1
                g2 = buf[indices[c2, j2]] * a2
                g3 = buf[indices[c3, j3]] * a3
                cuda.atomic.add(grad_values, (c0, j0), g0)
                if t1 < num_pairs:
                    cuda.atomic.add(grad_values, (c1, j1), g1)
                if t2 < num_pairs:
                    cuda.atomic.add(grad_values, (c2, j2), g2)
                if t3 < num_pairs:
                    cuda.atomic.add(grad_values, (c3, j3), g3)
            cuda.syncthreads()

    return sspmm

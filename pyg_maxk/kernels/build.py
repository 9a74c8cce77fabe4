"""The arrays of a new graph built on the GPU, each in a launch or two
where the same arithmetic in torch ops takes tens of launches: a new graph
per batch builds them on every step, and each launch costs host time.

* :func:`csr_of_sorted_kernel`: the CSR of an edge list sorted by target,
  one thread per row and per edge: each row's start by a binary search over
  the targets, the sources as int32, the mean's edge values, and the range
  checks, into a flag.
* The bounded work schedule (``pyg_maxk.graph.WorkSchedule``) in two
  launches around one prefix sum. :func:`row_pieces_kernel`, one thread per
  row: its items (``ceil(deg / max_edges)``, at least 1) and whether it is
  split (more than one). :func:`work_items_kernel`, one thread per item and
  per zeroed row, after the caller's inclusive prefix sums of both: item
  ``t`` belongs to the first row whose items end past ``t`` (a binary
  search over the sums), as does the ``t``-th split row (over the second).
  Items past the real ones are padding (no edges, ``split`` 1), zeroed rows
  past the split ones the scratch row ``num_dst``.

All index arithmetic is int64; the arrays are written as int32 (the graph's
index type below 2^31 entries).
"""
from __future__ import annotations

import functools

from ._numba import cuda_module, kernel_jit

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32, int32, int64  # noqa: E402 (after the numpy shim)


@functools.lru_cache(maxsize=None)
def _lower_bound():
    """``first(keys, n, value)``: the first ``e < n`` with ``keys[e] >=
    value``, else ``n`` (``keys`` non-decreasing)."""
    @cuda.jit(device=True, inline=True)
    def first(keys, n, value):
        lo = int64(0)
        hi = n
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] < value:
                lo = mid + 1
            else:
                hi = mid
        return lo

    return first


@functools.lru_cache(maxsize=None)
def csr_of_sorted_kernel(mean: bool, has_value: bool):
    """The CSR of the edges ``src[e] -> dst[e]`` sorted by target:
    ``rowptr[r]`` (``r <= num_dst``), ``col[e] = src[e]`` as int32, and the
    float32 edge values: ``value[e]`` (with ``has_value``), times one over
    the row's in-degree (at least 1) with ``mean``, which without
    ``has_value`` also writes it to ``row_scale[r]``. The quotient is taken
    in float64 and rounded once: the correctly rounded float32 quotient
    (float64 has more than twice its precision), as torch's float32
    division gives. An absent output is never
    written (any array stands in for it).

    ``ok[0]`` is set to 0 where a source lies outside ``[0, num_src)``, or a
    target outside ``[0, num_dst)`` (then the row pointers do not start at
    0 or do not end at ``num_edges``); the caller initialises it to 1."""
    lower_bound = _lower_bound()

    @kernel_jit()
    def csr_of_sorted(src, dst, value, num_src, num_dst, num_edges, rowptr, col, weight,
                      row_scale, ok):
        t = int64(cuda.grid(1))
        stride = int64(cuda.gridsize(1))
        while t <= num_dst or t < num_edges:
            if t <= num_dst:
                start = lower_bound(dst, num_edges, t)
                rowptr[t] = int32(start)
                if (t == 0 and start != 0) or (t == num_dst and start != num_edges):
                    ok[0] = 0
                if mean and not has_value and t < num_dst:
                    degree = lower_bound(dst, num_edges, t + 1) - start
                    row_scale[t] = float32(1.0 / max(degree, int64(1)))
            if t < num_edges:
                source = int64(src[t])
                if source < 0 or source >= num_src:
                    ok[0] = 0
                col[t] = int32(source)
                if mean:
                    target = int64(dst[t])
                    degree = lower_bound(dst, num_edges, target + 1) - \
                        lower_bound(dst, num_edges, target)
                    scale = float32(1.0 / max(degree, int64(1)))
                    weight[t] = value[t] * scale if has_value else scale
                elif has_value:
                    weight[t] = value[t]
            t += stride

    return csr_of_sorted


@functools.lru_cache(maxsize=None)
def row_pieces_kernel():
    """``counts[0, r]``: the items of row ``r`` (``ceil(deg / max_edges)``,
    at least 1); ``counts[1, r]``: 1 where that is more than one (a split
    row), else 0; for the ``num_dst`` rows of ``rowptr``."""
    @kernel_jit()
    def row_pieces(rowptr, max_edges, counts, num_dst):
        r = int64(cuda.grid(1))
        stride = int64(cuda.gridsize(1))
        while r < num_dst:
            degree = int64(rowptr[r + 1]) - int64(rowptr[r])
            pieces = max(int64(1), (degree + max_edges - 1) // max_edges)
            counts[0, r] = pieces
            counts[1, r] = int64(1) if pieces > 1 else int64(0)
            r += stride

    return row_pieces


@functools.lru_cache(maxsize=None)
def _first_above():
    """``first(sums, which, n, t)``: the first ``r < n`` with ``sums[which,
    r] > t``, else ``n`` (``sums[which]`` is non-decreasing): a binary
    search, as ``torch.searchsorted(..., right=True)``."""
    @cuda.jit(device=True, inline=True)
    def first(sums, which, n, t):
        lo = int64(0)
        hi = n
        while lo < hi:
            mid = (lo + hi) // 2
            if sums[which, mid] > t:
                hi = mid
            else:
                lo = mid + 1
        return lo

    return first


@functools.lru_cache(maxsize=None)
def work_items_kernel():
    """``items[:, t] = (row, start, end, split)`` of item ``t < num_items``
    and ``zeroed[t]`` for ``t < num_zeroed`` (see the module docstring),
    from ``sums``, the inclusive prefix sums of :func:`row_pieces_kernel`'s
    counts (``[2, num_dst]``)."""
    first_above = _first_above()

    @kernel_jit()
    def work_items(rowptr, sums, max_edges, items, zeroed, num_dst, num_items, num_zeroed):
        t = int64(cuda.grid(1))
        stride = int64(cuda.gridsize(1))
        while t < num_items or t < num_zeroed:
            if t < num_items:  # then num_dst > 0: every row has an item
                row = first_above(sums, 0, num_dst, t)
                real = row < num_dst
                row = min(row, num_dst - 1)
                before = sums[0, row - 1] if row > 0 else int64(0)
                start = int64(rowptr[row]) + (t - before) * max_edges
                end = min(start + max_edges, int64(rowptr[row + 1]))
                split = sums[1, row] if sums[0, row] - before > 1 else int64(0)
                if not real:  # padding: no edges, and nothing written
                    start = int64(0)
                    end = int64(0)
                    split = int64(1)
                items[0, t] = int32(row)
                items[1, t] = int32(start)
                items[2, t] = int32(end)
                items[3, t] = int32(split)
            if t < num_zeroed:
                zeroed[t] = first_above(sums, 1, num_dst, t)
            t += stride

    return work_items

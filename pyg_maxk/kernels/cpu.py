"""Numba CPU kernels (``parallel=True``) of the CBSR aggregation, for the
``"cpu"`` backend: the same maths as :mod:`.spgemm`, one thread per output
row, no atomics.

* Forward, over CSR rows ``r``: ``out[r, indices[c, j]] += a_e * values[c, j]``
  for every edge ``e = (c -> r)``; ``E * k`` multiply-adds instead of the
  ``E * dim`` of a dense product.
* Backward, over the rows ``c`` of the transposed graph (one writer per
  gradient row): ``grad_values[c, j] += a_e * grad_out[r, indices[c, j]]``;
  with the other gradients of the kept entries added and the sum densified
  in the same pass, the features' gradient of MaxK and the aggregation
  (:func:`input_grad_rows`).
* Gradient w.r.t. the edge values, over CSR rows ``r`` (a sampled
  dense-dense product, SDDMM): ``grad_weight[e] = sum_j values[c, j] *
  grad_out[r, indices[c, j]]``, ``E * k`` multiply-adds.
* MaxK selection, one thread per block of rows: the columns of the ``k``
  largest entries of each row, in column order, and the entries (see
  :func:`select_rows`); densify and its gradient, a gather at the CBSR
  pattern, one thread per row.
* The root-term linear map of a CBSR input, ``out = h @ W^T + b``, and its
  gradients, in ``N * k * out`` multiply-adds rather than the ``N * dim *
  out`` of a dense GEMM (see :func:`linear_rows`).

They compute in the features' dtype (float32 or float64).
"""
from __future__ import annotations

from ._cache import keyed_files
from ._numba import patch_numpy

patch_numpy()  # before Numba reads numpy

import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

#: Rows per parallel task of :func:`select_rows` (its scratch rows are
#: allocated once per task).
SELECT_BLOCK_ROWS = 16
#: Fewest groups whose maxima bound :func:`select_rows`'s search.
SELECT_MIN_GROUPS = 8
#: Most counting passes of :func:`select_rows`'s search before its quickselect.
SELECT_STEPS = 24
#: CBSR entries per pass of the linear kernels (:func:`linear_rows`): the
#: kernels unroll it by hand.
LINEAR_GROUP = 8
#: Rows of the output per thread task of the transposing kernels.
TRANSPOSE_BLOCK = 16
#: Reassociation (so that dot products vectorise) and fused multiply-adds,
#: but IEEE NaN/infinity semantics.
_LINEAR_FASTMATH = {"reassoc", "contract"}
#: Counting passes sum float32 ones, which vectorise when reassociated and
#: are exact below 2**24 (so :func:`select_rows` takes rows narrower than
#: that: ``pyg_maxk.dispatch.MAX_CPU_SELECT_DIM``); comparisons keep their
#: NaN semantics.
_COUNT_FASTMATH = {"reassoc"}


@keyed_files
@njit(parallel=True, cache=True)
def spgemm_rows(rowptr, col, weight, weighted, values, indices, out):
    """``out[r] = sum over edges (c -> r) of a_e * row c of the CBSR``
    (``a_e = weight[e]`` when ``weighted``, else 1); each row zeroed first
    (no separate zero-fill pass)."""
    k = values.shape[1]
    for r in prange(out.shape[0]):
        out[r] = 0
        for e in range(rowptr[r], rowptr[r + 1]):
            c = col[e]
            a = weight[e] if weighted else 1.0
            for j in range(k):
                out[r, indices[c, j]] += a * values[c, j]


@keyed_files
@njit(parallel=True, cache=True)
def sspmm_rows(colptr, row, weight_t, weighted, indices, grad_out, grad_values):
    """``grad_values[c, j] = sum over edges (c -> r) of a_e * grad_out[r, indices[c, j]]``,
    over the transposed graph ``(colptr, row, weight_t)``; each row zeroed
    first."""
    k = grad_values.shape[1]
    for c in prange(grad_values.shape[0]):
        grad_values[c] = 0
        for e in range(colptr[c], colptr[c + 1]):
            r = row[e]
            a = weight_t[e] if weighted else 1.0
            for j in range(k):
                grad_values[c, j] += a * grad_out[r, indices[c, j]]


#: Rows per parallel task of :func:`input_grad_rows` (its scratch row is
#: allocated once per task).
INPUT_GRAD_BLOCK_ROWS = 16


@keyed_files
@njit(parallel=True, cache=True)
def input_grad_rows(colptr, row, weight_t, weighted, indices, grad_agg, has_agg, grad_values,
                    has_values, grad_dense, has_dense, scale, has_scale, grad_x):
    """``grad_x[N, dim]``, the gradient of MaxK and the aggregation of its
    CBSR w.r.t. the features, per row ``c`` of the transposed graph: at each
    kept column ``indices[c, j]`` the SSpMM sum of :func:`sspmm_rows`
    (``has_agg``), plus ``grad_values[c, j]`` (``has_values``), plus
    ``grad_dense`` there (``has_dense``), added in that order, times
    ``scale[c, j]`` (``has_scale``: the dropout of the kept values); zero
    elsewhere. The sums run in a contiguous scratch row (so that they
    vectorise, as :func:`sspmm_rows`'s do) and are written once; the
    separate ops would write and read two ``[N, k]`` intermediates."""
    n, k = indices.shape
    dim = grad_x.shape[1]
    # Two-dimensional indexing throughout: with row views (``grad_x[c]``)
    # and slice fills this kernel takes twice as long.
    for block in prange((n + INPUT_GRAD_BLOCK_ROWS - 1) // INPUT_GRAD_BLOCK_ROWS):
        acc = np.empty(k, grad_x.dtype)
        for c in range(block * INPUT_GRAD_BLOCK_ROWS, min(n, (block + 1) * INPUT_GRAD_BLOCK_ROWS)):
            for j in range(k):
                acc[j] = 0
            if has_agg:
                for e in range(colptr[c], colptr[c + 1]):
                    r = row[e]
                    a = weight_t[e] if weighted else 1.0
                    for j in range(k):
                        acc[j] += a * grad_agg[r, indices[c, j]]
            if has_values:
                for j in range(k):
                    acc[j] += grad_values[c, j]
            if has_dense:
                for j in range(k):
                    acc[j] += grad_dense[c, indices[c, j]]
            if has_scale:
                for j in range(k):
                    acc[j] *= scale[c, j]
            for d in range(dim):
                grad_x[c, d] = 0
            for j in range(k):
                grad_x[c, indices[c, j]] = acc[j]


@keyed_files
@njit(cache=True)
def transpose_rows(rowptr, col, colptr, row, order):
    """The CSR graph ``(rowptr, col)`` grouped by source: ``colptr[num_src +
    1]``, and per grouped edge its target ``row`` and CSR position
    ``order``; each source's edges keep their CSR order (a counting sort,
    stable). Returns -1, or the CSR position of an edge whose source lies
    outside ``[0, num_src)`` (then the outputs are incomplete)."""
    num_src = colptr.shape[0] - 1
    colptr[:] = 0
    for e in range(col.shape[0]):
        c = col[e]
        if c < 0 or c >= num_src:
            return e
        colptr[c + 1] += 1
    for c in range(num_src):
        colptr[c + 1] += colptr[c]
    cursor = colptr[:num_src].copy()
    for r in range(rowptr.shape[0] - 1):
        for e in range(rowptr[r], rowptr[r + 1]):
            c = col[e]
            at = cursor[c]
            cursor[c] = at + 1
            row[at] = r
            order[at] = e
    return -1


@keyed_files
@njit(cache=True)
def group_by_target(src, dst, num_src, rowptr, col, order, loops):
    """The edge list ``src[e] -> dst[e]`` as CSR, grouped by target:
    ``rowptr[num_dst + 1]``, ``col`` (each grouped edge's source) and
    ``order`` (its position in the list); each target's edges keep their
    order (a counting sort, stable). With ``loops`` (a square graph), the
    list is taken with one more edge ``i -> i`` per node appended, at
    positions ``E + i``: each row ends with its node's loop. One pass checks
    the ranges and whether the list is sorted by target already (``order``
    is then left unset). Returns ``(bad, is_target, is_sorted)``: ``bad`` is
    -1, or the first edge whose source (``is_target`` false) or target lies
    outside ``[0, num_src)`` or ``[0, num_dst)`` (then the outputs are
    incomplete)."""
    num_dst = rowptr.shape[0] - 1
    num_edges = dst.shape[0]
    rowptr[:] = 0
    is_sorted = True
    previous = 0
    for e in range(num_edges):
        s, d = src[e], dst[e]
        if s < 0 or s >= num_src:
            return e, False, False
        if d < 0 or d >= num_dst:
            return e, True, False
        is_sorted = is_sorted and d >= previous
        previous = d
        rowptr[d + 1] += 1
    if loops:  # the appended loops 0, 1, ... follow the last target in order
        is_sorted = is_sorted and (num_dst == 0 or previous <= 0)
        for r in range(num_dst):
            rowptr[r + 1] += 1
    for r in range(num_dst):
        rowptr[r + 1] += rowptr[r]
    if is_sorted:
        for e in range(num_edges):
            col[e] = src[e]
        if loops:
            for r in range(num_dst):
                col[num_edges + r] = r
        return -1, False, True
    cursor = rowptr[:num_dst].copy()
    for e in range(num_edges):
        d = dst[e]
        at = cursor[d]
        cursor[d] = at + 1
        col[at] = src[e]
        order[at] = e
    if loops:
        for r in range(num_dst):
            at = cursor[r]
            col[at] = r
            order[at] = num_edges + r
    return -1, False, False


@keyed_files
@njit(cache=True)
def csr_of_edge_list(src, dst, weight, has_weight, mean, rowptr, col, order, values,
                     has_values, row_scale, has_row_scale, colptr, row_t, values_t, order_t,
                     loops):
    """A new graph's every array from its edge list ``src[e] -> dst[e]`` in
    one call: the CSR of :func:`group_by_target` (``rowptr``, ``col``,
    ``order``; with ``loops``, one more edge ``i -> i`` per node, which
    takes no ``weight``), its edge values in CSR order (``values``, written where
    ``has_values``: ``weight`` where ``has_weight``, divided by the target's
    in-degree where ``mean``, as :func:`mean_edge_values` divides, whose
    reciprocals go to ``row_scale`` where ``has_row_scale``), and the graph
    grouped by source as :func:`transpose_rows` groups it (``colptr``,
    ``row_t``, ``order_t``) with its edge values (``values_t``).

    Returns ``(bad, is_target, is_sorted)`` as :func:`group_by_target`
    (then nothing else is written)."""
    bad, is_target, is_sorted = group_by_target(src, dst, colptr.shape[0] - 1, rowptr, col,
                                                order, loops)
    if bad >= 0:
        return bad, is_target, is_sorted
    if has_weight:
        for i in range(col.shape[0]):
            values[i] = weight[i] if is_sorted else weight[order[i]]
    if mean:
        scales = row_scale if has_row_scale else np.empty(rowptr.shape[0] - 1, values.dtype)
        mean_edge_values(rowptr, values, has_weight, scales, values)
    transpose_rows(rowptr, col, colptr, row_t, order_t)  # every source is in range
    if has_values:
        for i in range(col.shape[0]):
            values_t[i] = values[order_t[i]]
    return -1, False, is_sorted


@keyed_files
@njit(cache=True)
def mean_edge_values(rowptr, weight, has_weight, inverse_degree, mean_weight):
    """The mean's edge values: ``inverse_degree[r] = 1 / max(deg_r, 1)`` and
    ``mean_weight[e] = weight[e] * inverse_degree[r]`` (``inverse_degree[r]``
    without ``has_weight``) for every edge ``e`` of row ``r``. The quotient
    is taken in float64 and rounded once to the arrays' type: for float32
    the correctly rounded float32 quotient (float64 has more than twice its
    precision), as torch's float32 division gives."""
    for r in range(rowptr.shape[0] - 1):
        start, end = rowptr[r], rowptr[r + 1]
        inverse_degree[r] = 1.0 / max(end - start, 1)
        scale = inverse_degree[r]
        for e in range(start, end):
            mean_weight[e] = weight[e] * scale if has_weight else scale


@keyed_files
@njit(parallel=True, cache=True)
def sddmm_rows(rowptr, col, values, indices, grad_out, grad_weight):
    """``grad_weight[e] = sum_j values[c, j] * grad_out[r, indices[c, j]]`` for
    every edge ``e = (c -> r)``."""
    k = values.shape[1]
    for r in prange(grad_out.shape[0]):
        for e in range(rowptr[r], rowptr[r + 1]):
            c = col[e]
            acc = 0.0
            for j in range(k):
                acc += values[c, j] * grad_out[r, indices[c, j]]
            grad_weight[e] = acc


@keyed_files
@njit(cache=True, inline="always")
def _kth_smallest(a, m, kth):
    """Permute ``a[:m]`` so that ``a[kth]`` is its kth smallest (0-based;
    quickselect, median-of-three pivots) and return it."""
    lo, hi = 0, m - 1
    while hi > lo:
        x, y, z = a[lo], a[(lo + hi) >> 1], a[hi]
        if x > y:
            x, y = y, x
        if y > z:
            y = z
        if x > y:
            y = x
        i, j = lo, hi
        while i <= j:
            while a[i] < y:
                i += 1
            while a[j] > y:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if kth <= j:
            hi = j
        elif kth >= i:
            lo = i
        else:
            break
    return a[kth]


@keyed_files
@njit(parallel=True, cache=True)
def select_rows(x, k, values, indices):
    """Write into ``indices[N, k]`` the columns of the ``k`` largest entries of
    each row of ``x[N, dim]`` (``1 <= k <= dim``), in column order, and into
    ``values[N, k]`` the entries themselves: the entries ``torch.topk``
    keeps, NaN above every number, and among entries equal to the ``k``-th
    largest the lowest columns.

    Per row: a threshold ``lo`` with at least ``k`` entries at or above it
    (the smallest of the maxima of ``k`` or more interleaved groups, see
    :func:`_search_bounds`) and an upper one, the row's maximum; then a
    search between them for a threshold with exactly ``k`` entries at or
    above it. Each step counts the row at one threshold (a branch-free pass
    that vectorises), placed where the counts at the two ends interpolate
    to ``k`` (false position with the Illinois correction); one pass then
    writes the columns. Where no threshold
    separates exactly ``k`` (ties at the ``k``-th largest, NaN, infinite
    ends) a quickselect finds the ``k``-th largest instead.
    """
    n, dim = x.shape
    for block in prange((n + SELECT_BLOCK_ROWS - 1) // SELECT_BLOCK_ROWS):
        tops = np.empty(max(k, SELECT_MIN_GROUPS), x.dtype)
        cand = np.empty(dim, x.dtype)
        cols = np.empty(dim + 1, np.int64)
        point = np.empty(2, x.dtype)  # thresholds rounded to x's dtype
        for r in range(block * SELECT_BLOCK_ROWS, min(n, (block + 1) * SELECT_BLOCK_ROWS)):
            row = x[r]
            nans = _count_nans(row)
            need = k - nans  # numbers kept besides the NaNs
            if need <= 0:
                _write_first_nans(row, k, values[r], indices[r])
                continue
            lo, hi = _search_bounds(row, k, tops, nans, point, cand)
            count_lo = _count_at_least(row, lo)
            lo, count_lo = _narrow(row, need, lo, hi, count_lo, point)
            if count_lo == need and nans == 0:  # the kept entries are those >= lo
                out = 0
                for c in range(dim):
                    cols[out] = c
                    out += row[c] >= lo
            else:
                m = 0
                for c in range(dim):
                    cand[m] = row[c]
                    m += row[c] >= lo
                t = _kth_smallest(cand, m, m - need)  # the need-th largest number
                above = 0
                for c in range(dim):
                    above += row[c] > t
                ties = need - above  # entries equal to t to keep, lowest columns first
                out = 0
                for c in range(dim):  # branch-free compaction of the kept columns
                    v = row[c]
                    tie = (v == t) & (ties > 0)
                    ties -= tie
                    cols[out] = c
                    out += (v > t) | np.isnan(v) | tie
            for j in range(k):
                c = cols[j]
                indices[r, j] = c
                values[r, j] = row[c]


@keyed_files
@njit(parallel=True, cache=True)
def densify_rows(values, indices, out):
    """``out[N, dim]``, the dense form of the CBSR ``(values, indices)``: each
    row zeroed and its ``k`` entries written, in one pass over the output."""
    k = values.shape[1]
    for r in prange(out.shape[0]):
        row = out[r]
        row[:] = 0
        for j in range(k):
            row[indices[r, j]] = values[r, j]


@keyed_files
@njit(parallel=True, cache=True)
def scale_and_densify_rows(values, scale, has_scale, indices, dense, has_dense):
    """``values *= scale`` (``has_scale``: the dropout of the kept values)
    and, where ``has_dense``, ``dense[N, dim]`` the dense form of the scaled
    CBSR, in one pass per row."""
    k = values.shape[1]
    for r in prange(values.shape[0]):
        if has_scale:
            for j in range(k):
                values[r, j] *= scale[r, j]
        if has_dense:
            row = dense[r]
            row[:] = 0
            for j in range(k):
                row[indices[r, j]] = values[r, j]


@keyed_files
@njit(cache=True)
def maxk_aggregate_rows(x, k, scale, has_scale, values, indices, dense, has_dense, rowptr, col,
                        weight, weighted, out):
    """MaxK of ``x[N, dim]`` into the CBSR ``(values, indices)`` (``k <
    dim``), times the dropout ``scale[N, k]`` where ``has_scale``, its dense
    form into ``dense`` where ``has_dense``, and its aggregation over the CSR
    graph ``(rowptr, col, weight)`` into ``out[num_dst, dim]``: what
    :func:`select_rows`, :func:`scale_and_densify_rows` and
    :func:`spgemm_rows` compute, in one call from Python (each step is a
    parallel loop over rows; the aggregation reads every row's selection)."""
    select_rows(x, k, values, indices)
    if has_scale or has_dense:
        scale_and_densify_rows(values, scale, has_scale, indices, dense, has_dense)
    spgemm_rows(rowptr, col, weight, weighted, values, indices, out)


@keyed_files
@njit(parallel=True, cache=True)
def gather_rows(dense, indices, out):
    """``out[r, j] = dense[r, indices[r, j]]``: ``dense`` at the CBSR pattern,
    read with the indices as stored (no int64 copy)."""
    k = indices.shape[1]
    for r in prange(out.shape[0]):
        for j in range(k):
            out[r, j] = dense[r, indices[r, j]]


@keyed_files
@njit(fastmath=_COUNT_FASTMATH, cache=True)
def _count_at_least(row, t):
    """How many entries of ``row`` are ``>= t`` (NaN never is)."""
    count = np.float32(0)
    for c in range(row.shape[0]):
        count += np.float32(1) if row[c] >= t else np.float32(0)
    return int(count)


@keyed_files
@njit(fastmath=_COUNT_FASTMATH, cache=True)
def _count_nans(row):
    """How many entries of ``row`` are NaN."""
    count = np.float32(0)
    for c in range(row.shape[0]):
        count += np.float32(1) if row[c] != row[c] else np.float32(0)
    return int(count)


@keyed_files
@njit(cache=True, inline="always")
def _write_first_nans(row, k, values, indices):
    """The first ``k`` NaN entries of ``row``, which has at least ``k``."""
    out = 0
    for c in range(row.shape[0]):
        if out < k and np.isnan(row[c]):
            indices[out] = c
            values[out] = row[c]
            out += 1


@keyed_files
@njit(cache=True, inline="always")
def _search_bounds(row, k, tops, nans, point, scratch):
    """``(lo, hi)``: at least ``k`` numbers of ``row`` lie at or above ``lo``
    (each of ``g >= k`` groups ``{j, j + g, j + 2g, ...}`` holds its maximum,
    which is ``>= lo``; at least :data:`SELECT_MIN_GROUPS` groups, so that
    the maxima vectorise) and ``hi`` is its largest. With NaNs in the row,
    ``(-inf, inf)``. Both in the row's dtype (``point`` rounds them);
    ``scratch`` holds at least half a row."""
    if nans > 0:
        point[0] = -np.inf
        point[1] = np.inf
        return point[0], point[1]
    groups = tops[:min(row.shape[0], max(k, SELECT_MIN_GROUPS))]
    _group_maxima(row, groups, scratch)
    lo = groups[0]
    hi = groups[0]
    for j in range(1, groups.shape[0]):
        lo = min(lo, groups[j])
        hi = max(hi, groups[j])
    return lo, hi


@keyed_files
@njit(fastmath={"nnan", "nsz"}, cache=True)
def _group_maxima(row, tops, scratch):
    """``tops[j]``: the largest of ``row[j], row[j + k], ...`` for ``k =
    len(tops)``, for a row without NaN (the flags let the maxima vectorise;
    the sign of a zero maximum may differ, its value does not). Where the
    row is ``k`` times a power of two long, by halving: each pass takes the
    larger of the first and second half of the last pass's entries, in
    ``scratch`` (half a row), until ``k`` remain (long element-wise passes
    vectorise; a pass per run of ``k`` would not, for the usual short runs)."""
    k = tops.shape[0]
    dim = row.shape[0]
    runs = dim // k
    if dim % k == 0 and runs & (runs - 1) == 0:
        if runs == 1:
            tops[:] = row
            return
        half = dim >> 1
        for j in range(half):
            a, b = row[j], row[j + half]
            scratch[j] = a if a > b else b
        while half > k:
            half >>= 1
            for j in range(half):
                a, b = scratch[j], scratch[j + half]
                scratch[j] = a if a > b else b
        tops[:] = scratch[:k]
        return
    whole = dim - dim % k  # the columns of whole runs of k
    for j in range(k):
        tops[j] = row[j]
    for base in range(k, whole, k):
        for j in range(k):
            tops[j] = max(tops[j], row[base + j])
    for j in range(dim - whole):
        tops[j] = max(tops[j], row[whole + j])


@keyed_files
@njit(cache=True, inline="always")
def _narrow(row, need, lo, hi, count_lo, point):
    """Raise ``lo`` (``count_lo`` numbers at or above it, ``>= need``) towards
    a threshold with exactly ``need`` numbers at or above it, below ``hi``,
    in at most :data:`SELECT_STEPS` counting passes; return the last ``(lo,
    count_lo)``."""
    target = need + 0.5
    f_lo = count_lo - target  # > 0
    f_hi = 1.0 - target       # at least the maximum is at or above hi; < 0
    side = 0
    for _ in range(SELECT_STEPS):
        if count_lo == need:
            break
        point[0] = lo + (hi - lo) * (f_lo / (f_lo - f_hi))
        mid = point[0]
        if not lo < mid < hi:  # rounding, or an infinite end
            point[0] = lo * 0.5 + hi * 0.5
            mid = point[0]
            if not lo < mid < hi:
                break
        count = _count_at_least(row, mid)
        if count >= need:
            lo, count_lo, f_lo = mid, count, count - target
            if side > 0:
                f_hi *= 0.5  # Illinois: the far end stayed twice
            side = 1
        else:
            hi, f_hi = mid, count - target
            if side < 0:
                f_lo *= 0.5
            side = -1
    return lo, count_lo


@keyed_files
@njit(parallel=True, fastmath=_LINEAR_FASTMATH, cache=True)
def linear_rows(values, indices, weight_t, bias, has_bias, out):
    """``out[N, out] = h @ W^T (+ bias)`` for the CBSR ``h = (values,
    indices)`` and ``weight_t = W^T`` (``[dim, out]``, C-contiguous): per row,
    ``k`` scaled rows of ``weight_t`` added up (``bias`` is read only when
    ``has_bias``): ``N * k * out`` multiply-adds instead of a dense GEMM's
    ``N * dim * out``. Eight rows of ``weight_t`` per pass over the output
    row: a pass per row would load and store the output row for every
    two operations of its multiply-adds."""
    m = out.shape[1]
    k = values.shape[1]
    for i in prange(values.shape[0]):
        row = out[i]
        for o in range(m):
            row[o] = bias[o] if has_bias else 0
        grouped = k - k % LINEAR_GROUP
        for s in range(0, grouped, LINEAR_GROUP):
            v0, v1, v2, v3 = values[i, s], values[i, s + 1], values[i, s + 2], values[i, s + 3]
            v4, v5, v6, v7 = values[i, s + 4], values[i, s + 5], values[i, s + 6], values[i, s + 7]
            w0, w1 = weight_t[indices[i, s]], weight_t[indices[i, s + 1]]
            w2, w3 = weight_t[indices[i, s + 2]], weight_t[indices[i, s + 3]]
            w4, w5 = weight_t[indices[i, s + 4]], weight_t[indices[i, s + 5]]
            w6, w7 = weight_t[indices[i, s + 6]], weight_t[indices[i, s + 7]]
            for o in range(m):
                row[o] += ((v0 * w0[o] + v1 * w1[o]) + (v2 * w2[o] + v3 * w3[o])) + \
                    ((v4 * w4[o] + v5 * w5[o]) + (v6 * w6[o] + v7 * w7[o]))
        for s in range(grouped, k):
            v = values[i, s]
            w = weight_t[indices[i, s]]
            for o in range(m):
                row[o] += v * w[o]


@keyed_files
@njit(parallel=True, fastmath=_LINEAR_FASTMATH, cache=True)
def linear_input_grad_rows(grad_out, indices, weight_t, grad_values):
    """``grad_values[i, s] = grad_out[i] . weight_t[indices[i, s]]``: the
    gradient of :func:`linear_rows` w.r.t. the CBSR values, ``(grad_out @ W)``
    sampled at the CBSR pattern without computing the rest. Eight dot
    products per pass over ``grad_out[i]``, which they share."""
    m = grad_out.shape[1]
    k = indices.shape[1]
    for i in prange(indices.shape[0]):
        g = grad_out[i]
        grouped = k - k % LINEAR_GROUP
        for s in range(0, grouped, LINEAR_GROUP):
            w0, w1 = weight_t[indices[i, s]], weight_t[indices[i, s + 1]]
            w2, w3 = weight_t[indices[i, s + 2]], weight_t[indices[i, s + 3]]
            w4, w5 = weight_t[indices[i, s + 4]], weight_t[indices[i, s + 5]]
            w6, w7 = weight_t[indices[i, s + 6]], weight_t[indices[i, s + 7]]
            a0, a1, a2, a3 = g[0] * w0[0], g[0] * w1[0], g[0] * w2[0], g[0] * w3[0]
            a4, a5, a6, a7 = g[0] * w4[0], g[0] * w5[0], g[0] * w6[0], g[0] * w7[0]
            for o in range(1, m):
                go = g[o]
                a0 += go * w0[o]
                a1 += go * w1[o]
                a2 += go * w2[o]
                a3 += go * w3[o]
                a4 += go * w4[o]
                a5 += go * w5[o]
                a6 += go * w6[o]
                a7 += go * w7[o]
            grad_values[i, s], grad_values[i, s + 1] = a0, a1
            grad_values[i, s + 2], grad_values[i, s + 3] = a2, a3
            grad_values[i, s + 4], grad_values[i, s + 5] = a4, a5
            grad_values[i, s + 6], grad_values[i, s + 7] = a6, a7
        for s in range(grouped, k):
            w = weight_t[indices[i, s]]
            acc = g[0] * w[0]
            for o in range(1, m):
                acc += g[o] * w[o]
            grad_values[i, s] = acc


@keyed_files
@njit(parallel=True, fastmath=_LINEAR_FASTMATH, cache=True)
def linear_weight_grad_parts(grad_out, values, indices, parts):
    """``parts[p] = (grad_out^T @ h)^T`` over the ``p``-th of
    ``parts.shape[0]`` equal runs of rows (``parts[p]`` is ``[dim, out]``;
    their sum is ``W``'s gradient, transposed): one writer per part, no
    atomics."""
    n, k = values.shape
    m = grad_out.shape[1]
    chunk = (n + parts.shape[0] - 1) // parts.shape[0]
    for p in prange(parts.shape[0]):
        part = parts[p]
        part[:] = 0
        for i in range(p * chunk, min(n, (p + 1) * chunk)):
            g = grad_out[i]
            for s in range(k):
                v = values[i, s]
                acc = part[indices[i, s]]
                for o in range(m):
                    acc[o] += v * g[o]


@keyed_files
@njit(parallel=True, cache=True)
def transpose_into(src, dst):
    """``dst[c, o] = src[o, c]`` (``dst`` C-contiguous): one thread per block
    of :data:`TRANSPOSE_BLOCK` rows of ``dst``, whose stores stay in a few
    cache lines while ``src`` is read row by row."""
    rows, cols = src.shape
    for block in prange((cols + TRANSPOSE_BLOCK - 1) // TRANSPOSE_BLOCK):
        c0 = block * TRANSPOSE_BLOCK
        c1 = min(cols, c0 + TRANSPOSE_BLOCK)
        for o in range(rows):
            line = src[o]
            for c in range(c0, c1):
                dst[c, o] = line[c]


@keyed_files
@njit(parallel=True, cache=True)
def sum_parts_transposed(parts, dst):
    """``dst[o, c] = sum_p parts[p, c, o]``: :func:`linear_weight_grad_parts`'
    partial sums added up into the weight's ``[out, dim]`` layout in one
    pass, one thread per block of :data:`TRANSPOSE_BLOCK` rows of ``dst``."""
    num_parts, dim, m = parts.shape
    for block in prange((m + TRANSPOSE_BLOCK - 1) // TRANSPOSE_BLOCK):
        o0 = block * TRANSPOSE_BLOCK
        o1 = min(m, o0 + TRANSPOSE_BLOCK)
        for c in range(dim):
            first = parts[0, c]
            for o in range(o0, o1):
                dst[o, c] = first[o]
            for p in range(1, num_parts):
                line = parts[p, c]
                for o in range(o0, o1):
                    dst[o, c] += line[o]

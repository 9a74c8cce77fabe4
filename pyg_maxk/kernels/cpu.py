"""Numba CPU kernels (``parallel=True``) of the CBSR aggregation, for the
``"cpu"`` backend: the same maths as :mod:`.spgemm`, one thread per output
row, no atomics.

* Forward, over CSR rows ``r``: ``out[r, indices[c, j]] += a_e * values[c, j]``
  for every edge ``e = (c -> r)``; ``E * k`` multiply-adds instead of the
  ``E * dim`` of a dense product.
* Backward, over the rows ``c`` of the transposed graph (one writer per
  gradient row): ``grad_values[c, j] += a_e * grad_out[r, indices[c, j]]``.
* Gradient w.r.t. the edge values, over CSR rows ``r`` (a sampled
  dense-dense product, SDDMM): ``grad_weight[e] = sum_j values[c, j] *
  grad_out[r, indices[c, j]]``, ``E * k`` multiply-adds.
* MaxK selection, one thread per block of rows: the columns of the ``k``
  largest entries of each row, in column order (see :func:`select_rows`).
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
SELECT_BLOCK_ROWS = 64
#: Most bisection steps of :func:`select_rows` before its quickselect.
SELECT_BISECTIONS = 16
#: Reassociation (so that dot products vectorise) and fused multiply-adds,
#: but IEEE NaN/infinity semantics.
_LINEAR_FASTMATH = {"reassoc", "contract"}


@keyed_files
@njit(parallel=True, cache=True)
def spgemm_rows(rowptr, col, weight, weighted, values, indices, out):
    """``out[r] += sum over edges (c -> r) of a_e * row c of the CBSR``
    (``a_e = weight[e]`` when ``weighted``, else 1)."""
    k = values.shape[1]
    for r in prange(out.shape[0]):
        for e in range(rowptr[r], rowptr[r + 1]):
            c = col[e]
            a = weight[e] if weighted else 1.0
            for j in range(k):
                out[r, indices[c, j]] += a * values[c, j]


@keyed_files
@njit(parallel=True, cache=True)
def sspmm_rows(colptr, row, weight_t, weighted, indices, grad_out, grad_values):
    """``grad_values[c, j] += sum over edges (c -> r) of a_e * grad_out[r, indices[c, j]]``,
    over the transposed graph ``(colptr, row, weight_t)``."""
    k = grad_values.shape[1]
    for c in prange(grad_values.shape[0]):
        for e in range(colptr[c], colptr[c + 1]):
            r = row[e]
            a = weight_t[e] if weighted else 1.0
            for j in range(k):
                grad_values[c, j] += a * grad_out[r, indices[c, j]]


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
def select_rows(x, k, indices):
    """Write into ``indices[N, k]`` the columns of the ``k`` largest entries of
    each row of ``x[N, dim]`` (``1 <= k <= dim``), in column order: the
    entries ``torch.topk`` keeps, NaN above every number, and among entries
    equal to the ``k``-th largest the lowest columns.

    Per row: a lower bound ``lo`` with at least ``k`` entries at or above it
    (the smallest of the maxima of ``k`` interleaved groups), then bisection
    of ``[lo, max]``, keeping the candidates at or above ``lo`` in column
    order. When exactly ``k`` remain (the usual case) they are the answer;
    otherwise (ties, NaN) a quickselect finds the ``k``-th largest and one
    branch-free pass over the row writes the columns.
    """
    n, dim = x.shape
    for block in prange((n + SELECT_BLOCK_ROWS - 1) // SELECT_BLOCK_ROWS):
        cand = np.empty(dim, x.dtype)
        cand_col = np.empty(dim, np.int64)
        tops = np.empty(k, x.dtype)
        cols = np.empty(dim + 1, np.int64)
        for r in range(block * SELECT_BLOCK_ROWS, min(n, (block + 1) * SELECT_BLOCK_ROWS)):
            row = x[r]
            nans = 0
            for c in range(dim):
                nans += np.isnan(row[c])
            need = k - nans  # numbers kept besides the NaNs
            if need <= 0:
                out = 0
                for c in range(dim):
                    if out < k and np.isnan(row[c]):
                        indices[r, out] = c
                        out += 1
                continue
            if nans == 0:
                # Each group {j, j + k, j + 2k, ...} holds its maximum, which
                # is >= lo: at least k entries lie at or above lo.
                for j in range(k):
                    tops[j] = row[j]
                for base in range(k, dim, k):
                    for j in range(min(k, dim - base)):
                        tops[j] = max(tops[j], row[base + j])
                lo = tops[0]
                hi = tops[0]
                for j in range(1, k):
                    lo = min(lo, tops[j])
                    hi = max(hi, tops[j])
            else:
                lo, hi = -np.inf, np.inf
            m = 0
            for c in range(dim):  # branch-free: keep the numbers >= lo, in column order
                cand[m] = row[c]
                cand_col[m] = c
                m += row[c] >= lo
            # Bisect [lo, hi] while it still drops candidates; at least
            # `need` of them stay at or above lo throughout.
            for _ in range(SELECT_BISECTIONS):
                if m == need:
                    break
                mid = lo + (hi - lo) * 0.5
                if not lo < mid < hi:
                    break
                count = 0
                for c in range(m):
                    count += cand[c] >= mid
                if count >= need:
                    lo, kept = mid, 0
                    for c in range(m):
                        cand[kept] = cand[c]
                        cand_col[kept] = cand_col[c]
                        kept += cand[c] >= mid
                    m = kept
                else:
                    hi = mid
            if m == need and nans == 0:  # the candidates are the kept entries
                for j in range(k):
                    indices[r, j] = cand_col[j]
                continue
            if m == need:
                t = cand[0]
                for c in range(1, m):
                    t = min(t, cand[c])
            else:
                t = _kth_smallest(cand, m, m - need)  # the need-th largest
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
                indices[r, j] = cols[j]


@keyed_files
@njit(parallel=True, fastmath=_LINEAR_FASTMATH, cache=True)
def linear_rows(values, indices, weight_t, bias, has_bias, out):
    """``out[N, out] = h @ W^T (+ bias)`` for the CBSR ``h = (values,
    indices)`` and ``weight_t = W^T`` (``[dim, out]``, C-contiguous): per row,
    ``k`` scaled rows of ``weight_t`` added up (``bias`` is read only when
    ``has_bias``): ``N * k * out`` multiply-adds instead of a dense GEMM's
    ``N * dim * out``."""
    m = out.shape[1]
    for i in prange(values.shape[0]):
        row = out[i]
        for o in range(m):
            row[o] = bias[o] if has_bias else 0
        for s in range(values.shape[1]):
            v = values[i, s]
            w = weight_t[indices[i, s]]
            for o in range(m):
                row[o] += v * w[o]


@keyed_files
@njit(parallel=True, fastmath=_LINEAR_FASTMATH, cache=True)
def linear_input_grad_rows(grad_out, indices, weight_t, grad_values):
    """``grad_values[i, s] = grad_out[i] . weight_t[indices[i, s]]``: the
    gradient of :func:`linear_rows` w.r.t. the CBSR values, ``(grad_out @ W)``
    sampled at the CBSR pattern without computing the rest."""
    m = grad_out.shape[1]
    for i in prange(indices.shape[0]):
        g = grad_out[i]
        for s in range(indices.shape[1]):
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

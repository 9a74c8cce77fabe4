"""Numba CPU kernels (``parallel=True``) of the CBSR aggregation, for the
``"cpu"`` backend: the same maths as :mod:`.spgemm`, one thread per output
row, no atomics.

* Forward, over CSR rows ``r``: ``out[r, indices[c, j]] += a_e * values[c, j]``
  for every edge ``e = (c -> r)``; ``E * k`` multiply-adds instead of the
  ``E * dim`` of a dense product.
* Backward, over the rows ``c`` of the transposed graph (one writer per
  gradient row): ``grad_values[c, j] += a_e * grad_out[r, indices[c, j]]``.

They compute in the features' dtype (float32 or float64).
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def _kernels():
    from ._numba import patch_numpy
    patch_numpy()
    from numba import njit, prange

    @njit(parallel=True, cache=True)
    def spgemm_rows(rowptr, col, weight, weighted, values, indices, out):
        k = values.shape[1]
        for r in prange(out.shape[0]):
            for e in range(rowptr[r], rowptr[r + 1]):
                c = col[e]
                a = weight[e] if weighted else 1.0
                for j in range(k):
                    out[r, indices[c, j]] += a * values[c, j]

    @njit(parallel=True, cache=True)
    def sspmm_rows(colptr, row, weight_t, weighted, indices, grad_out, grad_values):
        k = grad_values.shape[1]
        for c in prange(grad_values.shape[0]):
            for e in range(colptr[c], colptr[c + 1]):
                r = row[e]
                a = weight_t[e] if weighted else 1.0
                for j in range(k):
                    grad_values[c, j] += a * grad_out[r, indices[c, j]]

    return spgemm_rows, sspmm_rows


def spgemm_rows(*args) -> None:
    """``out[r] += sum over edges (c -> r) of a_e * row c of the CBSR``."""
    _kernels()[0](*args)


def sspmm_rows(*args) -> None:
    """``grad_values[c, j] += sum over edges (c -> r) of a_e * grad_out[r, indices[c, j]]``."""
    _kernels()[1](*args)

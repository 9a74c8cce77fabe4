"""The aggregation of a CBSR over an edge list in any order, with atomics:
for a graph that is used once (a new graph per batch), where sorting it into
CSR and scheduling its rows costs more host time than the aggregation.

* :func:`edge_list_check_kernel`, one thread per edge: the range check of
  the sources and targets (into a flag) and, for a mean, each target's
  in-degree (integer atomics, exact).
* :func:`edge_list_scale_kernel`, one thread per edge and per target: the
  mean's float32 scale ``1 / max(degree, 1)`` per target and per edge (the
  correctly rounded quotient, as :mod:`.build` takes it), times the edge's
  own value where it has one.
* :func:`edge_list_spgemm_kernel`, one thread per (edge, slot): ``out[dst,
  indices[src, j]] += a_e * values[src, j]`` into a zeroed float32 result.
* :func:`edge_list_sspmm_kernel`, one thread per (edge, slot):
  ``grad_values[src, j] += a_e * grad_out[dst, indices[src, j]]`` into a
  zeroed float32 gradient.

Consecutive threads take consecutive slots of one edge, so each edge's
CBSR row is read coalesced. The float32 atomics make the order of each sum
unspecified, as in PyG's own scatter on a GPU. ``a_e`` is the edge's value
(``weighted``), times its target's row scale (``scaled``), or 1.
"""
from __future__ import annotations

import functools

from ._numba import cuda_module, kernel_jit

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32, int32, int64  # noqa: E402 (after the numpy shim)


@functools.lru_cache(maxsize=None)
def edge_list_check_kernel(count: bool):
    """``ok[0] = 0`` where ``src[e]`` lies outside ``[0, num_src)`` or
    ``dst[e]`` outside ``[0, num_dst)`` (the caller sets it to 1); with
    ``count``, ``degree[dst[e]] += 1`` for every edge in range (``degree``
    int32, zeroed by the caller)."""
    @kernel_jit()
    def edge_list_check(src, dst, num_src, num_dst, num_edges, degree, ok):
        e = int64(cuda.grid(1))
        stride = int64(cuda.gridsize(1))
        while e < num_edges:
            source = int64(src[e])
            target = int64(dst[e])
            if source < 0 or source >= num_src or target < 0 or target >= num_dst:
                ok[0] = 0
            elif count:
                cuda.atomic.add(degree, target, int32(1))
            e += stride

    return edge_list_check


@functools.lru_cache(maxsize=None)
def edge_list_scale_kernel(has_value: bool):
    """The mean's edge values from the in-degrees: ``weight[e] = value[e] /
    max(degree[dst[e]], 1)`` (``value[e]`` 1 without ``has_value``) and,
    without ``has_value``, ``row_scale[r] = 1 / max(degree[r], 1)``. Edges
    out of range (flagged by the check) are skipped."""
    @kernel_jit()
    def edge_list_scale(dst, value, degree, num_dst, num_edges, weight, row_scale):
        t = int64(cuda.grid(1))
        stride = int64(cuda.gridsize(1))
        while t < num_edges or t < num_dst:
            if t < num_dst and not has_value:
                row_scale[t] = float32(1.0 / max(int64(degree[t]), int64(1)))
            if t < num_edges:
                target = int64(dst[t])
                if 0 <= target < num_dst:
                    scale = float32(1.0 / max(int64(degree[target]), int64(1)))
                    weight[t] = value[t] * scale if has_value else scale
            t += stride

    return edge_list_scale


@functools.lru_cache(maxsize=None)
def _edge_slot(k: int):
    """``slot_of(src, dst, t) -> (e, target, at)``: thread ``t``'s edge, its
    target and the flat CBSR slot of its source that it takes (slot ``t mod
    k`` of edge ``t // k``)."""
    @cuda.jit(device=True, inline=True)
    def slot_of(src, dst, t):
        e = t // k
        return e, int64(dst[e]), int64(src[e]) * k + (t - e * k)

    return slot_of


@functools.lru_cache(maxsize=None)
def edge_list_spgemm_kernel(k: int, weighted: bool, scaled: bool):
    """``out[dst[e], indices[src[e], j]] += a_e * values[src[e], j]`` for
    every edge ``e`` and slot ``j < k`` (``values``, ``indices``, ``out``
    flat; ``out`` float32 ``[num_dst * dim]``)."""
    slot_of = _edge_slot(k)

    @kernel_jit()
    def edge_list_spgemm(src, dst, weight, row_scale, values, indices, out, dim, slots):
        t = int64(cuda.grid(1))
        stride = int64(cuda.gridsize(1))
        while t < slots:
            e, target, at = slot_of(src, dst, t)
            v = float32(values[at])
            if weighted:
                v *= weight[e]
            if scaled:
                v *= row_scale[target]
            cuda.atomic.add(out, target * dim + int64(indices[at]), v)
            t += stride

    return edge_list_spgemm


@functools.lru_cache(maxsize=None)
def edge_list_sspmm_kernel(k: int, weighted: bool, scaled: bool):
    """``grad_values[src[e], j] += a_e * grad_out[dst[e], indices[src[e],
    j]]`` for every edge ``e`` and slot ``j < k`` (flat arrays;
    ``grad_values`` float32 ``[num_src * k]``)."""
    slot_of = _edge_slot(k)

    @kernel_jit()
    def edge_list_sspmm(src, dst, weight, row_scale, indices, grad_out, grad_values, dim,
                        slots):
        t = int64(cuda.grid(1))
        stride = int64(cuda.gridsize(1))
        while t < slots:
            e, target, at = slot_of(src, dst, t)
            g = float32(grad_out[target * dim + int64(indices[at])])
            if weighted:
                g *= weight[e]
            if scaled:
                g *= row_scale[target]
            cuda.atomic.add(grad_values, at, g)
            t += stride

    return edge_list_sspmm

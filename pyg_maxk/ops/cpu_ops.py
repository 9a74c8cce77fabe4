"""The ``"cpu"`` backend's implementations: MaxK selection, densify, CBSR
aggregation and the linear map of CBSR rows with the Numba CPU kernels of
:mod:`pyg_maxk.kernels.cpu`. Plain functions, not differentiable:
:mod:`pyg_maxk.ops._library` wraps them as custom ops with autograd. They
compute in the features' dtype (float32 or float64).
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..cbsr import index_dtype_for
from ..graph import GraphOperands
from ..kernels import cpu as kernels
from . import torch_ops
from ._common import as_dtype, spgemm_dtype
from .torch_ops import column_sums  # noqa: F401 (the densify backend's bias gradient)


def maxk_select(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """``(values [N, k], indices [N, k])`` of the ``k`` largest entries per row
    of ``x [N, dim]`` (``k < dim``), in column order."""
    n, dim = x.shape
    x = x.detach().contiguous()
    values = x.new_empty(n, k)
    indices = torch.empty(n, k, dtype=index_dtype_for(dim))
    if n > 0:
        kernels.select_rows(x.numpy(), k, values.numpy(), indices.numpy())
    return values, indices


def cbsr_to_dense(values: Tensor, indices: Tensor, dim: int) -> Tensor:
    """The dense ``[N, dim]`` form of the CBSR ``(values, indices)``, each row
    written once (no separate zero-fill, no int64 copy of the indices)."""
    out = values.new_empty(values.size(0), dim)                       # [N, dim]
    if out.numel() > 0:
        kernels.densify_rows(values.detach().contiguous().numpy(), indices.contiguous().numpy(),
                             out.numpy())
    return out


def gather_at(dense: Tensor, indices: Tensor) -> Tensor:
    """``dense`` at the CBSR pattern ``indices``: ``[N, k]``."""
    out = dense.new_empty(indices.shape)                               # [N, k]
    if out.numel() > 0:
        kernels.gather_rows(dense.detach().contiguous().numpy(), indices.contiguous().numpy(),
                            out.numpy())
    return out


#: Arrays that stand for an input a kernel is told not to read, by dtype
#: (edge values of an unweighted graph, a gradient that is absent): one
#: array per type, not an allocation per call. The graph build's kernel
#: takes them too (:func:`pyg_maxk.graph.csr._csr_on_cpu`).
UNREAD_1D = {torch.float32: np.zeros(1, np.float32), torch.float64: np.zeros(1, np.float64)}
_UNREAD_2D = {dtype: a.reshape(1, 1) for dtype, a in UNREAD_1D.items()}


def _weight(weight: Optional[Tensor], dtype: torch.dtype, like: Tensor):
    """(edge values as a numpy array of ``dtype``, whether they are real)."""
    if weight is None:
        unread = UNREAD_1D.get(dtype)
        return (like.new_empty(1, dtype=dtype).numpy() if unread is None else unread), False
    return weight.detach().to(dtype).contiguous().numpy(), True


def _given(t: Optional[Tensor], dtype: torch.dtype, like: Tensor):
    """``t`` as a numpy array, or an array of ``dtype`` that stands for it
    where it is absent."""
    if t is not None:
        return t.detach().contiguous().numpy()
    unread = _UNREAD_2D.get(dtype)
    return like[:1].numpy() if unread is None else unread


def spgemm(g: GraphOperands, values: Tensor, indices: Tensor, num_dst: int,
           dim: int) -> Tensor:
    """``A @ h`` as ``[num_dst, dim]`` for the CBSR ``h = (values, indices)``:
    one thread per output row."""
    if g.row is not None:  # an edge list (built for GPUs): the reference
        return torch_ops.spgemm(g, values, indices, num_dst, dim)
    out = values.new_empty(num_dst, dim)                              # [num_dst, dim]
    weight, weighted = _weight(g.weight, values.dtype, values)
    kernels.spgemm_rows(g.rowptr.numpy(), g.col.numpy(), weight, weighted,
                        values.detach().contiguous().numpy(), indices.contiguous().numpy(),
                        out.numpy())
    return as_dtype(out, spgemm_dtype(values, g))


def maxk_aggregate(g: GraphOperands, x: Tensor, k: int, num_dst: int, with_dense: bool,
                   scale: Optional[Tensor] = None
                   ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """``(agg, values, indices, dense or None)``: :func:`maxk_select` of
    ``x [N, dim]`` (``k < dim``, ``N > 0``), times the dropout ``scale [N,
    k]`` where given, :func:`spgemm` of it over ``g`` and, with
    ``with_dense``, its :func:`cbsr_to_dense`, in one kernel call
    (``kernels.maxk_aggregate_rows``)."""
    if g.row is not None:  # an edge list: the steps one by one
        values, indices = maxk_select(x, k)
        if scale is not None:
            values = values.mul_(scale)
        dense = cbsr_to_dense(values, indices, x.size(1)) if with_dense else None
        return spgemm(g, values, indices, num_dst, x.size(1)), values, indices, dense
    n, dim = x.shape
    x = x.detach().contiguous()
    values = x.new_empty(n, k)                                        # [N, k]
    indices = torch.empty(n, k, dtype=index_dtype_for(dim))           # [N, k]
    dense = x.new_empty(n, dim) if with_dense else None               # [N, dim]
    out = x.new_empty(num_dst, dim)                                   # [num_dst, dim]
    weight, weighted = _weight(g.weight, x.dtype, x)
    kernels.maxk_aggregate_rows(x.numpy(), k, _given(scale, x.dtype, x), scale is not None,
                                values.numpy(), indices.numpy(), _given(dense, x.dtype, x),
                                with_dense, g.rowptr.numpy(), g.col.numpy(), weight, weighted,
                                out.numpy())
    return as_dtype(out, spgemm_dtype(values, g)), values, indices, dense


def sspmm(g: GraphOperands, indices: Tensor, grad_out: Tensor, num_src: int) -> Tensor:
    """The gradient ``[num_src, k]`` of :func:`spgemm` w.r.t. the CBSR values,
    one thread per source row of the transposed graph (no atomics)."""
    if g.row is not None:
        return torch_ops.sspmm(g, indices, grad_out, num_src)
    grad_values = grad_out.new_empty(num_src, indices.size(1))        # [num_src, k]
    weight, weighted = _weight(g.weight_t, grad_out.dtype, grad_out)
    kernels.sspmm_rows(g.colptr.numpy(), g.row_t.numpy(), weight, weighted,
                       indices.contiguous().numpy(), grad_out.detach().contiguous().numpy(),
                       grad_values.numpy())
    return grad_values


def maxk_input_grad(g: GraphOperands, indices: Tensor, grad_agg: Optional[Tensor],
                    grad_values: Optional[Tensor], grad_dense: Optional[Tensor],
                    dim: int, dtype: torch.dtype, scale: Optional[Tensor] = None) -> Tensor:
    """The gradient ``[num_src, dim]`` of MaxK and the aggregation of its
    CBSR w.r.t. the features, from the gradients of the aggregation
    (``[num_dst, dim]``), of the CBSR values (``[num_src, k]``) and of the
    dense form (``[num_src, dim]``), each None when absent, through the
    dropout ``scale`` (``[num_src, k]``) of the kept values where given; all
    of ``dtype``. :func:`sspmm`, the sum, the scale and :func:`cbsr_to_dense`
    in one kernel (``kernels.input_grad_rows``)."""
    if g.row is not None:
        grad = torch.zeros(indices.shape, dtype=dtype)
        if grad_agg is not None:
            grad += torch_ops.sspmm(g, indices, grad_agg, indices.size(0))
        if grad_values is not None:
            grad += grad_values
        if grad_dense is not None:
            grad += gather_at(grad_dense, indices)
        if scale is not None:
            grad *= scale
        return cbsr_to_dense(grad, indices, dim)
    grad_x = torch.empty(indices.size(0), dim, dtype=dtype)           # [num_src, dim]
    if grad_x.numel() == 0:
        return grad_x
    weight, weighted = _weight(g.weight_t, dtype, grad_x)
    kernels.input_grad_rows(g.colptr.numpy(), g.row_t.numpy(), weight, weighted,
                            indices.contiguous().numpy(), _given(grad_agg, dtype, grad_x),
                            grad_agg is not None, _given(grad_values, dtype, grad_x),
                            grad_values is not None, _given(grad_dense, dtype, grad_x),
                            grad_dense is not None, _given(scale, dtype, grad_x),
                            scale is not None, grad_x.numpy())
    return grad_x


def sddmm(g: GraphOperands, values: Tensor, indices: Tensor, grad_out: Tensor) -> Tensor:
    """The gradient ``[E]`` of :func:`spgemm` w.r.t. the edge values (in CSR
    order), one thread per output row."""
    if g.row is not None:
        return torch_ops.sddmm(g, values, indices, grad_out)
    grad_weight = grad_out.new_empty(g.col.numel())                   # [E]
    kernels.sddmm_rows(g.rowptr.numpy(), g.col.numpy(), values.detach().contiguous().numpy(),
                       indices.contiguous().numpy(), grad_out.detach().contiguous().numpy(),
                       grad_weight.numpy())
    return grad_weight


#: Most ``[dim, out]`` partial weight gradients summed per backward (one per
#: thread at most): bounds their memory on many-core machines.
MAX_WEIGHT_GRAD_PARTS = 16


def cbsr_linear(values: Tensor, indices: Tensor, dim: int, weight: Tensor,
                bias: Optional[Tensor]) -> Tensor:
    """``dense(h) @ weight.T + bias`` as ``[N, out]`` for the CBSR ``h =
    (values, indices)``, without building ``dense(h)`` (all of one float
    dtype)."""
    n = values.size(0)
    out = values.new_empty(n, weight.size(0))                      # [N, out]
    if n > 0:
        weight_t = _transposed(weight)                             # [dim, out]
        kernels.linear_rows(values.detach().contiguous().numpy(), indices.contiguous().numpy(),
                            weight_t.numpy(),
                            (bias if bias is not None else weight_t[0]).detach().numpy(),
                            bias is not None, out.numpy())
    return out


def cbsr_linear_backward(grad_out: Tensor, values: Tensor, indices: Tensor, weight: Tensor,
                         dim: int, need_values: bool,
                         need_weight: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(grad_values [N, k], grad_weight [out, dim])`` of :func:`cbsr_linear`
    (either None when not needed): ``(grad_out @ W)`` sampled at the CBSR
    pattern, and ``grad_out^T @ dense(h)`` scattered from the CBSR rows."""
    n = values.size(0)
    grad_out = grad_out.detach().contiguous()
    grad_values = grad_weight = None
    index_array = indices.contiguous().numpy()
    if need_values:
        if n > 0 and weight.size(0) > 0:
            grad_values = values.new_empty(values.shape)           # [N, k], written whole
            weight_t = _transposed(weight)                         # [dim, out]
            kernels.linear_input_grad_rows(grad_out.numpy(), index_array, weight_t.numpy(),
                                           grad_values.numpy())
        else:  # no output features: nothing reaches the values
            grad_values = values.new_zeros(values.shape)
    if need_weight:
        num_parts = max(1, min(torch.get_num_threads(), MAX_WEIGHT_GRAD_PARTS, n))
        parts = values.new_empty(num_parts, dim, weight.size(0))   # [parts, dim, out]
        kernels.linear_weight_grad_parts(grad_out.numpy(), values.detach().contiguous().numpy(),
                                         index_array, parts.numpy())
        grad_weight = values.new_empty(weight.shape)               # [out, dim]
        kernels.sum_parts_transposed(parts.numpy(), grad_weight.numpy())
    return grad_values, grad_weight


def _transposed(weight: Tensor) -> Tensor:
    """``weight.T`` as a C-contiguous ``[dim, out]`` tensor (the layout the
    linear kernels read rows of); a blocked parallel copy, where torch's
    transposing copy is single-threaded."""
    weight = weight.detach().contiguous()
    out = weight.new_empty(weight.size(1), weight.size(0))
    if out.numel() > 0:
        kernels.transpose_into(weight.numpy(), out.numpy())
    return out

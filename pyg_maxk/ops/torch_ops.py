"""The ``"torch"`` backend's implementations, the reference semantics: MaxK
is :func:`torch.topk`, densify a scatter, the aggregation a ``torch.sparse``
CSR product, the linear map densify + :func:`torch.nn.functional.linear`.
Plain functions, not differentiable: :mod:`pyg_maxk.ops._library` wraps them
(with the other backends') as custom ops with autograd.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cbsr import index_dtype_for
from ..dispatch import float_atomics_allowed
from ..graph import GraphOperands
from ._common import aggregation_dtype, autocast_disabled, dtype_of, spgemm_dtype

Densify = Callable[[Tensor, Tensor, int], Tensor]
Gather = Callable[[Tensor, Tensor], Tensor]


def maxk_select(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """``(values, indices)`` of :func:`torch.topk` (by decreasing value)."""
    values, idx = torch.topk(x, k, dim=1)
    return values, idx.to(index_dtype_for(x.size(1)))


def cbsr_to_dense(values: Tensor, indices: Tensor, dim: int) -> Tensor:
    """A zero-fill and a scatter."""
    out = values.new_zeros(values.size(0), dim)
    # In place: out-of-place scatter would copy the zeros once more.
    return out.scatter_(1, indices.long(), values)


def gather_at(dense: Tensor, indices: Tensor) -> Tensor:
    """``dense`` at the CBSR pattern ``indices``: ``[N, k]``."""
    return dense.gather(1, indices.long())


def column_sums(x: Tensor) -> Tensor:
    """``x.sum(0)``: the gradient of a bias."""
    return x.sum(0)


def csr_matrix(rowptr: Tensor, col: Tensor, weight: Optional[Tensor], num_dst: int,
               num_src: int, dtype: torch.dtype) -> Tensor:
    """The ``[num_dst, num_src]`` ``torch.sparse_csr`` matrix of the graph."""
    values = (torch.ones(col.numel(), dtype=dtype, device=col.device) if weight is None
              else weight.to(dtype))
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(rowptr, col, values, size=(num_dst, num_src),
                                       check_invariants=False)


def edge_targets(rowptr: Tensor, num_edges: int) -> Tensor:
    """The target row (int64) of every edge of the CSR rows ``rowptr``, in
    CSR order; sized from ``num_edges``, without a host sync."""
    num_dst = rowptr.numel() - 1
    return torch.repeat_interleave(torch.arange(num_dst, device=rowptr.device),
                                   (rowptr[1:] - rowptr[:-1]).long(), output_size=num_edges)


def spmm(rowptr: Tensor, col: Tensor, weight: Optional[Tensor], dense: Tensor, num_src: int,
         transpose: bool) -> Tensor:
    """``A @ dense`` (``[num_dst, d]``) or, with ``transpose``, ``A^T @ dense``
    (``[num_src, d]``) for the CSR graph ``A`` of ``num_src`` columns, in
    ``dense``'s dtype promoted with the edge values' (torch's rule)."""
    num_dst = rowptr.numel() - 1
    if dense.is_cuda and not float_atomics_allowed():
        # cuSPARSE's transposed product is not reproducible bit for bit;
        # torch's index_add_ sums in a fixed order under deterministic mode.
        row = edge_targets(rowptr, col.numel())
        if transpose:
            return edge_list_spmm(row, col, weight, dense, num_src)
        return edge_list_spmm(col, row, weight, dense, num_dst)
    out_dtype = aggregation_dtype(dense.dtype, dtype_of(weight), None)
    # Half-precision features accumulate in float32, as the kernels do (and
    # torch.sparse has no half CSR product on the CPU).
    dtype = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    adj = csr_matrix(rowptr, col, weight, num_dst, num_src, dtype)
    if transpose:
        adj = adj.t()
    with autocast_disabled(dense.device.type):
        return torch.sparse.mm(adj, dense.to(dtype)).to(out_dtype)


def edge_list_spmm(src: Tensor, dst: Tensor, weight: Optional[Tensor], dense: Tensor,
                   num_out: int) -> Tensor:
    """``out[dst[e]] += weight[e] * dense[src[e]]`` over an edge list in any
    order (``[num_out, d]``), in :func:`spmm`'s dtype: the same product as
    :func:`spmm`, or with ``src`` and ``dst`` swapped its transpose."""
    out_dtype = aggregation_dtype(dense.dtype, dtype_of(weight), None)
    dtype = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    with autocast_disabled(dense.device.type):
        messages = dense.to(dtype).index_select(0, src.long())
        if weight is not None:
            messages = messages * weight.to(dtype).unsqueeze(1)
        out = messages.new_zeros(num_out, dense.size(1))
        return out.index_add_(0, dst.long(), messages).to(out_dtype)


def spgemm(g: GraphOperands, values: Tensor, indices: Tensor, num_dst: int,
           dim: int) -> Tensor:
    """``A @ dense(h)``."""
    if g.row is not None:  # an edge list
        return edge_list_spmm(g.col, g.row, g.weight, cbsr_to_dense(values, indices, dim),
                              num_dst).to(spgemm_dtype(values, g))
    return spmm(g.rowptr, g.col, g.weight, cbsr_to_dense(values, indices, dim),
                values.size(0), False).to(spgemm_dtype(values, g))


def sspmm(g: GraphOperands, indices: Tensor, grad_out: Tensor, num_src: int) -> Tensor:
    """``(A^T @ grad_out)`` sampled at the CBSR pattern, in ``grad_out``'s dtype."""
    if g.row is not None:  # an edge list
        grad = edge_list_spmm(g.row, g.col, g.weight, grad_out, num_src)
    else:
        grad = spmm(g.rowptr, g.col, g.weight, grad_out, num_src, True)
    grad = grad.gather(1, indices.long())
    return grad.to(grad_out.dtype)


#: Entries of ``[edges, k]`` that :func:`sddmm` gathers at once: its int64
#: gather indices take 8 bytes each, so a whole graph at once would hold
#: ``8 * E * k`` bytes (29 GB on a 114M-edge graph at k=32).
SDDMM_CHUNK_ENTRIES = 1 << 24


def sddmm(g: GraphOperands, values: Tensor, indices: Tensor, grad_out: Tensor) -> Tensor:
    """The gradient ``[E]`` of :func:`spgemm` w.r.t. the edge values (CSR
    order): for ``e = (c -> r)``, ``sum_j values[c, j] * grad_out[r, indices[c, j]]``,
    accumulated in float32 at least, over chunks of edges of bounded memory
    (:data:`SDDMM_CHUNK_ENTRIES`)."""
    dtype = torch.promote_types(values.dtype, torch.float32)
    num_edges = g.col.numel()
    if g.row is not None:  # an edge list, in its order
        row = g.row.long()
    else:
        row = edge_targets(g.rowptr, num_edges)
    col = g.col.long()
    grad_out = grad_out.to(dtype)
    out = torch.empty(num_edges, dtype=dtype, device=grad_out.device)
    step = max(1, SDDMM_CHUNK_ENTRIES // max(1, indices.size(1)))
    for start in range(0, num_edges, step):
        r, c = row[start:start + step], col[start:start + step]
        sampled = grad_out[r.unsqueeze(1), indices[c].long()]    # [chunk, k]
        out[start:start + step] = (sampled * values[c].to(dtype)).sum(1)
    return out


def cbsr_linear(values: Tensor, indices: Tensor, dim: int, weight: Tensor,
                bias: Optional[Tensor], densify: Densify = cbsr_to_dense) -> Tensor:
    """``F.linear(densify(h), weight, bias)``."""
    with autocast_disabled(values.device.type):
        return F.linear(densify(values, indices, dim), weight, bias)


def cbsr_linear_backward(grad_out: Tensor, values: Tensor, indices: Tensor, weight: Tensor,
                         dim: int, need_values: bool, need_weight: bool,
                         densify: Densify = cbsr_to_dense, gather: Gather = gather_at
                         ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(grad_out @ W)`` at the CBSR pattern and ``grad_out^T @ dense(h)``
    (None where not needed), rebuilding ``dense(h)`` from the CBSR."""
    grad_values = grad_weight = None
    with autocast_disabled(grad_out.device.type):
        if need_values:
            grad_values = gather(grad_out @ weight, indices)
        if need_weight:
            grad_weight = grad_out.t() @ densify(values, indices, dim)
    return grad_values, grad_weight

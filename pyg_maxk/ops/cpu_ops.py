"""The ``"cpu"`` backend: MaxK selection and CBSR aggregation with the Numba
CPU kernels of :mod:`pyg_maxk.kernels.cpu`, differentiable w.r.t. the
features and the CBSR values.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..cbsr import CBSR, index_dtype_for
from ..graph import CSRGraph
from ..kernels import cpu as kernels


def maxk_select(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """``(values [N, k], indices [N, k])`` of the ``k`` largest entries per row
    of ``x [N, dim]`` (``k < dim``), in column order; ``values`` is
    differentiable w.r.t. ``x`` (a gather)."""
    n, dim = x.shape
    indices = torch.empty(n, k, dtype=index_dtype_for(dim))
    if n > 0:
        kernels.select_rows(x.detach().contiguous().numpy(), k, indices.numpy())
    return x.gather(1, indices.long()), indices


def _weight(weight: Optional[Tensor], dtype: torch.dtype, like: Tensor):
    """(edge values as a numpy array of ``dtype``, whether they are real)."""
    if weight is None:
        return like.new_empty(1, dtype=dtype).numpy(), False
    return weight.to(dtype).contiguous().numpy(), True


class _SpGEMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, indices: Tensor, graph: CSRGraph, dim: int) -> Tensor:
        out = values.new_zeros(graph.num_dst, dim)                    # [num_dst, dim]
        weight, weighted = _weight(graph.weight, values.dtype, values)
        kernels.spgemm_rows(graph.rowptr.numpy(), graph.col.numpy(), weight, weighted,
                            values.detach().contiguous().numpy(), indices.numpy(),
                            out.numpy())
        ctx.graph = graph
        ctx.save_for_backward(indices)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (indices,) = ctx.saved_tensors
        graph: CSRGraph = ctx.graph
        colptr, row, weight_t = graph.transposed()
        grad_values = grad_out.new_zeros(graph.num_src, indices.size(1))  # [num_src, k]
        weight, weighted = _weight(weight_t, grad_out.dtype, grad_out)
        kernels.sspmm_rows(colptr.numpy(), row.numpy(), weight, weighted, indices.numpy(),
                           grad_out.contiguous().numpy(), grad_values.numpy())
        return grad_values, None, None, None


def spgemm(graph: CSRGraph, h: CBSR) -> Tensor:
    """``graph @ h`` as ``[num_dst, dim]``, differentiable w.r.t. ``h.values``."""
    return _SpGEMM.apply(h.values, h.indices.contiguous(), graph, h.dim)

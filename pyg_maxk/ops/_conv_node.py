"""The eager path of :func:`pyg_maxk.ops.maxk_aggregate_linear`: MaxK, the
aggregation and a conv's linear maps in one autograd node.

On a small graph a training step is bound by host time, and each autograd
node costs some: where :func:`~pyg_maxk.ops.maxk_aggregate` and the conv's
GEMMs make three to five nodes per conv (the op's, each GEMM's and each
transposed weight's), this Function makes one. It runs the same kernels and
the same GEMMs in the same order, so its results equal the composition's;
its backward computes the GEMMs' gradients itself and passes the features'
on to the kernels' backward (:func:`~._library._family_input_grad`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..graph import PackedGraph, unpack
from ._common import PLAIN_TENSORS
from ._library import _eager_kernels, _family_forward, _family_input_grad


def maxk_aggregate_linear_eager(x: Tensor, k: int, graph: PackedGraph, num_dst: int,
                                weight: Tensor, bias: Optional[Tensor],
                                root_weight: Optional[Tensor], root_scale: Optional[Tensor],
                                scale: Optional[Tensor], backend: str) -> Optional[Tensor]:
    """``(A h + root_scale * h) @ weight.T + bias + h @ root_weight.T`` for
    ``h`` the MaxK of ``x`` times the dropout ``scale`` (each optional term
    left out where None), as one autograd node, in eager mode where one
    kernel family runs MaxK and the aggregation
    (:func:`~._library.maxk_aggregate_eager`'s conditions) and every weight
    is a plain tensor of ``x``'s dtype; None elsewhere (then compose the
    ops). ``root_scale`` takes no gradient."""
    kernels = _eager_kernels(x, k, graph, scale, backend)
    if kernels is None:
        return None
    for t in (weight, bias, root_weight, root_scale):
        if t is not None and (type(t) not in PLAIN_TENSORS or t.dtype != x.dtype):
            return None
    if root_scale is not None and root_scale.requires_grad:
        return None
    return run_node(kernels, x, k, graph, num_dst, weight, bias, root_weight, root_scale, scale)


def run_node(kernels: str, x: Tensor, k: int, graph: PackedGraph, num_dst: int,
             weight: Tensor, bias: Optional[Tensor], root_weight: Optional[Tensor],
             root_scale: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
    """:func:`maxk_aggregate_linear_eager` where its conditions are known to
    hold, with ``kernels`` the family that runs it
    (:func:`~._library._eager_kernels`)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or any(
            t is not None and t.requires_grad for t in (bias, root_weight))):
        return _apply(x, weight, bias, root_weight, root_scale, scale, graph, k, num_dst,
                      kernels)
    return _forward(kernels, unpack(*graph), x, k, num_dst, weight, bias, root_weight,
                    root_scale, scale, None)[0]


def _forward(kernels: str, g, x: Tensor, k: int, num_dst: int, weight: Tensor,
             bias: Optional[Tensor], root_weight: Optional[Tensor],
             root_scale: Optional[Tensor], scale: Optional[Tensor], sums: Optional[Tensor]):
    """``(out, the GEMM's input, h's dense form or None, h's indices)``."""
    with_dense = root_weight is not None or root_scale is not None
    agg, _, indices, dense = _family_forward(kernels, g, x, k, num_dst, with_dense, scale, sums)
    if root_scale is not None:
        agg = agg.addcmul_(dense, root_scale)  # agg is fresh
    out = agg.mm(weight.t()) if bias is None else torch.addmm(bias, agg, weight.t())
    if root_weight is not None:
        out = out.addmm_(dense, root_weight.t())  # out is fresh: cuBLAS's beta = 1
    return out, agg, dense, indices


def _node_forward(ctx, x, weight, bias, root_weight, root_scale, scale, graph, k, num_dst,
                  kernels):
    needs_x, needs_weight, needs_bias, needs_root = ctx.needs_input_grad[:4]
    # The Numba select launch also zeroes the backward's SSpMM sums.
    sums = (torch.empty(x.size(0), k, dtype=torch.float32, device=x.device)
            if kernels == "numba" and needs_x else None)
    g = unpack(*graph)
    out, agg, dense, indices = _forward(kernels, g, x, k, num_dst, weight, bias, root_weight,
                                        root_scale, scale, sums)
    # Only what the asked-for gradients read is kept alive. The graph's
    # arrays, which need no gradient (_eager_kernels), are kept as views.
    ctx.save_for_backward(
        indices if needs_x else None, scale, agg if needs_weight else None,
        dense if needs_root else None, weight if needs_x else None,
        root_weight if needs_x else None, root_scale if needs_x else None)
    ctx.graph, ctx.dim, ctx.dtype = g, x.size(1), x.dtype
    ctx.kernels, ctx.sums = kernels, sums
    return out


def _node_backward(ctx, grad_out):
    if torch.is_grad_enabled():
        # create_graph=True: gradients whose own backward refuses (the
        # kernels' backward has no derivative of its own).
        return _once_differentiable_backward(ctx, grad_out)
    return _gradients(ctx, grad_out)


def _gradients(ctx, grad_out):
    indices, scale, agg, dense, weight, root_weight, root_scale = ctx.saved_tensors
    needs_x, needs_weight, needs_bias, needs_root = ctx.needs_input_grad[:4]
    grad_out = grad_out.contiguous()
    grad_weight = grad_out.t().mm(agg) if needs_weight else None
    grad_bias = grad_out.sum(0) if needs_bias else None
    grad_root = grad_out.t().mm(dense) if needs_root else None
    grad_x = None
    if needs_x:
        grad_agg = grad_out.mm(weight)
        if root_weight is not None:
            grad_dense = grad_out.mm(root_weight)
        elif root_scale is not None:
            grad_dense = grad_agg * root_scale
        else:
            grad_dense = None
        # The zeroed sums serve one backward (retain_graph=True may run more).
        sums, ctx.sums = ctx.sums, None
        grad_x = _family_input_grad(ctx.kernels, ctx.graph, indices, grad_agg, None, grad_dense,
                                    ctx.dim, ctx.dtype, scale, sums)
    return grad_x, grad_weight, grad_bias, grad_root, None, None, None, None, None, None


_once_differentiable_backward = once_differentiable(_gradients)


# The C++ apply under Function.apply (see _library's eager path); the node is
# named "maxk_aggregate_linear_functionBackward".
_apply = super(torch.autograd.Function, type(
    "maxk_aggregate_linear_function", (torch.autograd.Function,),
    {"forward": staticmethod(_node_forward), "backward": staticmethod(_node_backward)})).apply

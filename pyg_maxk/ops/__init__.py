"""The functional MaxK ops: :func:`maxk` (dense -> CBSR) and :func:`aggregate`
(CSR graph x CBSR -> dense), each dispatched to the active backend.

Both are differentiable. The ``"torch"`` backend is the reference semantics;
the ``"numba"`` backend runs the same maths in :mod:`pyg_maxk.kernels`.
"""
from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backend import resolve_backend
from ..cbsr import CBSR, index_dtype_for
from ..graph import CSRGraph


def check_k(k: object) -> int:
    """``k`` as a positive int, or a :class:`ValueError`."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if k <= 0:
        raise ValueError(f"k must be a positive integer, got {k}")
    return k


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, skipped when ``t`` has that type already: even a
    no-op ``to`` costs 1-2 us of host time, and small graphs are host-bound."""
    return t if t.dtype == dtype else t.to(dtype)


def _check_features(x: Tensor, what: str = "x") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{what} must be a 2-D [num_nodes, channels] tensor, "
                         f"got shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating point tensor, got {x.dtype}")


#: Widest rows the Numba select kernel takes (each lane holds dim / 32 keys in
#: registers); measured on an H200 up to this width, where it beat
#: :func:`torch.topk` 2.8-7x for every k (232,965 and 2,449,029 rows).
MAX_SELECT_DIM = 1024


def maxk(x: Tensor, k: int, *, dropout: float = 0.0, training: bool = False) -> CBSR:
    r"""Keep the ``k`` largest entries of every row of ``x`` (the entries
    :func:`torch.topk` keeps) and return them as a :class:`CBSR`.

    Gradients flow to the kept entries only. ``k >= x.size(1)`` keeps every
    entry (the identity). The ``"numba"`` and ``"cpu"`` backends keep the
    lowest columns among tied values and write each row's entries in column
    order on the CPU, by column mod 32 then column on a GPU (fewer shared-
    memory bank conflicts downstream); the ``"torch"`` backend writes them in
    :func:`torch.topk` order. Nothing downstream depends on the order.
    ``dropout`` is applied to the kept values, as in the MaxK-GNN paper.

    Args:
        x (torch.Tensor): ``[N, dim]`` features.
        k (int): entries kept per row.
        dropout (float): dropout probability on the kept values.
        training (bool): whether dropout is active.

    Returns:
        CBSR with ``values [N, min(k, dim)]`` and ``indices [N, min(k, dim)]``.
    """
    k = check_k(k)
    _check_features(x)
    n, dim = x.shape
    if k >= dim:
        indices = torch.arange(dim, device=x.device, dtype=index_dtype_for(dim))
        out = CBSR(x, indices.expand(n, dim), dim)
    elif (backend := resolve_backend(x)) == "numba" and dim <= MAX_SELECT_DIM:
        from .numba_ops import maxk_select
        values, indices = maxk_select(x, k)
        out = CBSR(values, indices, dim)
    elif backend == "cpu":
        from .cpu_ops import maxk_select
        out = CBSR(*maxk_select(x, k), dim)
    else:
        values, idx = torch.topk(x, k, dim=1)
        out = CBSR(values, idx.to(index_dtype_for(dim)), dim)
    if dropout > 0.0 and training:
        out = out.with_values(F.dropout(out.values, dropout, training=True))
    return out


def _runs(t: Tensor, backend: str) -> bool:
    """Whether the active backend is ``backend`` for ``t``; a backend forced
    where it cannot run counts as not (the callers have a torch path with the
    same result)."""
    try:
        return resolve_backend(t) == backend
    except (TypeError, RuntimeError):
        return False


def _runs_numba(t: Tensor) -> bool:
    return _runs(t, "numba")


def to_dense(h: CBSR) -> Tensor:
    """The dense ``[N, dim]`` form of ``h`` (:meth:`CBSR.to_dense`),
    differentiable w.r.t. ``h.values``. The ``"numba"`` backend writes each row
    once from shared memory; elsewhere it is a zero-fill and a scatter."""
    if not h.is_full and _runs_numba(h.values):
        from .numba_ops import supports_to_dense, to_dense as numba_to_dense
        if supports_to_dense(h.dim):  # else too wide for shared memory: scatter below
            return numba_to_dense(h)
    out = h.values.new_zeros(h.num_rows, h.dim)
    # In place: out-of-place scatter would copy the zeros once more.
    return out.scatter_(1, h.long_indices(), h.values)


def aggregate(graph: CSRGraph, h: Union[CBSR, Tensor]) -> Tensor:
    r"""The sparse product :math:`\mathbf{A} \mathbf{H}`: row ``i`` of the
    result is :math:`\sum_{e = (j \rightarrow i)} a_e \mathbf{h}_j`.

    Args:
        graph (CSRGraph): ``[num_dst, num_src]`` adjacency.
        h (CBSR or torch.Tensor): ``[num_src, dim]`` source features.

    Returns:
        ``[num_dst, dim]`` dense tensor.
    """
    rows = h.num_rows if isinstance(h, CBSR) else h.size(0)
    if rows != graph.num_src:
        raise ValueError(f"The features have {rows} rows but the graph has "
                         f"{graph.num_src} source nodes")
    if h.device != graph.device:
        raise ValueError(f"The features are on {h.device} but the graph is on "
                         f"{graph.device}; move both to the same device")
    if isinstance(h, Tensor) or h.is_full:
        dense = h if isinstance(h, Tensor) else h.values
        return torch.sparse.mm(graph.torch_csr(dense.dtype), dense)
    backend = resolve_backend(h.values)
    if backend == "numba":
        from .numba_ops import spgemm, supports
        if supports(h.k, h.dim):  # else too wide for shared memory: torch below
            return spgemm(graph, h)
    elif backend == "cpu":
        from .cpu_ops import spgemm
        return spgemm(graph, h)
    return torch.sparse.mm(graph.torch_csr(h.dtype), h.to_dense())


def _runs_linear_kernel(values: Tensor, indices: Tensor, dim: int, weight: Tensor,
                        bias: Tensor | None) -> bool:
    """Whether the forward of :func:`cbsr_linear` runs the ``"numba"`` CBSR
    linear kernel: float32 throughout (it computes in float32, where autocast
    would have F.linear run in half), and a shape that its shared memory takes
    and where it beats densify + GEMM (:func:`.numba_ops.prefers_linear`)."""
    if not _runs_numba(values) or torch.is_autocast_enabled(values.device.type):
        return False
    if any(t is not None and t.dtype != torch.float32 for t in (values, weight, bias)):
        return False
    from .numba_ops import prefers_linear
    return prefers_linear(values.size(0), dim, indices.size(1))


def _runs_cpu_linear(values: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :func:`cbsr_linear` runs the ``"cpu"`` backend's CBSR linear
    kernels, forward and backward: one float type throughout and no autocast
    (the kernels compute in the values' type). CUDA tensors are turned away
    before the backend is resolved: the GPU paths resolve it themselves."""
    if values.is_cuda or not _runs(values, "cpu") or torch.is_autocast_enabled("cpu"):
        return False
    return all(t is None or t.dtype == values.dtype for t in (weight, bias))


class _CBSRLinear(torch.autograd.Function):
    """``F.linear(h.to_dense(), weight, bias)`` that keeps only ``h``'s CBSR
    for the backward and rebuilds the dense matrix there, rather than holding
    an ``[N, dim]`` dense input between forward and backward. The ``"numba"``
    backend's forward never builds it (:mod:`pyg_maxk.kernels.linear`); the
    ``"cpu"`` backend's forward and backward never do
    (:func:`pyg_maxk.kernels.cpu.linear_rows`)."""

    @staticmethod
    def forward(ctx, values: Tensor, indices: Tensor, dim: int, weight: Tensor, bias):
        ctx.save_for_backward(values, indices, weight)
        ctx.dim = dim
        ctx.cpu_kernels = _runs_cpu_linear(values, weight, bias)
        if ctx.cpu_kernels:
            from .cpu_ops import cbsr_linear as cpu_cbsr_linear
            return cpu_cbsr_linear(values, indices, weight, bias)
        if _runs_linear_kernel(values, indices, dim, weight, bias):
            from .numba_ops import cbsr_linear as numba_cbsr_linear
            return numba_cbsr_linear(values, indices, dim, weight, bias)
        dense = CBSR(values, indices, dim).to_dense()
        return F.linear(dense, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        values, indices, weight = ctx.saved_tensors
        if ctx.cpu_kernels and grad_out.dtype == values.dtype:
            from .cpu_ops import cbsr_linear_backward
            grad_values, grad_weight = cbsr_linear_backward(
                grad_out, values, indices, weight, ctx.dim, ctx.needs_input_grad[0],
                ctx.needs_input_grad[3])
            grad_bias = grad_out.sum(0) if ctx.needs_input_grad[4] else None
            return grad_values, None, None, grad_weight, grad_bias
        h = CBSR(as_dtype(values, grad_out.dtype), indices, ctx.dim)
        grad_values = grad_weight = grad_bias = None
        w = as_dtype(weight, grad_out.dtype)  # autocast's forward may have run in half
        if ctx.needs_input_grad[0]:
            grad_values = as_dtype((grad_out @ w).gather(1, h.long_indices()), values.dtype)
        if ctx.needs_input_grad[3]:
            grad_weight = as_dtype(grad_out.t() @ h.to_dense(), weight.dtype)
        if ctx.needs_input_grad[4]:
            grad_bias = as_dtype(grad_out.sum(0), weight.dtype)
        return grad_values, None, None, grad_weight, grad_bias


def cbsr_linear(h: CBSR, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    r"""``h.to_dense() @ weight.T + bias``, saving only the CBSR (``[N, k]``)
    for the backward instead of the ``[N, dim]`` dense input.

    Args:
        h (CBSR): ``[N, dim]`` sparse input.
        weight (torch.Tensor): ``[out, dim]``.
        bias (torch.Tensor, optional): ``[out]``.

    Returns:
        ``[N, out]`` dense tensor.
    """
    if h.is_full:
        return F.linear(h.values, weight, bias)
    return _CBSRLinear.apply(h.values, h.indices, h.dim, weight, bias)


__all__ = ["maxk", "aggregate", "cbsr_linear", "check_k", "to_dense"]

"""The functional MaxK ops: :func:`maxk` (dense -> CBSR), :func:`to_dense`,
:func:`aggregate` (CSR graph x CBSR -> dense), :func:`maxk_aggregate` (the
first and the third in one op), :func:`maxk_aggregate_linear` (that and a
conv's linear maps) and :func:`cbsr_linear`.

Each checks its input, asks :func:`pyg_maxk.dispatch.choose` for a backend
and calls a custom op of :mod:`._library` with it. All are differentiable
and compile-clean. The ``"torch"`` backend is the reference semantics; the
``"numba"`` and ``"cpu"`` backends run the same maths in
:mod:`pyg_maxk.kernels`.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cbsr import CBSR, index_dtype_for
from ..dispatch import get_backend
from ..graph import CSRGraph, EdgeListGraph
from . import _library as lib
from ._common import aggregation_dtype, as_dtype, dtype_of
from ._conv_node import maxk_aggregate_linear_eager


def check_k(k: object) -> int:
    """``k`` as a positive int, or a :class:`ValueError`."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if k <= 0:
        raise ValueError(f"k must be a positive integer, got {k}")
    return k


def _check_features(x: Tensor, what: str = "x") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{what} must be a 2-D [num_nodes, channels] tensor, "
                         f"got shape {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating point tensor, got {x.dtype}")


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
    else:
        out = CBSR(*lib.maxk_select(x, k, get_backend()), dim)
    scale = dropout_scale(x, out.values.size(1), dropout, training)
    if scale is not None:  # in the values' type, rounded once (as maxk_aggregate's)
        out = out.with_values(as_dtype(out.values * scale, out.values.dtype))
    return out


def dropout_scale(x: Tensor, k: int, p: float, training: bool) -> Optional[Tensor]:
    """The factors ``[N, k]`` of dropout with probability ``p`` on the ``k``
    values MaxK keeps per row of ``x [N, dim]``: each ``0`` with probability
    ``p``, else ``1 / (1 - p)`` (what :func:`torch.nn.functional.dropout`
    multiplies by), in float32 at least (a half-precision value times it
    rounds once, as in ``F.dropout``); None where no dropout applies
    (``p == 0`` or not ``training``). :func:`maxk` and
    :func:`maxk_aggregate` draw their dropout here, so that one seed gives
    both the same draw."""
    if not (p > 0.0 and training):
        return None
    if p >= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    if x.is_cuda:  # ATen's fused dropout of ones: the draw and the scaling in one launch
        return F.dropout(_ones(x.size(0), k, dtype, x.device), p, True)
    return torch.empty(x.size(0), k, dtype=dtype, device=x.device).bernoulli_(
        1.0 - p).div_(1.0 - p)


def _ones(n: int, k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An ``[n, k]`` tensor of ones (one element, expanded), kept per shape
    in eager mode."""
    if torch.compiler.is_compiling():
        return torch.ones((), dtype=dtype, device=device).expand(n, k)
    key = (n, k, dtype, device)
    ones = _ONES.get(key)
    if ones is None:
        if len(_ONES) >= 64:  # mini-batches of many sizes
            _ONES.clear()
        ones = _ONES[key] = torch.ones((), dtype=dtype, device=device).expand(n, k)
    return ones


_ONES: dict = {}


def to_dense(h: CBSR) -> Tensor:
    """The dense ``[N, dim]`` form of ``h`` (:meth:`CBSR.to_dense`),
    differentiable w.r.t. ``h.values``. The ``"numba"`` and ``"cpu"`` backends
    write each row once; the ``"torch"`` backend zero-fills and scatters."""
    if h.is_full:
        return h.to_dense()  # a plain scatter, differentiable by torch itself
    return lib.cbsr_to_dense(h.values, h.indices, h.dim, get_backend())


def aggregate(graph: Union[CSRGraph, EdgeListGraph], h: Union[CBSR, Tensor]) -> Tensor:
    r"""The sparse product :math:`\mathbf{A} \mathbf{H}`: row ``i`` of the
    result is :math:`\sum_{e = (j \rightarrow i)} a_e \mathbf{h}_j`.

    Args:
        graph (CSRGraph or EdgeListGraph): ``[num_dst, num_src]`` adjacency.
        h (CBSR or torch.Tensor): ``[num_src, dim]`` source features.

    Returns:
        ``[num_dst, dim]`` dense tensor, in the features' type, promoted with
        the edge values' type where they weight the sum (as PyG's convs:
        GCN's float32 normalisation of bf16 features is float32 under
        autocast); sums of half-precision features accumulate in float32.
    """
    rows = h.num_rows if isinstance(h, CBSR) else h.size(0)
    if rows != graph.num_src:
        raise ValueError(f"The features have {rows} rows but the graph has "
                         f"{graph.num_src} source nodes")
    if h.device != graph.device:
        raise ValueError(f"The features are on {h.device} but the graph is on "
                         f"{graph.device}; move both to the same device")
    if isinstance(h, Tensor) or h.is_full:
        dense = h if isinstance(h, Tensor) else to_dense(h)
        if isinstance(graph, EdgeListGraph):
            graph = graph.csr()
        weight = graph.weight
        if weight is not None and graph.row_scale is not None:
            # A mean: the result keeps the features' type (aggregation_dtype).
            weight = as_dtype(weight, dense.dtype)
        return lib.spmm(graph.rowptr, graph.col, weight, dense, graph.num_src, False)
    return lib.spgemm(*graph.operands(h.k), h.values, h.indices, graph.num_dst, h.dim,
                      get_backend())


def maxk_aggregate(x: Tensor, k: int, graph: Union[CSRGraph, EdgeListGraph], *,
                   with_dense: bool = False, dropout: float = 0.0,
                   training: bool = False) -> Tuple[Tensor, CBSR, Optional[Tensor]]:
    r"""``h = maxk(x, k, dropout=dropout, training=training)`` and
    ``aggregate(graph, h)`` in one op, with one autograd node and one
    backward: what a MaxK conv's input step costs on a small graph, where
    each node's host time counts. The dropout draws as :func:`maxk`'s does
    (:func:`dropout_scale`): one seed gives both the same ``h``.

    Args:
        x (torch.Tensor): ``[num_src, dim]`` features.
        k (int): entries kept per row.
        graph (CSRGraph or EdgeListGraph): ``[num_dst, num_src]`` adjacency.
        with_dense (bool): also return ``h``'s dense form.
        dropout (float): dropout probability on the kept values.
        training (bool): whether dropout is active.

    Returns:
        ``(graph @ h, h, h.to_dense() or None)``, each as :func:`aggregate`,
        :func:`maxk` and :func:`to_dense` give it; gradients flow to ``x``
        (through all three) and to the graph's edge values.
    """
    k = check_k(k)
    _check_features(x)
    if k >= x.size(1):  # every entry kept: the dense aggregation
        h = maxk(x, k, dropout=dropout, training=training)
        return aggregate(graph, h), h, (h.values if with_dense else None)
    _check_graph_of(x, graph)
    # The draw before the op: a custom op's random draws would be opaque to
    # torch.compile (and to CUDA-graph capture of the generator's state).
    scale = dropout_scale(x, k, dropout, training)
    return _maxk_aggregate(x, k, graph, with_dense, scale, get_backend())


def _check_graph_of(x: Tensor, graph: Union[CSRGraph, EdgeListGraph]) -> None:
    if x.size(0) != graph.num_src:
        raise ValueError(f"The features have {x.size(0)} rows but the graph has "
                         f"{graph.num_src} source nodes")
    if x.device != graph.device:
        raise ValueError(f"The features are on {x.device} but the graph is on "
                         f"{graph.device}; move both to the same device")


def _maxk_aggregate(x: Tensor, k: int, graph: Union[CSRGraph, EdgeListGraph], with_dense: bool,
                    scale: Optional[Tensor], backend: str
                    ) -> Tuple[Tensor, CBSR, Optional[Tensor]]:
    """:func:`maxk_aggregate` (``k < dim``) with its dropout's factors drawn."""
    packed = graph.operands(k)
    out = lib.maxk_aggregate_eager(x, k, packed, graph.num_dst, with_dense, scale, backend)
    if out is None:
        out = lib.maxk_aggregate(x, k, *packed, graph.num_dst, with_dense, scale, backend)
    agg, values, indices, dense = out
    return agg, CBSR(values, indices, x.size(1)), (dense if with_dense else None)


def maxk_aggregate_linear(x: Tensor, k: int, graph: Union[CSRGraph, EdgeListGraph],
                          weight: Tensor, bias: Optional[Tensor] = None, *,
                          root_weight: Optional[Tensor] = None,
                          root_scale: Optional[Tensor] = None, dropout: float = 0.0,
                          training: bool = False) -> Tensor:
    r"""A MaxK conv's input step and linear maps: for
    ``h = maxk(x, k, dropout=dropout, training=training)`` (dense form
    :math:`\mathbf{H}`),

    .. math::
        (\mathbf{A} \mathbf{H} + s\,\mathbf{H})\,\mathbf{W}^\top + \mathbf{b}
        + \mathbf{H}\,\mathbf{W}_r^\top

    where ``root_scale`` gives :math:`s` (GIN's :math:`1 + \epsilon`) and
    ``root_weight`` gives :math:`\mathbf{W}_r` (SAGE's root weight); each
    term is left out where its argument is None.

    In eager mode, where one kernel family runs MaxK and the aggregation and
    every weight is a plain tensor of ``x``'s dtype, it is one autograd node
    (the kernels of :func:`maxk_aggregate`, then the GEMMs), where the ops
    one by one make three to five: a small graph's step is bound by host
    time per node. Elsewhere (compiled code, autocast, mixed dtypes, edge
    values that need a gradient) it is :func:`maxk_aggregate` followed by
    the GEMMs, with the same results. Its gradient cannot be differentiated
    again.

    Args:
        x (torch.Tensor): ``[num_src, dim]`` features.
        k (int): entries kept per row.
        graph (CSRGraph or EdgeListGraph): ``[num_dst, num_src]`` adjacency
            (``num_src == num_dst`` with a root term).
        weight (torch.Tensor): ``[out, dim]``.
        bias (torch.Tensor, optional): ``[out]``.
        root_weight (torch.Tensor, optional): ``[out, dim]``.
        root_scale (torch.Tensor, optional): a scalar or one-element tensor,
            taking no gradient.
        dropout (float): dropout probability on the kept values.
        training (bool): whether dropout is active.

    Returns:
        ``[num_dst, out]`` dense tensor.
    """
    k = check_k(k)
    _check_features(x)
    with_dense = root_weight is not None or root_scale is not None
    if with_dense and graph.num_dst != graph.num_src:
        raise ValueError(f"A root term needs as many targets as sources, got a graph of "
                         f"{graph.num_dst} x {graph.num_src}")
    if k >= x.size(1):
        agg, h, dense = maxk_aggregate(x, k, graph, with_dense=with_dense, dropout=dropout,
                                       training=training)
    else:
        _check_graph_of(x, graph)
        scale = dropout_scale(x, k, dropout, training)
        backend = get_backend()
        out = maxk_aggregate_linear_eager(x, k, graph.operands(k), graph.num_dst, weight, bias,
                                          root_weight, root_scale, scale, backend)
        if out is not None:
            return out
        agg, h, dense = _maxk_aggregate(x, k, graph, with_dense, scale, backend)
    if root_scale is not None:
        agg = agg.addcmul_(dense, root_scale)  # agg is fresh
    out = F.linear(agg, weight, bias)
    return out if root_weight is None else out.addmm_(dense, root_weight.t())


def cbsr_linear(h: CBSR, weight: Tensor, bias: Tensor | None = None, *,
                dense: Tensor | None = None, dense_weight: Tensor | None = None) -> Tensor:
    r"""``h.to_dense() @ weight.T + bias``, saving only the CBSR (``[N, k]``)
    for the backward instead of the ``[N, dim]`` dense input. The ``"numba"``
    backend's forward never builds the dense input on large graphs
    (:mod:`pyg_maxk.kernels.linear`); the ``"cpu"`` backend's forward and
    backward never do (:func:`pyg_maxk.kernels.cpu.linear_rows`).

    With ``dense`` and ``dense_weight`` it adds ``dense @ dense_weight.T``
    (SAGE's two linear maps), accumulated in place into the result: one
    output pass, eager and compiled.

    Under autocast with ``h`` in autocast's dtype (as MaxK of autocast's
    output is), the weights, bias and ``dense`` are cast to that dtype, as
    autocast casts ``F.linear``'s operands, and it runs as above. Otherwise,
    under autocast or with operands of different dtypes, it is
    ``F.linear(h.to_dense(), weight, bias)`` (autocast's casts, torch's
    type promotion), plus ``torch.addmm`` of the dense product.

    Args:
        h (CBSR): ``[N, dim]`` sparse input.
        weight (torch.Tensor): ``[out, dim]``.
        bias (torch.Tensor, optional): ``[out]``.
        dense (torch.Tensor, optional): ``[N, dim_dense]``.
        dense_weight (torch.Tensor, optional): ``[out, dim_dense]``.

    Returns:
        ``[N, out]`` dense tensor.
    """
    if (dense is None) != (dense_weight is None):
        raise ValueError("cbsr_linear takes dense and dense_weight together")
    if _autocasts_to(h):
        weight, bias, dense, dense_weight = (
            None if t is None else t.to(h.values.dtype)
            for t in (weight, bias, dense, dense_weight))
    if h.is_full or _linear_is_dense(h, weight, bias) or (
            dense is not None and not dense.dtype == dense_weight.dtype == h.values.dtype):
        out = F.linear(h.values if h.is_full else to_dense(h), weight, bias)
        return out if dense is None else torch.addmm(out, dense, dense_weight.t())
    return lib.cbsr_linear(h.values, h.indices, h.dim, weight, bias, dense, dense_weight,
                           get_backend())


def linear_backend(h: CBSR, weight: Tensor, bias: Tensor | None = None) -> str:
    """What :func:`cbsr_linear` runs for these operands: ``"numba"`` or
    ``"cpu"`` (CBSR linear kernels), ``"torch"`` (densify + GEMM, saving only
    the CBSR), or ``"dense"`` (plain ``F.linear`` on the densified input:
    under autocast, or with operands of different dtypes)."""
    if _linear_is_dense(h, weight, bias):
        return "dense"
    return lib.linear_choice(get_backend(), h.values, h.dim)


def _autocasts_to(h: CBSR) -> bool:
    """Whether autocast is on and casts a linear map's operands to ``h``'s
    dtype: :func:`cbsr_linear` then casts them itself and keeps its op."""
    device = h.device.type
    return (torch.is_autocast_enabled(device) and h.values.is_floating_point()
            and torch.get_autocast_dtype(device) == h.values.dtype)


def _linear_is_dense(h: CBSR, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether :func:`cbsr_linear` is plain ``F.linear`` of the dense input:
    with mixed dtypes, or under an autocast to another dtype than ``h``'s
    (autocast's casts, torch's rules)."""
    if _autocasts_to(h):
        return False
    dtype = h.values.dtype
    return (weight.dtype != dtype or (bias is not None and bias.dtype != dtype)
            or torch.is_autocast_enabled(h.device.type))


__all__ = ["maxk", "aggregate", "maxk_aggregate", "maxk_aggregate_linear", "aggregation_dtype",
           "cbsr_linear", "check_k", "dropout_scale", "dtype_of", "linear_backend", "to_dense"]

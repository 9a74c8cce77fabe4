"""The ``"numba"`` backend's implementations: the kernels of
:mod:`pyg_maxk.kernels` launched on torch tensors. Plain functions, not
differentiable: :mod:`pyg_maxk.ops._library` wraps them (with the other
backends') as custom ops with fake implementations and autograd.

Kernels run on the caller's current torch CUDA stream, with memory from
torch's caching allocator and no host synchronisation, so that a CUDA graph
can capture them (after one warm-up call per shape has compiled them). They
compute in float32. float16/bfloat16 tensors are read as they are stored
(their 16-bit patterns, widened in registers: :mod:`pyg_maxk.kernels._half`),
so half precision halves the bytes the kernels gather; the select and
densify kernels copy half values bit for bit, and results that are sums
(aggregation, its gradients) are float32 in the kernels and rounded once at
the end to the result's type (:func:`~._common.aggregation_dtype` for the
aggregation, the gradient's type for its backward).

Under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``) the same functions run
the same kernels on CPU tensors.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from ..cbsr import index_dtype_for
from ..dispatch import half_reductions_allowed
from ..graph import GraphOperands
from ..kernels import geometry
from ..kernels._half import stores_pairs
from ..kernels._vector import PACKED_HALF_SLOTS
from ..kernels._warp import WARP
from ..kernels.build import csr_of_sorted_kernel, row_pieces_kernel, work_items_kernel
from ..kernels.edge_list import (
    edge_list_check_kernel,
    edge_list_scale_kernel,
    edge_list_spgemm_kernel,
    edge_list_sspmm_kernel,
)
from ..kernels.linear import (
    column_sum_kernel,
    column_sum_slices,
    column_tiles,
    linear_blocks,
    linear_kernel,
    linear_shared_bytes,
)
from ..kernels.maxk_select import (
    densify_kernel,
    densify_sum_kernel,
    gather_kernel,
    select_kernel,
)
from ..kernels.spgemm import (
    pair_width_fits,
    pairs_kernel,
    reads_pairs,
    sddmm_kernel,
    spgemm_kernel,
    spgemm_vector_width,
    sspmm_kernel,
    sspmm_vector_width,
    zeroed_rows_kernel,
)
from ._common import as_dtype, spgemm_dtype
from ._launch import PreparedLaunch, device_index, launcher

KERNEL_DTYPE = torch.float32
UINT32_MAX = 2**32 - 1
#: Edges from which the forward reads the CBSR as (value, index) pairs
#: (:func:`value_index_pairs`, :func:`~pyg_maxk.kernels.spgemm.reads_pairs`).
#: Building them costs a kernel launch (host time that small graphs would
#: notice) and saves one L2 request per edge, which pays on large graphs.
PAIRS_MIN_EDGES = 1 << 24


#: Half types the kernels read natively, by the name the kernels know them by.
HALF_KINDS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def half_kind(dtype: torch.dtype) -> str:
    """The kernels' name of a half type (``"bf16"``/``"fp16"``), ``""`` for
    any other (read as float32)."""
    return HALF_KINDS.get(dtype, "")


def _kernel_input(t: Tensor) -> Tensor:
    """``t`` as the kernels read it, C-contiguous: a half type as its 16-bit
    patterns (an ``int16`` view, no copy), anything else as float32 (no copy
    when it is). The kernels take raw pointers, so a tensor that requires a
    gradient needs no ``detach`` (even a no-op ``to``/``detach`` costs host
    time, and small graphs are host-bound)."""
    if t.dtype in HALF_KINDS:
        return t.contiguous().view(torch.int16)
    return as_dtype(t, KERNEL_DTYPE).contiguous()


# ------------------------------------------------------- prepared launches
# An op's launch is prepared (:class:`~._launch.PreparedLaunch`) on its second
# call for inputs of one kind (:func:`_remember`), and later calls patch in their
# tensors' pointers and launch: no kernel lookup, geometry or argument
# packing per call, which is most of an op's host time on a small graph.
# A kind is every input property the kernel, its grid and its arguments'
# shapes depend on. Ops on a graph keep their launches with the graph's
# arrays (:func:`_graph_plans`), the others in :data:`_PLANS`.

#: Prepared launches of the ops that take no graph, by kind.
_PLANS: dict = {}
#: Kinds kept at most (a new graph per batch brings new row counts).
MAX_PLANS = 1024


#: Marks a kind seen once. Its launch is prepared on its second call, so
#: kinds that change on every call (mini-batches of other sizes, a graph's
#: views made afresh per call) never pay for a preparation they cannot use.
_SEEN_ONCE = object()


def _prepared(plans: dict, key) -> Optional[PreparedLaunch]:
    """The prepared launch of kind ``key`` (None: none yet, or no kind)."""
    launch = plans.get(key)
    return None if launch is _SEEN_ONCE else launch


def _remember(plans: dict, key, prepare: Callable[[], Optional[PreparedLaunch]]) -> None:
    """After a full launch of kind ``key``: mark it seen, or, seen before,
    keep ``prepare()``'s launch for its later calls."""
    if key is None:
        return
    if plans.get(key) is not _SEEN_ONCE:
        launch = _SEEN_ONCE
    else:
        launch = prepare()
        if launch is None:
            return
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = launch


def _graph_plans(g: GraphOperands) -> dict:
    """The prepared launches of the ops on graph ``g``, kept on its work
    schedule's array: they hold pointers into the graph's buffer, so they
    live as long as it does, and no longer."""
    plans = getattr(g.item_row, "_pyg_maxk_plans", None)
    if plans is None:
        plans = g.item_row._pyg_maxk_plans = {}
    return plans


def _aligned(*tensors: Tensor) -> bool:
    """Whether every tensor is contiguous and 16-byte aligned: the kind of
    input whose vector widths (:func:`_index_operand`) a prepared launch
    may assume."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


# --------------------------------------------------------------- maxk ops
def _row_launch(num_rows: int, device: torch.device):
    """(launcher, rows per block, threads, blocks) for the warp-per-row kernels."""
    run = launcher()
    rows_per_block = geometry.rows_per_block()
    threads = WARP * rows_per_block
    return (run, rows_per_block, threads,
            min(-(-num_rows // rows_per_block), run.max_blocks(device, threads)))


def maxk_select(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """``(values [N, k], indices [N, k])`` of the ``k`` largest entries per
    row (the entries :func:`torch.topk` keeps; ties to the lowest column), in
    bank-major order (by column mod 32, then column; see
    :mod:`~pyg_maxk.kernels.maxk_select`); ``values`` in ``x``'s dtype."""
    n, dim = x.shape
    half = half_kind(x.dtype)
    xk = _kernel_input(x)
    values = torch.empty(n, k, dtype=x.dtype if half else KERNEL_DTYPE, device=x.device)
    indices = torch.empty(n, k, dtype=index_dtype_for(dim), device=x.device)
    if n > 0:
        target = _kernel_input(values)
        key = ("select", n, dim, k, x.dtype, x.device)
        launch = _prepared(_PLANS, key)
        if launch is not None:
            launch(xk, xk, target, indices)
        else:
            run, rows_per_block, threads, blocks = _row_launch(n, x.device)
            kernel = select_kernel(dim, k, rows_per_block, _has_redux(x.device), half)
            # The fused steps' arrays, never touched here: the input stands in
            # (the simulator copies every array argument back after a launch,
            # and a stand-in output would overwrite what the kernel wrote).
            args = (xk, xk if half else xk.view(torch.int32), target, indices, n, xk, xk, xk, xk)
            run(kernel, blocks, threads, x.device, *args)
            _remember(_PLANS, key, lambda: run.prepare(kernel, blocks, threads, x.device,
                                                       args, (0, 1, 2, 3, 5, 6, 7, 8)))
    return as_dtype(values, x.dtype), indices


def maxk_aggregate(g: GraphOperands, x: Tensor, k: int, num_dst: int, with_dense: bool,
                   scale: Optional[Tensor], sums: Optional[Tensor] = None
                   ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """``(A @ h, h's values, h's indices, h's dense form or None)`` for ``h``
    the MaxK of float32 ``x [N, dim]`` (``N > 0``) with its kept values times
    the dropout ``scale`` (``[N, k]`` float32; None: none): one select launch
    that also scales, densifies (``with_dense``), zeroes the aggregation's
    float32 sums of its split rows and zeroes ``sums`` (``[N, k]`` float32,
    contiguous; None: none), the backward's SSpMM sums
    (:func:`maxk_input_grad`), then :func:`spgemm`'s launches. Two ops and a
    launch fewer than :func:`maxk_select`, ``values.mul_(scale)``,
    :func:`spgemm` and :func:`cbsr_to_dense` in turn, with their results."""
    n, dim = x.shape
    x = x.contiguous()
    values = torch.empty(n, k, dtype=KERNEL_DTYPE, device=x.device)
    indices = torch.empty(n, k, dtype=index_dtype_for(dim), device=x.device)
    dense = torch.empty(n, dim, dtype=KERNEL_DTYPE, device=x.device) if with_dense else None
    num_zeroed = g.zeroed_rows.numel() if g.row is None and g.item_row.numel() > 0 else 0
    partial = (torch.empty(num_zeroed, dim, dtype=KERNEL_DTYPE, device=x.device)
               if num_zeroed > 0 else None)
    # x: a stand-in for the arrays of the steps not taken, read-only
    arrays = [x if t is None else t for t in (scale, dense, partial, sums)]
    key = ("select fused", n, dim, k, x.device, scale is not None, with_dense, num_zeroed,
           sums is not None)
    launch = _prepared(_PLANS, key)
    if launch is not None:
        launch(x, x, values, indices, *arrays)
    else:
        run, rows_per_block, threads, blocks = _row_launch(n, x.device)
        kernel = select_kernel(dim, k, rows_per_block, _has_redux(x.device), "",
                               scale is not None, with_dense, partial is not None,
                               sums is not None)
        args = (x, x.view(torch.int32), values, indices, n, *arrays)
        run(kernel, blocks, threads, x.device, *args)
        _remember(_PLANS, key, lambda: run.prepare(kernel, blocks, threads, x.device, args,
                                                   (0, 1, 2, 3, 5, 6, 7, 8)))
    return spgemm(g, values, indices, num_dst, dim, partial), values, indices, dense


def cbsr_to_dense(values: Tensor, indices: Tensor, dim: int) -> Tensor:
    """The dense ``[N, dim]`` matrix of the CBSR ``(values, indices)``, each
    row written once from shared memory (``dim`` within
    :func:`~pyg_maxk.kernels.geometry.takes_densify`)."""
    n, k = values.shape
    half = half_kind(values.dtype)
    dense = torch.empty(n, dim, dtype=values.dtype if half else KERNEL_DTYPE,
                        device=values.device)  # rows written whole
    if n > 0:
        source, indices = _kernel_input(values), indices.contiguous()
        key = ("densify", n, dim, k, values.dtype, indices.dtype, values.device)
        launch = _prepared(_PLANS, key)
        if launch is not None:
            launch(source, indices, dense)
        else:
            run, rows_per_block, threads, blocks = _row_launch(n, values.device)
            kernel = densify_kernel(dim, k, rows_per_block, bool(half))
            target = _kernel_input(dense)
            args = (source, indices, target.view(torch.int32) if stores_pairs(bool(half), dim)
                    else target, n)
            run(kernel, blocks, threads, values.device, *args)
            _remember(_PLANS, key, lambda: run.prepare(kernel, blocks, threads, values.device,
                                                       args, (0, 1, 2)))
    return as_dtype(dense, values.dtype)


def maxk_input_grad(g: GraphOperands, indices: Tensor, grad_agg: Optional[Tensor],
                    grad_values: Optional[Tensor], grad_dense: Optional[Tensor],
                    dim: int, scale: Optional[Tensor] = None,
                    sums: Optional[Tensor] = None) -> Tensor:
    """The float32 gradient ``[num_src, dim]`` of MaxK and the aggregation
    of its CBSR w.r.t. the features, from the float32 gradients of the
    aggregation (``[num_dst, dim]``), of the CBSR values (``[num_src, k]``)
    and of the dense form (``[num_src, dim]``), each None when absent, through
    the dropout ``scale`` (``[num_src, k]`` float32) of the kept values where
    given: :func:`sspmm` of the first (into ``sums`` where given: zeroed
    float32 ``[num_src, k]``, e.g. by :func:`maxk_aggregate`), then one launch
    (:func:`~pyg_maxk.kernels.maxk_select.densify_sum_kernel`) that adds the
    kept values' gradients and the dense one sampled at the pattern, scales
    them and writes the dense rows."""
    n, k = indices.shape
    kept = sspmm(g, indices, grad_agg, n, sums) if grad_agg is not None else None
    dense = torch.empty(n, dim, dtype=KERNEL_DTYPE, device=indices.device)  # rows written whole
    if n > 0:
        indices = indices.contiguous()
        terms = [None if t is None else t.contiguous()
                 for t in (kept, grad_values, grad_dense, scale)]
        present = tuple(t is not None for t in terms)
        # An absent term is never read; the output stands in for it.
        args = (*[dense if t is None else t for t in terms], indices, dense)
        key = ("densify_sum", n, dim, k, indices.dtype, present, indices.device)
        launch = _prepared(_PLANS, key)
        if launch is not None:
            launch(*args)
        else:
            run, rows_per_block, threads, blocks = _row_launch(n, indices.device)
            kernel = densify_sum_kernel(dim, k, rows_per_block, *present)
            run(kernel, blocks, threads, indices.device, *args, n)
            _remember(_PLANS, key, lambda: run.prepare(kernel, blocks, threads, indices.device,
                                                       (*args, n), (0, 1, 2, 3, 4, 5)))
    return dense


def gather_at(dense: Tensor, indices: Tensor) -> Tensor:
    """``dense.gather(1, indices)`` as ``[N, k]`` in ``dense``'s dtype (float32
    for other types), for the CBSR pattern ``indices`` of ``dense``'s rows,
    read as stored (no int64 copy)."""
    n, k = indices.shape
    half = half_kind(dense.dtype)
    check_cbsr_offsets(n, k, 0)
    values = torch.empty(n, k, dtype=dense.dtype if half else KERNEL_DTYPE, device=dense.device)
    if n * k > 0:
        run = launcher()
        threads = geometry.block_threads()
        blocks = min(-(-n * k // threads), run.max_blocks(dense.device, threads))
        run(gather_kernel(k, bool(half)), blocks, threads, dense.device, _kernel_input(dense),
            indices.contiguous().view(-1), _kernel_input(values).view(-1), n * k)
    return values


# ------------------------------------------------------------ linear op
def cbsr_linear(values: Tensor, indices: Tensor, dim: int, weight: Tensor,
                bias: Optional[Tensor]) -> Tensor:
    """``dense(h) @ weight.T + bias`` as float32 ``[N, out_features]`` from
    the float32 CBSR ``(values, indices)`` of width ``dim`` (within
    :func:`~pyg_maxk.kernels.geometry.takes_linear`), without building ``dense(h)``."""
    n, k = values.shape
    out_features = weight.size(0)
    out = torch.empty(n, out_features, dtype=KERNEL_DTYPE, device=values.device)
    if n > 0 and out_features > 0:
        run = launcher()
        warps = geometry.linear_warps()
        threads = warps * WARP
        # One wave: every block has the same number of rows per tile.
        resident = run.resident_blocks(values.device, threads,
                                       linear_shared_bytes(dim, k, warps))
        row_blocks = min(-(-n // warps), max(1, resident // column_tiles(out_features)))
        kernel = linear_kernel(dim, k, out_features, warps, bias is not None)
        weight_t = as_dtype(weight, KERNEL_DTYPE).t().contiguous()
        run(kernel, linear_blocks(out_features, row_blocks), threads, values.device,
            _kernel_input(values), indices.contiguous(), weight_t,
            _or_unread(_as_kernel_dtype(bias), weight_t), out, n)
    return out


def column_sums(x: Tensor) -> Tensor:
    """``x.sum(0)`` of a ``[N, C]`` float32 or half-precision ``x``, summed in
    float32 (:func:`~pyg_maxk.kernels.linear.column_sum_kernel`) and returned
    in ``x``'s dtype: the gradient of a bias."""
    n, columns = x.shape
    out = torch.zeros(columns, dtype=KERNEL_DTYPE, device=x.device)
    if n > 0 and columns > 0:
        run = launcher()
        threads = geometry.block_threads()
        resident = run.resident_blocks(x.device, threads, 0) * threads
        slices = column_sum_slices(n, columns, resident)
        run(column_sum_kernel(columns, half_kind(x.dtype)), -(-slices * columns // threads),
            threads, x.device, _kernel_input(x), out, n, slices)
    return as_dtype(out, x.dtype)


# ------------------------------------------------- a new graph's arrays
def csr_of_sorted(src: Tensor, dst: Tensor, value: Optional[Tensor], num_src: int,
                  num_dst: int, mean: bool
                  ) -> Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor], Tensor]:
    """``(rowptr, col, weight, row_scale, ok)`` of the edges ``src -> dst``
    sorted by target, in one launch
    (:func:`~pyg_maxk.kernels.build.csr_of_sorted_kernel`): int32 row
    pointers and sources, float32 edge values (``value``, float32, divided
    by each row's in-degree with ``mean``; None without either), the mean's
    row scale where it has no ``value``, and ``ok``, a one-entry flag that
    is 0 where an index was out of range. No host sync."""
    device = dst.device
    num_edges = dst.numel()
    rowptr = torch.empty(num_dst + 1, dtype=torch.int32, device=device)
    col = torch.empty(num_edges, dtype=torch.int32, device=device)
    weight = (torch.empty(num_edges, dtype=KERNEL_DTYPE, device=device)
              if mean or value is not None else None)
    row_scale = (torch.empty(num_dst, dtype=KERNEL_DTYPE, device=device)
                 if mean and value is None else None)
    ok = torch.ones(1, dtype=torch.uint8, device=device)
    run = launcher()
    threads = geometry.block_threads()
    work = max(num_dst + 1, num_edges)
    blocks = min(-(-work // threads), run.max_blocks(device, threads))
    kernel = csr_of_sorted_kernel(mean, value is not None)
    unread = torch.empty(1, dtype=KERNEL_DTYPE, device=device)  # stands in for the absent
    run(kernel, blocks, threads, device, src.contiguous(), dst.contiguous(),
        _or_unread(value, unread).contiguous(), num_src, num_dst, num_edges, rowptr, col,
        _or_unread(weight, unread), _or_unread(row_scale, unread), ok)
    return rowptr, col, weight, row_scale, ok


def edge_list_values(src: Tensor, dst: Tensor, value: Optional[Tensor], num_src: int,
                     num_dst: int, mean: bool
                     ) -> Tuple[Optional[Tensor], Optional[Tensor], Tensor]:
    """``(weight, row_scale, ok)`` of the edge list ``src -> dst`` (any
    order), as :func:`csr_of_sorted` gives them in the list's order: float32
    edge values (``value``, divided by each target's in-degree with
    ``mean``; None without either), the mean's row scale where it has no
    ``value``, and ``ok``, a one-entry flag that is 0 where an index was out
    of range; two launches without ``mean``, four with. No host sync."""
    device = dst.device
    num_edges = dst.numel()
    ok = torch.ones(1, dtype=torch.uint8, device=device)
    degree = (torch.zeros(num_dst, dtype=torch.int32, device=device) if mean
              else torch.empty(1, dtype=torch.int32, device=device))
    if num_edges > 0:
        _flat_launch_of_kind(("edge_list_check", mean), lambda: edge_list_check_kernel(mean),
                             num_edges, device, (src, dst, num_src, num_dst, num_edges, degree,
                                                 ok))
    if not mean:
        weight = None if value is None else value.detach().to(KERNEL_DTYPE).contiguous()
        return weight, None, ok
    weight = torch.empty(num_edges, dtype=KERNEL_DTYPE, device=device)
    row_scale = (torch.empty(num_dst, dtype=KERNEL_DTYPE, device=device) if value is None
                 else None)
    work = max(num_edges, num_dst)
    if work > 0:
        source = weight if value is None else value.detach().to(KERNEL_DTYPE).contiguous()
        has_value = value is not None
        _flat_launch_of_kind(("edge_list_scale", has_value),
                             lambda: edge_list_scale_kernel(has_value), work, device,
                             (dst, source, degree, num_dst, num_edges, weight,
                              _or_unread(row_scale, _stand_in(device))))
    return weight, row_scale, ok


def _flat_launch(work: int, device: torch.device):
    """(launcher, threads, blocks) for a grid-stride kernel of ``work``
    threads' worth of work."""
    run = launcher()
    threads = geometry.block_threads()
    return run, threads, min(-(-work // threads), run.max_blocks(device, threads))


def _flat_launch_of_kind(kind: tuple, kernel_of: Callable[[], Any], work: int,
                         device: torch.device, args: tuple) -> None:
    """The grid-stride launch of ``kernel_of()`` (``kind``: its name, then
    its flags) over ``work`` threads' worth of work on ``args`` (one-dimensional
    contiguous tensors and ints), prepared from the second call whose
    tensors have the same shapes and types and whose ints are the same:
    later such calls patch the data pointers of every tensor in ``args``. So
    a new graph of one size per step (a graph used once: an edge list)
    launches as a fixed graph's ops do, without the full path's per-field
    packing."""
    key = (*kind, device, work, *[(a.dtype, a.shape) if isinstance(a, Tensor) else a
                                  for a in args])
    launch = _prepared(_PLANS, key)
    if launch is not None:
        launch(*[a for a in args if isinstance(a, Tensor)])
        return
    run, threads, blocks = _flat_launch(work, device)
    kernel = kernel_of()
    run(kernel, blocks, threads, device, *args)
    _remember(_PLANS, key, lambda: run.prepare(
        kernel, blocks, threads, device, args,
        [i for i, a in enumerate(args) if isinstance(a, Tensor)]))


def _stand_in(device: torch.device) -> Tensor:
    """An argument a kernel was compiled not to read, apart from every array
    it writes (Numba's simulator copies each argument back after a launch,
    so an alias of an output would overwrite it)."""
    return torch.empty(1, dtype=KERNEL_DTYPE, device=device)


def _edge_list_spgemm(g: GraphOperands, values: Tensor, indices: Tensor, num_dst: int,
                      dim: int) -> Tensor:
    """:func:`spgemm` over an edge list (``g.row`` set, no schedule): a
    zero-fill and one launch of float32 atomics, the result cast to its
    type afterwards."""
    weight, row_scale = kernel_weights(g)
    out = torch.zeros(num_dst, dim, dtype=KERNEL_DTYPE, device=values.device)
    k = values.size(1)
    slots = g.col.numel() * k
    if slots > 0:
        flags = (k, weight is not None, row_scale is not None)
        unread = _stand_in(values.device)
        args = (g.col, g.row, _or_unread(weight, unread), _or_unread(row_scale, unread),
                as_dtype(values, KERNEL_DTYPE).contiguous().view(-1),
                indices.contiguous().view(-1), out.view(-1), dim, slots)
        _flat_launch_of_kind(("edge_list_spgemm", *flags),
                             lambda: edge_list_spgemm_kernel(*flags), slots, values.device, args)
    return as_dtype(out, spgemm_dtype(values, g))


def _edge_list_sspmm(g: GraphOperands, indices: Tensor, grad_out: Tensor,
                     num_src: int, sums: Optional[Tensor]) -> Tensor:
    """:func:`sspmm` over an edge list: a zero-fill (none where ``sums`` is
    given) and one launch of float32 atomics."""
    weight, row_scale = kernel_weights(g)
    k = indices.size(1)
    grad_values = _zeroed_sums(sums, num_src, k, grad_out.device)
    slots = g.col.numel() * k
    if slots > 0:
        flags = (k, weight is not None, row_scale is not None)
        unread = _stand_in(grad_out.device)
        args = (g.col, g.row, _or_unread(weight, unread), _or_unread(row_scale, unread),
                indices.contiguous().view(-1),
                as_dtype(grad_out, KERNEL_DTYPE).contiguous().view(-1), grad_values.view(-1),
                grad_out.size(1), slots)
        _flat_launch_of_kind(("edge_list_sspmm", *flags),
                             lambda: edge_list_sspmm_kernel(*flags), slots, grad_out.device,
                             args)
    return as_dtype(grad_values, grad_out.dtype)


def bounded_work_items(rowptr: Tensor, num_items: int, num_zeroed: int,
                       max_edges: int) -> Tuple[Tensor, Tensor]:
    """``(items [4, num_items] int32, zeroed_rows [num_zeroed] int64)`` of
    the bounded work schedule of the CSR rows ``rowptr`` (rows ``row``,
    ``start``, ``end``, ``split`` of ``items``; see
    :class:`~pyg_maxk.graph.WorkSchedule`): two kernels and one prefix sum
    (:mod:`~pyg_maxk.kernels.build`), no host sync."""
    device = rowptr.device
    num_dst = rowptr.numel() - 1
    items = torch.empty(4, num_items, dtype=torch.int32, device=device)
    zeroed = torch.empty(num_zeroed, dtype=torch.int64, device=device)
    if num_dst == 0 or max(num_items, num_zeroed) == 0:
        return items, zeroed  # no rows: no items (num_items <= num_edges = 0)
    run = launcher()
    threads = geometry.block_threads()
    rowptr = rowptr.contiguous()
    counts = torch.empty(2, num_dst, dtype=torch.int64, device=device)
    blocks = min(-(-num_dst // threads), run.max_blocks(device, threads))
    run(row_pieces_kernel(), blocks, threads, device, rowptr, max_edges, counts, num_dst)
    sums = torch.cumsum(counts, dim=1)
    work = max(num_items, num_zeroed)
    blocks = min(-(-work // threads), run.max_blocks(device, threads))
    run(work_items_kernel(), blocks, threads, device, rowptr, sums, max_edges, items, zeroed,
        num_dst, num_items, num_zeroed)
    return items, zeroed


# ------------------------------------------------------------ SpGEMM ops
def _item_launch(num_items: int, device: torch.device):
    """(launcher, threads, blocks) for the per-warp work-item kernels."""
    run = launcher()
    threads = geometry.block_threads()
    return run, threads, min(-(-num_items // (threads // WARP)), run.max_blocks(device, threads))


#: Integer types of 2, 4 and 8 bytes: words of indices the kernels read at once.
_WORD_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _index_operand(indices: Tensor, width: int, *aligned: Tensor) -> Tuple[Tensor, int, int]:
    """``(indices as the kernels read them, slots per load, bits per index)``.

    The kernels read ``width`` slots per load when the flat indices (uint8 or
    int16) can be viewed as words of that many indices and every array read
    or written that many slots at a time (``aligned``) is aligned to it (a
    fresh tensor is; a view into another may not be); else 1.
    """
    flat = indices.contiguous().view(-1)
    bits = 8 * flat.element_size()
    word_bytes = width * flat.element_size()
    if (width == 1 or flat.dtype not in (torch.uint8, torch.int16) or flat.data_ptr() % word_bytes
            or any(t.data_ptr() % (t.element_size() * width) for t in aligned)):
        return flat, 1, bits
    return flat.view(_WORD_DTYPES[word_bytes]), width, bits


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _has_redux(device: torch.device) -> bool:
    """Whether the GPU has the ``redux.sync`` warp reduction (sm_80 and later)."""
    return device.type == "cuda" and _capability(device_index(device)) >= (8, 0)


def _has_vector_atomics(device: torch.device) -> bool:
    """Whether the GPU has float32 vector atomics (sm_90 and later); asked on
    every backward, so the capability is read once per device."""
    return device.type == "cuda" and _capability(device_index(device)) >= (9, 0)


def value_index_pairs(values: Tensor, indices: Tensor) -> Tensor:
    """The CBSR as the forward reads it on large graphs
    (:func:`~pyg_maxk.kernels.spgemm.reads_pairs`), built by one kernel
    (:func:`~pyg_maxk.kernels.spgemm.pairs_kernel`): ``[N, k, 2]`` float32,
    each slot's value (as float32) beside its column index (as float32,
    exact below 2**24); for half-precision values ``[N, k]`` int32, the
    value's 16-bit pattern in the low half of each word and the index
    (below 2**16) in the high half."""
    half = values.dtype in HALF_KINDS
    pairs = torch.empty(*values.shape, 2, dtype=torch.int16 if half else KERNEL_DTYPE,
                        device=values.device)
    slots = values.numel()
    if slots > 0:
        run = launcher()
        threads = geometry.block_threads()
        blocks = min(-(-slots // threads), run.max_blocks(values.device, threads))
        run(pairs_kernel(half), blocks, threads, values.device,
            _kernel_input(values).view(-1), indices.contiguous().view(-1), pairs.view(-1), slots)
    return pairs.view(torch.int32).view(values.shape) if half else pairs


def _uses_pairs(k: int, num_edges: int, dtype: torch.dtype = KERNEL_DTYPE) -> bool:
    """Whether the forward reads the CBSR as (value, index) pairs: where the
    kernel can (:func:`~pyg_maxk.kernels.spgemm.reads_pairs`), on graphs of
    :data:`PAIRS_MIN_EDGES` edges and more."""
    return reads_pairs(k, dtype in HALF_KINDS) and num_edges >= PAIRS_MIN_EDGES


def _spgemm_operands(values: Tensor, indices: Tensor, num_edges: int):
    """``(values, indices, width, index bits, pairs)`` as the forward kernel
    reads them: (value, index) pairs where :func:`_uses_pairs` (the kernel
    reads no ``indices`` then), else the flat arrays."""
    k = values.size(1)
    width = spgemm_vector_width(k)
    if _uses_pairs(k, num_edges, values.dtype):
        pairs = value_index_pairs(values, indices).view(-1)
        assert pair_width_fits(width, values.dtype in HALF_KINDS)
        return pairs, pairs, width, 8 * indices.element_size(), True
    flat = _kernel_input(values).view(-1)
    words, width, bits = _index_operand(indices, width, flat)
    return flat, words, width, bits, False


def spgemm(g: GraphOperands, values: Tensor, indices: Tensor, num_dst: int,
           dim: int, partial: Optional[Tensor] = None) -> Tensor:
    """``A @ h`` as ``[num_dst, dim]`` (in :func:`~._common.aggregation_dtype`)
    for the CBSR ``h = (values, indices)`` of width ``dim`` (within
    :func:`supports`). A graph
    with a per-row scale (a mean without edge values) is aggregated
    unweighted and scaled once per output row. A half-precision result is
    written as such, each float32 sum rounded once. ``partial``: the split
    rows' float32 sums ``[zeroed rows, dim]``, zeroed by an earlier launch
    (:func:`maxk_aggregate`); None: zero-filled here."""
    if g.row is not None:
        return _edge_list_spgemm(g, values, indices, num_dst, dim)
    weight, row_scale = kernel_weights(g)
    out_dtype = spgemm_dtype(values, g)
    out_half = half_kind(out_dtype)
    # Rows that one item writes whole are stored once, in the result's type;
    # the split ones (a few on a power-law graph) are summed in float32 in
    # `partial` and stored afterwards (one launch). A bounded schedule pads
    # its zeroed rows with `num_dst`: a scratch row below the result, cut off
    # by an in-place resize (a view would refuse the in-place adds that
    # layers make into a fresh aggregation).
    num_zeroed = g.zeroed_rows.numel()
    out = torch.empty(num_dst + (num_zeroed > 0), dim,
                      dtype=out_dtype if out_half else KERNEL_DTYPE, device=values.device)
    num_items = g.item_row.numel()
    if num_items == 0:
        return as_dtype(out, out_dtype)
    plans = _graph_plans(g)
    # Without zeroed rows no item adds to `partial` (a bounded schedule's
    # padding items point at it, with no edges): no zero-fill.
    if partial is None:
        partial = (torch.zeros(num_zeroed, dim, dtype=KERNEL_DTYPE, device=values.device)
                   if num_zeroed > 0 else torch.empty(1, dim, dtype=KERNEL_DTYPE,
                                                      device=values.device))
    weight_arg, scale_arg = _or_unread(weight, g.item_start), _or_unread(row_scale, g.item_start)
    key = (("spgemm", values.shape, values.dtype, indices.dtype, dim, out_dtype,
            weight is None, row_scale is None) if _aligned(values, indices) else None)
    launch = _prepared(plans, key)
    if launch is not None:
        launch(weight_arg, scale_arg, values, indices, out, partial)
    else:
        k = values.size(1)
        check_cbsr_offsets(values.size(0), k, g.col.numel(), values.dtype)
        run, threads, blocks = _item_launch(num_items, values.device)
        flat, index_words, width, bits, pairs = _spgemm_operands(values, indices, g.col.numel())
        kernel = spgemm_kernel(dim, k, threads, weight is not None, row_scale is not None,
                               width, bits, pairs, half_kind(values.dtype), out_half)
        args = (g.item_row, g.item_start, g.item_end, g.item_split, g.col, weight_arg,
                scale_arg, flat, index_words, _kernel_input(out), partial, num_items)
        run(kernel, blocks, threads, values.device, *args)
        if not pairs:
            _remember(plans, key, lambda: run.prepare(kernel, blocks, threads, values.device,
                                                      args, (5, 6, 7, 8, 9, 10)))
    if num_zeroed > 0:
        _store_zeroed_rows(g, plans, partial, out, out_half)
    return as_dtype(out.resize_(num_dst, dim), out_dtype)


def _store_zeroed_rows(g: GraphOperands, plans: dict, partial: Tensor, out: Tensor,
                       out_half: str) -> None:
    """Store the float32 sums of the split rows (``partial``) into ``out``."""
    dim = out.size(1)
    key = ("zeroed rows", dim, out.dtype)
    launch = _prepared(plans, key)
    if launch is not None:
        launch(partial, out)
        return
    run = launcher()
    threads = geometry.block_threads()
    pairs = stores_pairs(bool(out_half), dim)
    target = _kernel_input(out)
    target = target.view(torch.int32) if pairs else target
    stores = g.zeroed_rows.numel() * target.size(1)
    blocks = min(-(-stores // threads), run.max_blocks(out.device, threads))
    args = (partial, g.zeroed_rows, target, stores)
    kernel = zeroed_rows_kernel(out_half, pairs)
    run(kernel, blocks, threads, out.device, *args)
    _remember(plans, key, lambda: run.prepare(kernel, blocks, threads, out.device, args, (0, 2)))


def _or_unread(optional: Optional[Tensor], stand_in: Tensor) -> Tensor:
    """A kernel argument the kernel was compiled not to read when absent."""
    return optional if optional is not None else stand_in


def sspmm(g: GraphOperands, indices: Tensor, grad_out: Tensor, num_src: int,
          sums: Optional[Tensor] = None) -> Tensor:
    """The gradient ``[num_src, k]`` (in ``grad_out``'s dtype) of
    :func:`spgemm` w.r.t. the CBSR values: ``grad_out`` sampled through the
    transposed graph at the CBSR pattern, per-edge float32 reductions (added
    into ``sums`` where given: zeroed, float32, contiguous ``[num_src, k]``;
    else into a fresh zero-filled tensor), or packed half-precision ones
    where :func:`_reduces_in_half`."""
    if g.row is not None:
        return _edge_list_sspmm(g, indices, grad_out, num_src, sums)
    k = indices.size(1)
    weight, row_scale = kernel_weights(g)
    packed = _reduces_in_half(grad_out, indices)
    grad_values = (torch.zeros(num_src, k, dtype=grad_out.dtype, device=grad_out.device)
                   if packed else _zeroed_sums(sums, num_src, k, grad_out.device))
    num_items = g.item_row.numel()
    if num_items > 0:
        plans = _graph_plans(g)
        source = _kernel_input(grad_out)
        out = grad_values.view(torch.int32) if packed else grad_values
        weight_arg = _or_unread(weight, g.item_start)
        scale_arg = _or_unread(row_scale, g.item_start)
        key = (("sspmm", indices.shape, indices.dtype, grad_out.dtype, packed,
                weight is None, row_scale is None) if _aligned(indices) else None)
        launch = _prepared(plans, key)
        if launch is not None:
            launch(weight_arg, scale_arg, indices, source, out)
        else:
            dim = grad_out.size(1)
            run, threads, blocks = _item_launch(num_items, grad_out.device)
            if packed:  # words of 8 uint8 indices, or of 4 int16 ones read two at a time
                index_words, width, bits = (indices.view(-1).view(torch.int64),
                                            PACKED_HALF_SLOTS, 8 * indices.element_size())
            else:
                index_words, width, bits = _index_operand(indices, sspmm_vector_width(k),
                                                           grad_values)
            kernel = sspmm_kernel(dim, k, threads, weight is not None, row_scale is not None,
                                  width, bits, _has_vector_atomics(grad_out.device),
                                  half_kind(grad_out.dtype), packed)
            args = (g.item_row, g.item_start, g.item_end, g.col, weight_arg, scale_arg,
                    index_words, source, out.view(-1), num_items)
            run(kernel, blocks, threads, grad_out.device, *args)
            _remember(plans, key, lambda: run.prepare(kernel, blocks, threads, grad_out.device,
                                                      args, (4, 5, 6, 7, 8)))
    return as_dtype(grad_values, grad_out.dtype)


def _zeroed_sums(sums: Optional[Tensor], num_src: int, k: int, device: torch.device) -> Tensor:
    """The float32 ``[num_src, k]`` sums an SSpMM adds into: ``sums`` where
    given (zeroed by its caller), else zero-filled here."""
    if sums is None:
        return torch.zeros(num_src, k, dtype=KERNEL_DTYPE, device=device)
    if sums.shape != (num_src, k) or sums.dtype != KERNEL_DTYPE or not sums.is_contiguous():
        raise ValueError(f"the SSpMM sums must be contiguous float32 [{num_src}, {k}], got "
                         f"{sums.dtype} {list(sums.shape)}")
    return sums


def _reduces_in_half(grad_out: Tensor, indices: Tensor) -> bool:
    """Whether the backward reduces in ``grad_out``'s half type, 8 slots per
    packed reduction: for a half ``grad_out``, where the user allows it
    (:func:`pyg_maxk.allow_half_reductions`), ``k`` a multiple of 8,
    contiguous uint8/int16 indices aligned to 16 bytes, on a GPU with packed
    half reductions (sm_90 and later; any under the simulator). The dtype
    is asked first: float32 training pays no host time here."""
    return (grad_out.dtype in HALF_KINDS and half_reductions_allowed()
            and indices.size(1) % PACKED_HALF_SLOTS == 0
            and indices.dtype in (torch.uint8, torch.int16) and indices.is_contiguous()
            and indices.data_ptr() % 16 == 0
            and (grad_out.device.type != "cuda" or _has_vector_atomics(grad_out.device)))


def sddmm(g: GraphOperands, values: Tensor, indices: Tensor, grad_out: Tensor) -> Tensor:
    """The gradient ``[E]`` (float32, CSR order) of :func:`spgemm` w.r.t. the
    edge values: per edge, the dot product of the source's CBSR row with
    ``grad_out``'s target row at its columns (a group of lanes per edge,
    reading slots as the backward does)."""
    if g.row is not None:  # an edge list: the reference, in its order
        from . import torch_ops
        return torch_ops.sddmm(g, values, indices, grad_out).to(KERNEL_DTYPE)
    k = indices.size(1)
    dim = grad_out.size(1)
    check_cbsr_offsets(values.size(0), k, 0)
    grad_weight = torch.empty(g.col.numel(), dtype=KERNEL_DTYPE, device=grad_out.device)
    num_items = g.item_row.numel()
    if num_items > 0:
        run, threads, blocks = _item_launch(num_items, grad_out.device)
        flat = _kernel_input(values).view(-1)
        index_words, width, bits = _index_operand(indices, sspmm_vector_width(k), flat)
        kernel = sddmm_kernel(dim, k, threads, width, bits, half_kind(values.dtype),
                              half_kind(grad_out.dtype))
        run(kernel, blocks, threads, grad_out.device, g.item_row, g.item_start, g.item_end,
            g.col, flat, index_words, _kernel_input(grad_out), grad_weight, num_items)
    return grad_weight


def _as_kernel_dtype(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else as_dtype(t, KERNEL_DTYPE).contiguous()


def kernel_weights(g: GraphOperands) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(edge values, row scale)`` as the kernels read them (float32): the
    row scale alone when the graph has one, else the edge values (or None)."""
    if g.row_scale is not None:
        return None, _as_kernel_dtype(g.row_scale)
    return _as_kernel_dtype(g.weight), None


def check_cbsr_offsets(num_rows: int, k: int, num_edges: int,
                       dtype: torch.dtype = KERNEL_DTYPE) -> None:
    """Raise unless the kernels' uint32 offsets reach every CBSR slot (``row *
    k + slot``, twice that where the forward reads float32 (value, index)
    pairs; a packed half pair is one word per slot)."""
    doubled = _uses_pairs(k, num_edges, dtype) and dtype not in HALF_KINDS
    slots = num_rows * k * (2 if doubled else 1)
    if slots > UINT32_MAX:
        raise ValueError(
            f"The pyg_maxk kernels index CBSR slots with uint32 and these features "
            f"need {slots} ({num_rows} rows, k={k}; limit {UINT32_MAX}). Split the "
            f"graph (e.g. NeighborLoader) or use the 'torch' backend.")

"""The CSR graph that every MaxK aggregation runs on (:class:`CSRGraph`): its
normalised edge values, its work schedules and the packed operands of each
``k``, built from any adjacency form PyG's convs accept."""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..dispatch import CPU_DTYPES
from .adjacency import (
    as_sparse_csr,
    check_edge_index,
    check_normalization,
    check_same_device,
    is_sparse_tensor,
    is_torch_sparse,
    plain,
    sparse_size,
)
from .cache import _CACHE, fingerprint, graph_params
from .operands import (
    GraphOperands,
    PackedGraph,
    allocate_on_cpu,
    layout_numel,
    pack,
    without_weights,
)
from .schedule import WorkSchedule, max_edges_per_item, numba_builds, work_schedule

INT32_MAX = 2**31 - 1
#: Edges below which a graph built on a GPU checks its ``edge_index`` there
#: and gets bounded work schedules (:class:`WorkSchedule`): no host sync, as
#: a new graph per mini-batch needs. Larger graphs are built once; their
#: exact sizes cost one sync.
BOUNDED_MAX_EDGES = 1 << 22


def _transpose_on_cpu(rowptr: Tensor, col: Tensor, num_src: int
                      ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(colptr, row, order)`` of a CPU graph (:meth:`CSRGraph.transposed`;
    ``order``: each grouped edge's CSR position), in one pass of a counting
    sort: a stable sort by source, as ``torch.sort(col, stable=True)``."""
    from ..kernels.cpu import transpose_rows
    colptr = torch.empty(num_src + 1, dtype=rowptr.dtype)
    row = torch.empty_like(col)
    order = torch.empty(col.numel(), dtype=torch.int64)
    bad = transpose_rows(rowptr.contiguous().numpy(), col.contiguous().numpy(),
                         colptr.numpy(), row.numpy(), order.numpy())
    if bad >= 0:
        raise ValueError(f"The graph has an edge from source node {int(col[bad])}, "
                         f"outside [0, {num_src})")
    return colptr, row, order


def _raise_out_of_range(src: Tensor, dst: Tensor, num_src: int, num_dst: int, bad: int,
                        is_target: bool) -> None:
    """The error for edge ``bad`` of a CPU edge list, whose source (or, with
    ``is_target``, target) the grouping kernel found out of range."""
    if is_target:
        what, bound, node = "target", num_dst, dst[bad]
    else:
        what, bound, node = "source", num_src, src[bad]
    raise IndexError(f"edge_index holds {what} node {int(node)}, outside [0, {bound}) "
                     f"for {bound} {what} nodes")


def _group_on_cpu(src: Tensor, dst: Tensor, num_src: int, num_dst: int
                  ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(rowptr, col, order or None)`` of a CPU edge list grouped by target
    in one pass of a counting sort (stable; ``order`` is None where the list
    was sorted by target already), range checks included: what the
    reductions, ``torch.sort`` and ``torch.searchsorted`` of the general
    path do, without their per-op host time (a new graph per batch pays it
    on every step)."""
    from ..kernels.cpu import group_by_target
    index_dtype = torch.int32 if max(dst.numel(), num_src, num_dst) <= INT32_MAX else torch.int64
    rowptr = torch.empty(num_dst + 1, dtype=index_dtype)
    col = torch.empty(dst.numel(), dtype=index_dtype)
    order = torch.empty(dst.numel(), dtype=torch.int64)
    bad, is_target, is_sorted = group_by_target(
        src.contiguous().numpy(), dst.contiguous().numpy(), num_src, rowptr.numpy(),
        col.numpy(), order.numpy(), False)
    if bad >= 0:
        _raise_out_of_range(src, dst, num_src, num_dst, bad, is_target)
    return rowptr, col, None if is_sorted else order


def _mean_on_cpu(rowptr: Tensor, weight: Optional[Tensor], num_edges: int,
                 dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(edge values, one over each row's in-degree)`` of the mean, in one
    pass (:func:`~pyg_maxk.kernels.cpu.mean_edge_values`)."""
    from ..kernels.cpu import mean_edge_values
    inverse_degree = torch.empty(rowptr.numel() - 1, dtype=dtype)
    values = torch.empty(num_edges, dtype=dtype)
    mean_edge_values(rowptr.contiguous().numpy(),
                     (weight if weight is not None else values).contiguous().numpy(),
                     weight is not None, inverse_degree.numpy(), values.numpy())
    return values, inverse_degree


def _or(array: Optional[np.ndarray], unread: np.ndarray) -> np.ndarray:
    return unread if array is None else array


def _csr_on_cpu(src: Tensor, dst: Tensor, edge_weight: Optional[Tensor],
                size: Tuple[int, int], normalization: str, dtype: torch.dtype,
                loops: bool = False) -> "CSRGraph":
    """The graph of a CPU edge list with its operands, in one kernel call
    (:func:`~pyg_maxk.kernels.cpu.csr_of_edge_list`: range checks, both
    groupings, the edge values; with ``loops``, GIN's root loops appended
    as :func:`_with_root_loops` appends them) that writes every array in
    place into the buffer the ops read: a new graph per batch is built on
    every step, and a small one costs its host time, not its arithmetic."""
    from ..kernels.cpu import csr_of_edge_list
    from ..ops.cpu_ops import UNREAD_1D
    num_src, num_dst = size
    num_edges = dst.numel() + (num_dst if loops else 0)
    if normalization == "gcn" and edge_weight is None:
        raise ValueError("gcn normalisation needs edge values")
    index = torch.int32 if max(num_edges, num_src, num_dst) <= INT32_MAX else torch.int64
    weighted, mean = edge_weight is not None, normalization == "mean"
    values = dtype if weighted or mean else None
    scales = dtype if mean and not weighted else None
    buffer, layout, views, arrays = allocate_on_cpu(
        (index, index, values, scales, None, None, None, None, None, index, index, values, None),
        [num_dst, num_edges, 0, 0, num_src])
    order = np.empty(num_edges, np.int64)
    order_t = np.empty(num_edges, np.int64)
    unread = UNREAD_1D[dtype]  # stands for an array not read
    weight = edge_weight.detach().to(dtype).contiguous().numpy() if weighted else unread
    bad, is_target, is_sorted = csr_of_edge_list(
        src.contiguous().numpy(), dst.contiguous().numpy(), weight, weighted, mean,
        arrays.rowptr, arrays.col, order, _or(arrays.weight, unread), values is not None,
        _or(arrays.row_scale, unread), scales is not None, arrays.colptr, arrays.row_t,
        _or(arrays.weight_t, unread), order_t, loops)
    if bad >= 0:
        _raise_out_of_range(src, dst, num_src, num_dst, bad, is_target)
    graph = CSRGraph(views.rowptr, views.col, views.weight, size, normalization,
                     views.row_scale)
    graph.edge_order = None if is_sorted else torch.from_numpy(order)
    graph._transposed = (views.colptr, views.row_t, views.weight_t)
    graph._transpose_order = torch.from_numpy(order_t)
    graph._unscheduled = PackedGraph(buffer, None, None, layout)
    return graph


class CSRGraph:
    r"""A sparse adjacency in CSR form, row = target node.

    Args:
        rowptr (torch.Tensor): row pointers, shape ``[num_dst + 1]``.
        col (torch.Tensor): source node of every edge, shape ``[E]``, sorted by
            row; the same integer type as :obj:`rowptr`.
        weight (torch.Tensor, optional): edge values ``a_e``, shape ``[E]``;
            :obj:`None` means all ones.
        size (tuple): ``(num_src, num_dst)``.
        normalization (str): which normalisation :obj:`weight` already holds
            (``"sum"``, ``"mean"`` or ``"gcn"``); layers check it.
        row_scale (torch.Tensor, optional): shape ``[num_dst]``, set when every
            edge value of row ``i`` equals ``row_scale[i]`` (``"mean"``
            without edge values: one over the in-degree), so that a kernel may
            scale each output row once instead of every edge.

    Build one with :meth:`from_adj` rather than by hand.
    """

    def __init__(self, rowptr: Tensor, col: Tensor, weight: Optional[Tensor],
                 size: Tuple[int, int], normalization: str = "sum",
                 row_scale: Optional[Tensor] = None) -> None:
        check_normalization(normalization)
        num_src, num_dst = int(size[0]), int(size[1])
        if rowptr.numel() != num_dst + 1:
            raise ValueError(f"rowptr has {rowptr.numel()} entries, expected "
                             f"num_dst + 1 = {num_dst + 1}")
        if weight is not None and weight.numel() != col.numel():
            raise ValueError("weight and col must have one entry per edge")
        if row_scale is not None and (weight is None or row_scale.numel() != num_dst):
            raise ValueError("row_scale needs the edge weights it factors and one "
                             "entry per target node")
        self.rowptr = rowptr
        self.col = col
        self.weight = weight
        self.num_src = num_src
        self.num_dst = num_dst
        self.normalization = normalization
        self.row_scale = row_scale
        self._torch_csr: Dict[Tuple[torch.dtype, bool], Tensor] = {}
        self._schedules: Dict[int, WorkSchedule] = {}
        self._transposed: Optional[Tuple[Tensor, Tensor, Optional[Tensor]]] = None
        self._operands: Dict[int, PackedGraph] = {}
        #: The operands of a graph whose kernels read no work schedule (the
        #: CPU's), which every ``k`` shares.
        self._unscheduled: Optional[PackedGraph] = None
        self._bounded: set = set()  # keys of _operands built with a bounded schedule
        self._cache_hits = 0
        self._static = False  # operands marked as static inputs (prepare)
        self._transpose_order: Optional[Tensor] = None
        #: For a graph built from an ``edge_index``: the position in that
        #: edge list of every CSR edge (None: the same order).
        self.edge_order: Optional[Tensor] = None

    # ------------------------------------------------------------------ info
    @property
    def size(self) -> Tuple[int, int]:
        return (self.num_src, self.num_dst)

    @property
    def num_edges(self) -> int:
        return self.col.numel()

    @property
    def device(self) -> torch.device:
        return self.col.device

    def in_degree(self) -> Tensor:
        """Number of edges (multi-edges counted) into every target node."""
        return self.rowptr[1:] - self.rowptr[:-1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "CSRGraph":
        """The graph on ``device`` (``self`` when it is there already); the
        work schedules of :meth:`prepare` are rebuilt there for the same ``k``.
        ``Data.to(device)`` calls this for a graph stored on a ``Data``."""
        device = torch.device(device)
        if device == self.device:
            return self
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)
        graph = CSRGraph(move(self.rowptr), move(self.col), move(self.weight), self.size,
                         self.normalization, move(self.row_scale))
        graph.gcn_options, graph.root_loops = self.gcn_options, self.root_loops
        for max_edges in self._operands:
            graph._build_operands(max_edges)
        if self._static:
            graph._mark_static()
        return graph

    #: ``(improved, add_self_loops)`` of the ``gcn_norm`` a ``"gcn"`` graph holds.
    gcn_options: Optional[Tuple[bool, bool]] = None
    #: Whether the graph holds GIN's root term as one self-loop per node
    #: (:meth:`from_adj`'s ``root_loops``).
    root_loops: bool = False

    def __getstate__(self) -> dict:
        # The graph's own arrays are views of a packed byte buffer, which
        # torch.save cannot store beside them (one storage viewed as several
        # types): pickled (torch.save, deepcopy) as its arrays alone, and its
        # operands built again on load for the same work-item sizes.
        def own(t: Optional[Tensor]) -> Optional[Tensor]:
            return None if t is None else t.detach().clone()
        return {"rowptr": own(self.rowptr), "col": own(self.col), "weight": own(self.weight),
                "row_scale": own(self.row_scale), "size": self.size,
                "normalization": self.normalization, "gcn_options": self.gcn_options,
                "root_loops": self.root_loops, "edge_order": own(self.edge_order),
                "operands": sorted(self._operands), "bounded": sorted(self._bounded),
                "static": self._static}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["rowptr"], state["col"], state["weight"], state["size"],
                      state["normalization"], state["row_scale"])
        self.gcn_options, self.edge_order = state["gcn_options"], state["edge_order"]
        self.root_loops = state.get("root_loops", False)
        for max_edges in state["operands"]:
            self._build_operands(max_edges, max_edges in state["bounded"])
        if state["static"]:
            self._mark_static()

    def __repr__(self) -> str:
        return (f"CSRGraph(num_src={self.num_src}, num_dst={self.num_dst}, "
                f"num_edges={self.num_edges}, normalization="
                f"'{self.normalization}', weighted={self.weight is not None}, "
                f"device={self.device})")

    # ------------------------------------------------------- derived forms
    def torch_csr(self, dtype: torch.dtype) -> Tensor:
        """The adjacency as a ``torch.sparse_csr`` tensor ``[num_dst, num_src]``
        of values in ``dtype`` (cached)."""
        key = (dtype, False)
        csr = self._torch_csr.get(key)
        if csr is None:
            weight = (torch.ones(self.num_edges, dtype=dtype, device=self.device)
                      if self.weight is None else self.weight.to(dtype))
            with warnings.catch_warnings():  # "sparse CSR support is in beta"
                warnings.simplefilter("ignore", UserWarning)
                csr = torch.sparse_csr_tensor(self.rowptr, self.col, weight,
                                              size=(self.num_dst, self.num_src),
                                              check_invariants=False)
            self._torch_csr[key] = csr
        return csr

    def schedule(self, max_edges: int, bounded: bool = False) -> WorkSchedule:
        """The kernels' work items with at most ``max_edges`` edges each,
        computed on the graph's device once and cached: exact (one host
        sync for its sizes), or ``bounded`` (no sync; see
        :class:`WorkSchedule`). A cached exact schedule serves both."""
        max_edges = int(max_edges)
        if max_edges < 1:
            raise ValueError("max_edges must be positive")
        cached = self._schedules.get(max_edges)
        if cached is not None and (bounded or not cached.bounded):
            return cached
        if self.num_edges > INT32_MAX or self.num_dst > INT32_MAX:
            raise ValueError(
                f"The pyg_maxk kernels index edges with int32 and this graph has "
                f"{self.num_edges} edges and {self.num_dst} rows (limit "
                f"{INT32_MAX}). Split the graph (e.g. NeighborLoader) or use "
                f"the 'torch' backend.")
        schedule = work_schedule(self.rowptr, self.num_edges, max_edges, bounded)
        self._schedules[max_edges] = schedule
        return schedule

    def transposed(self) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(colptr [num_src + 1], row [E], weight [E] or None)``: the graph
        grouped by source node (CSC), cached; the CPU backward reads it."""
        if self._transposed is None:
            if self.device.type == "cpu":
                colptr, row, order = _transpose_on_cpu(self.rowptr, self.col, self.num_src)
            else:
                order = torch.sort(self.col, stable=True).indices
                counts = torch.bincount(self.col.long(), minlength=self.num_src)
                colptr = torch.zeros(self.num_src + 1, dtype=self.rowptr.dtype,
                                     device=self.device)
                torch.cumsum(counts, 0, out=colptr[1:])
                row = torch.repeat_interleave(
                    torch.arange(self.num_dst, dtype=self.col.dtype, device=self.device),
                    self.in_degree().long(), output_size=self.num_edges)[order]
            weight = None if self.weight is None else self.weight[order]
            self._transposed = (colptr, row, weight)
            self._transpose_order = order
        return self._transposed

    def with_weight(self, weight: Tensor, normalization: str) -> "CSRGraph":
        """The same structure with other edge values ``weight`` (``[E]``, CSR
        order), sharing this graph's work schedules: for edge values that
        are recomputed on every call and may need a gradient (learnable
        edge weights, PyG's explain edge masks). The aggregation ops take
        ``weight`` as an input, so its gradient (an SDDMM) reaches the
        caller."""
        graph = CSRGraph(self.rowptr, self.col, weight, self.size, normalization)
        graph.gcn_options = self.gcn_options
        graph._schedules = self._schedules
        if self._transposed is not None:
            colptr, row_t, _ = self._transposed
            # Read by the CPU backward only, which takes no gradient through it.
            graph._transposed = (colptr, row_t,
                                 weight.detach().index_select(0, self._transpose_order))
            graph._transpose_order = self._transpose_order
        graph._bounded = set(self._bounded)

        def reweighted(ops: PackedGraph) -> PackedGraph:
            weight_t = None if layout_numel(ops.layout, "row_t") < 0 else graph._transposed[2]
            return PackedGraph(ops.index, weight, weight_t, without_weights(ops.layout))
        graph._operands = {max_edges: reweighted(ops) for max_edges, ops in self._operands.items()}
        if self._unscheduled is not None:
            graph._unscheduled = reweighted(self._unscheduled)
        return graph

    def operands(self, k: int) -> PackedGraph:
        """The tensors every aggregation op reads at ``k`` entries per row,
        packed as the custom ops take them (:class:`PackedGraph`;
        :func:`unpack` gives the :class:`GraphOperands`), built on the first
        call per work-item size and cached (with the exact work schedule:
        one host sync). Under ``torch.compile`` a graph must be prepared
        (:meth:`prepare`, :class:`~pyg_maxk.transforms.ToCSRGraph`) for the
        ``k`` of its layers, else the build breaks the graph."""
        cached = self._operands.get(max_edges_per_item(k))
        if cached is not None:
            return cached
        return _build_operands_outside_compile(self, max_edges_per_item(k), False)

    def operands_without_sync(self, k: int) -> PackedGraph:
        """:meth:`operands`, built with the bounded work schedule where the
        graph is on a GPU and has fewer than :data:`BOUNDED_MAX_EDGES`
        edges (no host sync: what a layer asks for an adjacency it has not
        seen, such as a new mini-batch's)."""
        cached = self._operands.get(max_edges_per_item(k))
        if cached is not None:
            return cached
        bounded = self.device.type == "cuda" and self.num_edges < BOUNDED_MAX_EDGES
        return _build_operands_outside_compile(self, max_edges_per_item(k), bounded)

    def has_operands(self, k: int) -> bool:
        """Whether operands for ``k`` are built, with either schedule."""
        return max_edges_per_item(k) in self._operands

    def is_prepared(self, k: int) -> bool:
        """Whether the operands for ``k`` are built with the exact schedule
        (:meth:`prepare`)."""
        max_edges = max_edges_per_item(k)
        return max_edges in self._operands and max_edges not in self._bounded

    def prepare(self, *ks: int) -> "CSRGraph":
        """Build the operands of every ``k`` in ``ks`` now (outside a compiled
        region), with the exact work schedule, and mark them as static
        inputs of compiled code (CUDA graphs then read them in place instead
        of copying them into the graph's memory on every replay; a graph
        with other tensors re-records); returns ``self``."""
        for k in ks:
            if not self.is_prepared(k):
                self._build_operands(max_edges_per_item(k))
        self._mark_static()
        return self

    def settle(self) -> None:
        """Rebuild every operand built with a bounded schedule with the
        exact one (one host sync each): the graph cache does this for a
        graph it serves often, which a fixed graph is."""
        for max_edges in sorted(self._bounded):
            self._build_operands(max_edges)
        if self._static:  # the new buffers too
            self._mark_static()

    def _mark_static(self) -> None:
        for operands in self._operands.values():
            for t in operands.tensors():
                torch._dynamo.mark_static_address(t)
        self._static = True

    def _build_operands(self, max_edges: int, bounded: bool = False) -> PackedGraph:
        if self.device.type == "cpu" and not _simulated_kernels():
            # The CPU kernels read no work schedule: one buffer for every k.
            if self._unscheduled is None:
                self._unscheduled = self._pack(max_edges, [None] * 5, *self.transposed())
            packed = self._unscheduled
        else:
            transposed = self.transposed() if self.device.type == "cpu" else (None,) * 3
            schedule = self.schedule(max_edges, bounded)
            packed = self._pack(max_edges, [schedule.row, schedule.start, schedule.end,
                                            schedule.split, schedule.zeroed_rows], *transposed)
        self._operands[max_edges] = packed
        if bounded:
            self._bounded.add(max_edges)
        else:
            self._bounded.discard(max_edges)
        return packed

    def _pack(self, max_edges: int, items: list, colptr: Optional[Tensor],
              row_t: Optional[Tensor], weight_t: Optional[Tensor]) -> PackedGraph:
        operands = GraphOperands(self.rowptr, self.kernel_col(), self.weight, self.row_scale,
                                 *items, colptr, row_t, weight_t)
        packed, views = pack(operands)
        if set(self._operands) <= {max_edges}:
            self._hold_views(operands, views)
        return packed

    def _hold_views(self, packed_from: GraphOperands, views: GraphOperands) -> None:
        """Keep the buffer's copies of this graph's own arrays in their place,
        so that the graph holds each array once (a later ``k``'s buffer holds
        another copy)."""
        for name in ("rowptr", "col", "weight", "row_scale"):
            mine = getattr(self, name)
            if mine is not None and mine is getattr(packed_from, name) \
                    and getattr(views, name) is not mine:
                setattr(self, name, getattr(views, name))
        if self._transposed is not None and packed_from.colptr is self._transposed[0]:
            self._transposed = (views.colptr, views.row_t,
                                views.weight_t if self._transposed[2] is not None else None)

    def kernel_col(self) -> Tensor:
        """``col`` as int32, the type the kernels read."""
        return self.col if self.col.dtype == torch.int32 else self.col.to(torch.int32)

    # ------------------------------------------------------------ building
    @classmethod
    def from_csr(cls, rowptr: Tensor, col: Tensor, value: Optional[Tensor],
                 size: Tuple[int, int], normalization: str = "sum",
                 dtype: torch.dtype = torch.float32) -> "CSRGraph":
        """A graph from CSR arrays (row = target). ``"mean"`` divides
        ``value`` (``None`` = ones) by the in-degree; ``"sum"`` keeps it;
        ``"gcn"`` expects it already normalised by ``gcn_norm``."""
        num_src, num_dst = size
        index_dtype = (torch.int32 if max(col.numel(), num_src, num_dst) <= INT32_MAX
                       else torch.int64)
        rowptr = rowptr.to(index_dtype)
        col = col.to(index_dtype)
        weight = None if value is None else value.detach().to(dtype)
        row_scale = None
        if normalization == "mean" and rowptr.device.type == "cpu" and dtype in CPU_DTYPES:
            weight, inverse_degree = _mean_on_cpu(rowptr, weight, col.numel(), dtype)
            row_scale = inverse_degree if value is None else None
        elif normalization == "mean":
            deg = (rowptr[1:] - rowptr[:-1]).to(dtype)
            inv = 1.0 / deg.clamp(min=1)
            inv_per_edge = torch.repeat_interleave(inv, (rowptr[1:] - rowptr[:-1]).long(),
                                                   output_size=col.numel())
            if weight is None:
                weight, row_scale = inv_per_edge, inv.contiguous()
            else:
                weight = weight * inv_per_edge
        elif normalization == "gcn":
            if weight is None:
                raise ValueError("gcn normalisation needs edge values")
        return cls(rowptr.contiguous(), col.contiguous(),
                   None if weight is None else weight.contiguous(), size,
                   normalization, row_scale)

    @classmethod
    def from_edge_index(cls, edge_index: Tensor, edge_weight: Optional[Tensor],
                        size: Tuple[int, int], normalization: str = "sum",
                        dtype: torch.dtype = torch.float32) -> "CSRGraph":
        """A graph from ``edge_index`` ``[2, E]`` (row 0 = source, row 1 =
        target), sorting the edges by target (stable, so multi-edges and
        their order survive)."""
        edge_index = plain(edge_index)
        num_src, num_dst = size
        src, dst = edge_index[0], edge_index[1]
        if dst.device.type == "cpu" and dtype in CPU_DTYPES:
            return _csr_on_cpu(src, dst, edge_weight, size, normalization, dtype)
        if dst.device.type == "cpu":
            rowptr, col, perm = _group_on_cpu(src, dst, num_src, num_dst)
            return cls._from_grouped(rowptr, col, perm, edge_weight, size, normalization, dtype)
        checked_on_device = dst.is_cuda and dst.numel() < BOUNDED_MAX_EDGES
        is_sorted = True
        if dst.numel() > 0 and not checked_on_device:
            # One host sync for the range checks and the sortedness test.
            lo_src, hi_src, lo_dst, hi_dst, is_sorted = torch.stack([
                src.min(), src.max(), dst.min(), dst.max(),
                (dst[1:] >= dst[:-1]).all().to(src.dtype)]).tolist()
            _check_bounds(lo_src, hi_src, num_src, "source")
            _check_bounds(lo_dst, hi_dst, num_dst, "target")
        perm = None
        if checked_on_device or not is_sorted:
            dst, perm = torch.sort(dst, stable=True)
            src = src[perm]
        if checked_on_device and _csr_by_kernel(dst, dtype, size):
            return cls._from_sorted_with_kernels(src, dst, perm, edge_weight, size,
                                                 normalization)
        # Row r starts at the first edge whose target is r or more: a binary
        # search over the sorted targets, with no host sync (a CUDA bincount
        # reads its input's range back to the host).
        rowptr = torch.searchsorted(
            dst, torch.arange(num_dst + 1, dtype=dst.dtype, device=dst.device))
        if checked_on_device and dst.numel() > 0:
            _assert_in_range(src, rowptr, num_src, dst.numel())
        return cls._from_grouped(rowptr, src, perm, edge_weight, size, normalization, dtype)

    @classmethod
    def _from_grouped(cls, rowptr: Tensor, col: Tensor, perm: Optional[Tensor],
                      edge_weight: Optional[Tensor], size: Tuple[int, int],
                      normalization: str, dtype: torch.dtype) -> "CSRGraph":
        """:meth:`from_csr` of edges grouped by target, whose positions in the
        edge list are ``perm`` (None: in the list's order)."""
        value = None
        if edge_weight is not None:
            value = edge_weight if perm is None else edge_weight[perm]
        graph = cls.from_csr(rowptr, col, value, size, normalization, dtype)
        graph.edge_order = perm
        return graph

    @classmethod
    def _from_sorted_with_kernels(cls, src: Tensor, dst: Tensor, perm: Tensor,
                                  edge_weight: Optional[Tensor], size: Tuple[int, int],
                                  normalization: str) -> "CSRGraph":
        """:meth:`from_edge_index` of edges sorted by target (``perm``: their
        order in the list) in one Numba launch
        (:func:`pyg_maxk.ops.numba_ops.csr_of_sorted`): the row pointers,
        the int32 sources, the normalised edge values and the range check,
        which reaches the host as a device-side assert."""
        from ..ops.numba_ops import csr_of_sorted
        value = None
        if edge_weight is not None:
            value = edge_weight.detach()[perm].to(torch.float32)
        elif normalization == "gcn":
            raise ValueError("gcn normalisation needs edge values")
        mean = normalization == "mean"
        rowptr, col, weight, row_scale, ok = csr_of_sorted(src, dst, value, *size, mean)
        torch._assert_async(ok, "edge_index holds a node index outside [0, num_nodes)")
        graph = cls(rowptr, col, weight, size, normalization, row_scale)
        graph.edge_order = perm
        return graph

    @classmethod
    def from_adj(cls, adj: Any, size: Optional[Tuple[Optional[int], Optional[int]]] = None,
                 *, edge_weight: Optional[Tensor] = None, normalization: str = "sum",
                 use_sparse_tensor_values: bool = True, gcn_improved: bool = False,
                 gcn_add_self_loops: bool = True, dtype: torch.dtype = torch.float32,
                 cache: bool = True, root_loops: bool = False) -> "CSRGraph":
        """The graph of any adjacency form PyG's convs accept.

        Args:
            adj: ``edge_index`` ``[2, E]`` (a plain tensor or
                :class:`torch_geometric.EdgeIndex`), a
                :class:`torch_sparse.SparseTensor` ``adj_t``, a ``torch.sparse``
                COO/CSR/CSC ``adj_t`` (``[num_dst, num_src]``), or a
                :class:`CSRGraph` (returned as is).
            size (tuple, optional): ``(num_src, num_dst)``; required for an
                ``edge_index`` (the layers infer it from the features).
            edge_weight (torch.Tensor, optional): ``[E]`` weights of an
                ``edge_index``.
            normalization (str): ``"sum"``, ``"mean"`` or ``"gcn"``.
            use_sparse_tensor_values (bool): whether the values of a
                ``SparseTensor`` are used (PyG's SAGE and GIN drop them).
            gcn_improved, gcn_add_self_loops: options of ``gcn_norm``.
            dtype: floating type of the edge values.
            cache (bool): look the graph up in / store it into the cache.
            root_loops (bool): for an ``edge_index`` of a square ``"sum"``
                graph, one more edge ``i -> i`` (value 1) per node after its
                edges: GIN's root term at ``eps = 0`` folded into the
                aggregation (:attr:`root_loops` records it; only
                :class:`~pyg_maxk.nn.MaxKGINConv` takes such a graph).
        """
        if isinstance(adj, CSRGraph):
            return adj
        if not (isinstance(adj, Tensor) or is_sparse_tensor(adj)):
            raise TypeError(
                f"pyg_maxk cannot build a graph from {type(adj).__name__}: "
                f"expected an edge_index [2, E] tensor, torch_geometric.EdgeIndex, "
                f"torch_sparse.SparseTensor, a torch.sparse COO/CSR/CSC tensor "
                f"or a pyg_maxk.CSRGraph")
        check_normalization(normalization)
        if edge_weight is not None:
            check_same_device(adj, edge_weight)
        if edge_weight is not None and torch.is_grad_enabled() and edge_weight.requires_grad:
            # Learnable edge values: the cached structure, values per call
            # (edge_values builds on this module).
            from .edge_values import graph_with_edge_values
            return graph_with_edge_values(adj, size, edge_weight, None, normalization,
                                          gcn_improved, gcn_add_self_loops, dtype)
        anchors, versions = fingerprint(adj, edge_weight)
        params = graph_params(normalization, use_sparse_tensor_values, gcn_improved,
                              gcn_add_self_loops, dtype, size, root_loops)
        if cache:
            hit = _CACHE.get(anchors, versions, params)
            if hit is not None:
                return hit
        if root_loops and _loops_by_kernel(adj, dtype):
            _check_root_loops(adj, size, edge_weight, normalization)
            edges = plain(adj)
            graph = _csr_on_cpu(edges[0], edges[1], None, (int(size[0]), int(size[1])),
                                "sum", dtype, loops=True)
        else:
            if root_loops:
                adj = _with_root_loops(adj, size, edge_weight, normalization)
            graph = _build(adj, size, edge_weight, normalization,
                           use_sparse_tensor_values, gcn_improved,
                           gcn_add_self_loops, dtype)
        graph.root_loops = root_loops
        if normalization == "gcn":
            graph.gcn_options = (bool(gcn_improved), bool(gcn_add_self_loops))
        if cache:
            _CACHE.put(anchors, versions, params, graph)
        return graph

    @classmethod
    def cached(cls, adj: Any, size: Optional[Tuple[Optional[int], Optional[int]]] = None, *,
               edge_weight: Optional[Tensor] = None, normalization: str = "sum",
               use_sparse_tensor_values: bool = True, gcn_improved: bool = False,
               gcn_add_self_loops: bool = True, dtype: torch.dtype = torch.float32,
               root_loops: bool = False) -> Optional["CSRGraph"]:
        """The graph :meth:`from_adj` would return from the cache for these
        arguments (a hit, counted as one), or None where it would build one:
        a fixed graph's lookup without the checks of a first call."""
        if not (isinstance(adj, Tensor) or is_sparse_tensor(adj)) or (
                edge_weight is not None and edge_weight.requires_grad
                and torch.is_grad_enabled()):
            return None
        anchors, versions = fingerprint(adj, edge_weight)
        return _CACHE.get(anchors, versions, graph_params(
            normalization, use_sparse_tensor_values, gcn_improved, gcn_add_self_loops, dtype,
            size, root_loops))


def _with_root_loops(adj: Any, size, edge_weight: Optional[Tensor], normalization: str
                     ) -> Tensor:
    """``adj`` (an ``edge_index``) with one edge ``i -> i`` per node appended:
    the stable sort by target puts each after the node's own edges, so that
    a row sums its neighbours, then the node itself (the order of
    :class:`~torch_geometric.nn.conv.GINConv`'s ``aggr + (1 + eps) * x``)."""
    _check_root_loops(adj, size, edge_weight, normalization)
    edges = plain(adj)
    n = int(size[0])  # existing loops stay, as PyG's add_self_loops keeps them
    loops = torch.arange(n, dtype=edges.dtype, device=edges.device).expand(2, n)
    return torch.cat([edges, loops], dim=1)


def _check_root_loops(adj: Any, size, edge_weight: Optional[Tensor],
                      normalization: str) -> None:
    """What root loops need: a square ``"sum"`` graph's ``edge_index``
    without edge values."""
    if not isinstance(adj, Tensor) or is_sparse_tensor(adj) or is_torch_sparse(adj):
        raise ValueError("root_loops needs an edge_index [2, E] adjacency")
    if normalization != "sum" or edge_weight is not None:
        raise ValueError("root_loops needs a 'sum' graph without edge values")
    if size is None or size[0] is None or size[0] != size[1]:
        raise ValueError(f"root_loops needs a square adjacency, got size={size}")
    check_edge_index(adj)


def _loops_by_kernel(adj: Any, dtype: torch.dtype) -> bool:
    """Whether a graph's root loops are appended by the CPU build's kernel
    (:func:`_csr_on_cpu`) rather than to its ``edge_index``."""
    return (isinstance(adj, Tensor) and not is_torch_sparse(adj)
            and adj.device.type == "cpu" and dtype in CPU_DTYPES)


def _simulated_kernels() -> bool:
    """Whether the CUDA kernels, the only readers of the work schedule, run
    on CPU tensors here (Numba's simulator)."""
    from ..kernels import simulator_enabled
    return simulator_enabled()


def _csr_by_kernel(dst: Tensor, dtype: torch.dtype, size: Tuple[int, int]) -> bool:
    """Whether a new GPU graph's CSR is built by a Numba kernel: float32
    edge values and int32 indices, where the kernels build (:func:`numba_builds`)."""
    return dtype == torch.float32 and max(dst.numel(), *size) <= INT32_MAX and numba_builds(dst)


@torch.compiler.disable
def _build_operands_eagerly(graph: CSRGraph, max_edges: int, bounded: bool) -> PackedGraph:
    # The schedule's sizes depend on the degrees (or, bounded, on the
    # graph's shape): built outside any compiled graph (a graph break where
    # the graph was not prepared for this k).
    return graph._build_operands(max_edges, bounded)


def _build_operands_outside_compile(graph: CSRGraph, max_edges: int,
                                    bounded: bool) -> PackedGraph:
    """:func:`_build_operands_eagerly`, whose wrapper eager calls skip (a new
    graph per batch builds its operands on every step)."""
    if torch.compiler.is_compiling():
        return _build_operands_eagerly(graph, max_edges, bounded)
    return graph._build_operands(max_edges, bounded)


def _check_bounds(lo: int, hi: int, bound: int, what: str) -> None:
    if lo < 0 or hi >= bound:
        raise IndexError(f"edge_index holds {what} node {lo if lo < 0 else hi}, "
                         f"outside [0, {bound}) for {bound} {what} nodes")


def _assert_in_range(src: Tensor, rowptr: Tensor, num_src: int, num_edges: int) -> None:
    """The range check of an ``edge_index`` on the GPU, without a host sync:
    every target is in range when the row pointers (binary searches over
    the sorted targets) start at 0 and end at the last edge. A failure is a
    device-side assert (what PyG's own index ops give for such an
    ``edge_index``), reported at the next synchronisation."""
    lo, hi = torch.aminmax(src)
    ok = torch.stack([lo >= 0, hi < num_src, rowptr[0] == 0, rowptr[-1] == num_edges]).all()
    torch._assert_async(ok, "edge_index holds a node index outside [0, num_nodes)")


def _build(adj: Any, size, edge_weight, normalization, use_sparse_tensor_values,
           gcn_improved, gcn_add_self_loops, dtype) -> CSRGraph:
    if is_sparse_tensor(adj):
        sizes = sparse_size(adj)
        if normalization == "gcn":
            from torch_geometric.nn.conv.gcn_conv import gcn_norm
            adj = gcn_norm(adj, None, sizes[0], gcn_improved, gcn_add_self_loops,
                           "source_to_target", dtype)
        rowptr, col, value = adj.csr()
        if not use_sparse_tensor_values and normalization != "gcn":
            value = None
        return CSRGraph.from_csr(rowptr, col, value, sizes, normalization, dtype)

    if is_torch_sparse(adj):
        sizes = sparse_size(adj)
        if normalization == "gcn":
            from torch_geometric.nn.conv.gcn_conv import gcn_norm
            adj, _ = gcn_norm(adj, None, sizes[0], gcn_improved, gcn_add_self_loops,
                              "source_to_target", dtype)
        csr = as_sparse_csr(adj)
        return CSRGraph.from_csr(csr.crow_indices(), csr.col_indices(), csr.values(),
                                 sizes, normalization, dtype)

    check_edge_index(adj)
    if size is None or size[0] is None or size[1] is None:
        raise ValueError("Building a CSRGraph from an edge_index needs "
                         "size=(num_src, num_dst)")
    sizes = (int(size[0]), int(size[1]))
    if normalization == "gcn":
        if sizes[0] != sizes[1]:
            raise ValueError("gcn normalisation needs a square adjacency, got "
                             f"size={sizes}")
        edge_index, edge_weight = gcn_norm_of_edge_list(plain(adj), edge_weight, sizes[0],
                                                        gcn_improved, gcn_add_self_loops,
                                                        dtype)
        return CSRGraph.from_edge_index(edge_index, edge_weight, sizes, "gcn", dtype)
    return CSRGraph.from_edge_index(adj, edge_weight, sizes, normalization, dtype)


def gcn_norm_of_edge_list(edge_index: Tensor, edge_weight: Optional[Tensor], num_nodes: int,
                          improved: bool, add_self_loops: bool, dtype: torch.dtype
                          ) -> Tuple[Tensor, Tensor]:
    """PyG's ``gcn_norm`` of an edge list (``flow="source_to_target"``) with
    no host sync, for a new graph per batch. ``gcn_norm`` drops the existing
    self-loops (a boolean mask, which reads its count on the host) before it
    adds one per node; here they stay, weighing 0, which adds nothing to a
    degree or an aggregation, and each added loop weighs what ``gcn_norm``
    gives it (an existing loop's weight, else ``2`` if ``improved`` else
    ``1``; ``1`` without edge weights, as there). Of a node's several
    loops the last in the list gives the weight, on every device (as
    ``gcn_norm`` on a CPU; on CUDA its choice is undefined)."""
    if not add_self_loops:
        from torch_geometric.nn.conv.gcn_conv import gcn_norm
        return gcn_norm(edge_index, edge_weight, num_nodes, improved, False,
                        "source_to_target", dtype)
    src, dst = edge_index[0], edge_index[1]
    is_loop = src == dst
    if edge_weight is None:
        weight = (~is_loop).to(dtype)
        loop_weight = torch.ones(num_nodes, dtype=dtype, device=src.device)
    else:
        # Each existing loop's weight onto its node, every other edge into a
        # spare slot past the last node. Each of a node's loops puts its last
        # loop's weight (found by an order-free max), so that the put's pick
        # among them is moot, and takes the gradient, as gcn_norm's put gives
        # it to each.
        slot = torch.where(is_loop, src, num_nodes)
        positions = torch.arange(src.numel(), device=src.device)
        last = torch.full((num_nodes + 1,), -1, dtype=positions.dtype, device=src.device)
        last = last.scatter_reduce(0, slot, positions, "amax")
        put = edge_weight + (edge_weight[last[slot]] - edge_weight).detach()
        loop_weight = edge_weight.new_full((num_nodes + 1,), 2.0 if improved else 1.0)
        loop_weight = loop_weight.index_put((slot,), put)[:num_nodes]
        weight = edge_weight.masked_fill(is_loop, 0)
    nodes = torch.arange(num_nodes, dtype=edge_index.dtype, device=src.device)
    edge_index = torch.cat([edge_index, nodes.expand(2, -1)], dim=1)
    weight = torch.cat([weight, loop_weight])
    src, dst = edge_index[0], edge_index[1]
    degree = weight.new_zeros(num_nodes).index_add_(0, dst, weight)
    scale = degree.pow_(-0.5)
    scale.masked_fill_(scale == float("inf"), 0)
    return edge_index, scale[src] * weight * scale[dst]

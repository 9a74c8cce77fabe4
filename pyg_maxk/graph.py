"""The CSR graph that every MaxK aggregation runs on, with its cached kernel
work schedule.

Rows are target nodes, columns source nodes, so that row ``i`` lists the
neighbours whose messages node ``i`` aggregates:

.. math::
    \\mathbf{out}_i = \\sum_{e = (j \\rightarrow i)} a_e \\, \\mathbf{x}_j

The edge values ``a_e`` carry the layer's normalisation (``"sum"``: the
adjacency's own values or 1, ``"mean"``: divided by the in-degree, ``"gcn"``:
the symmetric normalisation of :func:`torch_geometric.nn.conv.gcn_conv.gcn_norm`).

A graph is built from any adjacency form that PyG's stock convs accept and is
cached, so that every layer, the backward pass and later epochs reuse it. The
cache never returns a stale graph: it is keyed on the identity *and* the
in-place version counter of every tensor the graph was built from.
"""
from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

NORMALIZATIONS = ("sum", "mean", "gcn")
INT32_MAX = 2**31 - 1
#: Edges below which a graph built on a GPU checks its ``edge_index`` there
#: and gets bounded work schedules (:class:`WorkSchedule`): no host sync, as
#: a new graph per mini-batch needs. Larger graphs are built once; their
#: exact sizes cost one sync.
BOUNDED_MAX_EDGES = 1 << 22
#: Target (edge, slot) pairs per kernel work item (one warp's share): a row
#: with more edges than ``PAIRS_PER_ITEM // k`` is cut into several items.
PAIRS_PER_ITEM = 8192


def max_edges_per_item(k: int) -> int:
    """Edges of one work item of the SpGEMM/SSpMM at ``k`` entries per row."""
    return max(1, PAIRS_PER_ITEM // int(k))


def _is_sparse_tensor(adj: Any) -> bool:
    """True for a :class:`torch_sparse.SparseTensor` (without importing it)."""
    return type(adj).__name__ == "SparseTensor" and hasattr(adj, "storage")


def _is_torch_sparse(adj: Any) -> bool:
    return isinstance(adj, Tensor) and adj.layout in (
        torch.sparse_coo, torch.sparse_csr, torch.sparse_csc)


def _nonzero(mask: Tensor, count: int, fill_value: int = -1) -> Tensor:
    """The first ``count`` positions where ``mask`` holds, padded with
    ``fill_value`` to ``count`` entries: no host sync where torch has
    ``nonzero_static`` for the device (else ``nonzero`` and a pad)."""
    try:
        return torch.nonzero_static(mask, size=count, fill_value=fill_value).view(-1)
    except (AttributeError, NotImplementedError, RuntimeError):
        found = torch.nonzero(mask).view(-1)[:count]
        return torch.cat([found, found.new_full((count - found.numel(),), fill_value)])


def _as_sparse_csr(adj: Tensor) -> Tensor:
    """A ``torch.sparse`` COO/CSC/CSR adjacency as CSR. The conversion is the
    package's own, so torch's "sparse CSR support is in beta" warning would
    tell the user nothing."""
    if adj.layout == torch.sparse_csr:
        return adj
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return adj.to_sparse_csr()


def _transpose_on_cpu(rowptr: Tensor, col: Tensor, num_src: int
                      ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(colptr, row, order)`` of a CPU graph (:meth:`CSRGraph.transposed`;
    ``order``: each grouped edge's CSR position), in one pass of a counting
    sort: a stable sort by source, as ``torch.sort(col, stable=True)``."""
    from .kernels.cpu import transpose_rows
    colptr = torch.empty(num_src + 1, dtype=rowptr.dtype)
    row = torch.empty_like(col)
    order = torch.empty(col.numel(), dtype=torch.int64)
    bad = transpose_rows(rowptr.contiguous().numpy(), col.contiguous().numpy(),
                         colptr.numpy(), row.numpy(), order.numpy())
    if bad >= 0:
        raise ValueError(f"The graph has an edge from source node {int(col[bad])}, "
                         f"outside [0, {num_src})")
    return colptr, row, order


def _work_schedule(rowptr: Tensor, num_edges: int, max_edges: int,
                   bounded: bool) -> "WorkSchedule":
    """The :class:`WorkSchedule` of the CSR rows ``rowptr`` (int64)."""
    device = rowptr.device
    num_dst = rowptr.numel() - 1
    deg = rowptr[1:] - rowptr[:-1]
    pieces = ((deg + (max_edges - 1)) // max_edges).clamp_(min=1)
    is_split = pieces > 1
    if bounded:
        num_items = num_dst + num_edges // max_edges
        num_zeroed = min(num_dst, num_edges // (max_edges + 1))
    else:  # the two data-dependent sizes in one host sync
        num_items, num_zeroed = torch.stack([pieces.sum(), is_split.sum()]).tolist()
    last_item = torch.cumsum(pieces, 0)
    item = torch.arange(num_items, device=device)
    # Item t belongs to the row whose items end past it (past every row: padding).
    row = torch.searchsorted(last_item, item, right=True)
    real = row < num_dst
    row.clamp_(max=max(num_dst - 1, 0))
    piece = item - (last_item - pieces)[row]
    start = rowptr[row] + piece * max_edges
    end = torch.minimum(start + max_edges, rowptr[row + 1])
    zeroed_rows = _nonzero(is_split, num_zeroed, fill_value=num_dst)
    position = torch.cumsum(is_split, 0, dtype=torch.int32)  # 1-based among split rows
    split = torch.where(is_split[row], position[row], 0)
    if bounded:
        start = torch.where(real, start, 0)
        end = torch.where(real, end, 0)
        split = torch.where(real, split, 1)
    row, start, end, split = torch.stack([row, start, end, split]).to(torch.int32)
    return WorkSchedule(max_edges=max_edges, row=row, start=start, end=end, split=split,
                        zeroed_rows=zeroed_rows, bounded=bounded)


def _is_edge_index_type(adj: Any) -> bool:
    try:
        from torch_geometric import EdgeIndex
    except ImportError:  # pragma: no cover - very old PyG
        return False
    return isinstance(adj, EdgeIndex)


@dataclass(frozen=True)
class WorkSchedule:
    """How the kernels cut the CSR rows into balanced work items.

    Item ``t`` aggregates edges ``[start[t], end[t])`` of row ``row[t]``; a row
    with more than ``max_edges`` edges is cut into several items, and a row
    without edges has one item with no edges (which writes its zero row).
    ``zeroed_rows`` lists the split rows. The forward sums them in a zeroed
    float32 array of one row per entry of ``zeroed_rows``, with atomics, and
    then stores it into its output: ``split[t]`` is 0 for an item that
    writes its row whole, else 1 + the position of ``row[t]`` in
    ``zeroed_rows``.

    A *bounded* schedule (``bounded=True``) has sizes known from the graph's
    shape alone, so that building it needs no host sync: ``num_dst +
    num_edges // max_edges`` items, the ones past the real items without
    edges (``start == end``, ``split > 0``: they write nothing), and
    ``min(num_dst, num_edges // (max_edges + 1))`` entries of
    ``zeroed_rows``, the ones past the split rows equal to ``num_dst`` (a
    scratch row below the output, which the forward then allocates).
    """
    max_edges: int
    row: Tensor          # [T] int32
    start: Tensor        # [T] int32
    end: Tensor          # [T] int32
    split: Tensor        # [T] int32
    zeroed_rows: Tensor  # [Z] int64
    bounded: bool = False

    @property
    def num_items(self) -> int:
        return self.row.numel()


class GraphOperands(NamedTuple):
    """Every tensor the aggregation ops read, for one ``k``: what the
    backends' implementations take (:mod:`pyg_maxk.ops`). The custom ops
    take it packed (:class:`PackedGraph`); :func:`unpack` gives it back.

    ``colptr``, ``row_t`` and ``weight_t`` (the graph grouped by source: the
    CPU kernels' backward) exist on CPU graphs only.
    """
    rowptr: Tensor                # [num_dst + 1]
    col: Tensor                   # [E] int32 (int64 beyond int32's range)
    weight: Optional[Tensor]      # [E] edge values, or None for ones
    row_scale: Optional[Tensor]   # [num_dst]: every edge value of a row, or None
    item_row: Optional[Tensor]    # the work schedule (WorkSchedule), which only
    item_start: Optional[Tensor]  # the CUDA kernels read: None on a CPU graph
    item_end: Optional[Tensor]    # outside Numba's simulator
    item_split: Optional[Tensor]
    zeroed_rows: Optional[Tensor]
    colptr: Optional[Tensor]      # [num_src + 1]
    row_t: Optional[Tensor]       # [E]
    weight_t: Optional[Tensor]    # [E] or None


class PackedGraph(NamedTuple):
    """:class:`GraphOperands` as the custom ops take them: every array in one
    byte buffer, except edge values that are recomputed on every call (and
    may need a gradient), which come apart.

    Every tensor crossing a compiled graph's boundary costs host time on each
    call (a guard, a CUDA-graph input check, a tensor saved for the
    backward), and small graphs are host-bound: one buffer instead of twelve
    arrays. ``layout`` is six integers (a list argument costs dispatcher time
    per element on every compiled call): the type of every field of
    :data:`GRAPH_FIELDS` in the buffer (3 bits each, 0 where it is absent)
    and one bit each for fields in the buffer that are not to be read
    (:func:`without_weights`), then the sizes every field's length follows
    from (:data:`LAYOUT_SIZES`). The fields lie in their order, each at the
    next multiple of :data:`PACK_ALIGN` bytes, so that its view keeps its
    type. ``weight`` and ``weight_t``, when given, are the edge values in
    place of the buffer's (:meth:`CSRGraph.with_weight`).
    """
    index: Tensor                 # uint8 [bytes]
    weight: Optional[Tensor]
    weight_t: Optional[Tensor]
    layout: List[int]

    def tensors(self) -> List[Tensor]:
        return [t for t in self[:-1] if t is not None]


#: The fields of :class:`GraphOperands`, in the order of the packed buffer.
GRAPH_FIELDS = GraphOperands._fields
_PACKED_DTYPES = (torch.int32, torch.int64, torch.uint8, torch.float32, torch.float64,
                  torch.float16, torch.bfloat16)
PACK_ALIGN = 16
_WEIGHT_FIELDS = (GRAPH_FIELDS.index("weight"), GRAPH_FIELDS.index("weight_t"))
#: The sizes in :attr:`PackedGraph.layout`, after its flags.
LAYOUT_SIZES = ("num_dst", "num_edges", "num_items", "num_zeroed", "num_src")
#: Each field's length: ``(position in LAYOUT_SIZES, plus)``.
_FIELD_LENGTHS = (
    (0, 1), (1, 0), (1, 0), (0, 0),  # rowptr, col, weight, row_scale
    (2, 0), (2, 0), (2, 0), (2, 0),  # the schedule's item_row, start, end, split
    (3, 0),                          # zeroed_rows
    (4, 1), (1, 0), (1, 0),          # colptr, row_t, weight_t
)
_TYPE_BITS = 3
_TYPE_MASK = (1 << _TYPE_BITS) - 1
#: The first of the bits that mark a field as not to be read.
_UNREAD_BITS = _TYPE_BITS * len(GRAPH_FIELDS)


def _padded(nbytes: int) -> int:
    return -(-nbytes // PACK_ALIGN) * PACK_ALIGN


def _field_type(flags: int, field: int) -> int:
    """The type code of ``field`` in a layout's ``flags``: 1 + its index in
    :data:`_PACKED_DTYPES`, 0 where the field is absent from the buffer."""
    return (flags >> (_TYPE_BITS * field)) & _TYPE_MASK


def _is_read(flags: int, field: int) -> bool:
    """Whether ``field`` is in the buffer and to be read."""
    return _field_type(flags, field) != 0 and not (flags >> (_UNREAD_BITS + field)) & 1


def _field_length(layout: List[int], field: int) -> int:
    size, plus = _FIELD_LENGTHS[field]
    return layout[1 + size] + plus


def _layout_sizes(g: GraphOperands) -> List[int]:
    """:data:`LAYOUT_SIZES` of ``g`` (0 for the sizes of absent fields)."""
    def length(t: Optional[Tensor], minus: int = 0) -> int:
        return 0 if t is None else t.numel() - minus
    return [g.rowptr.numel() - 1, g.col.numel(), length(g.item_row), length(g.zeroed_rows),
            length(g.colptr, 1)]


def pack(g: GraphOperands) -> Tuple[PackedGraph, GraphOperands]:
    """``g`` copied into one buffer, and the views of it that :func:`unpack`
    gives (equal to ``g``'s arrays). Edge values that need a gradient stay
    apart (a copy would cut them off from it)."""
    learnable = [t is not None and t.requires_grad for t in (g.weight, g.weight_t)]
    arrays = [None if i in _WEIGHT_FIELDS and learnable[_WEIGHT_FIELDS.index(i)] else a
              for i, a in enumerate(g)]
    layout = [0, *_layout_sizes(g)]
    pieces: List[Tensor] = []
    # Bytes that pad each array to PACK_ALIGN; never read, so left unset.
    padding = torch.empty(PACK_ALIGN, dtype=torch.uint8, device=g.col.device)
    for i, a in enumerate(arrays):
        if a is None:
            continue
        if a.numel() != _field_length(layout, i):
            raise ValueError(f"{GRAPH_FIELDS[i]} has {a.numel()} entries, "
                             f"not {_field_length(layout, i)}")
        layout[0] |= (1 + _PACKED_DTYPES.index(a.dtype)) << (_TYPE_BITS * i)
        nbytes = a.numel() * a.element_size()
        if a.requires_grad:
            a = a.detach()
        pieces.append(a.contiguous().view(torch.uint8))  # every field is one-dimensional
        if _padded(nbytes) > nbytes:
            pieces.append(padding[:_padded(nbytes) - nbytes])
    # One copy of every array (a new graph per batch is built on every step,
    # and each launch there costs host time).
    buffer = torch.cat(pieces) if pieces else padding[:0].clone()
    packed = PackedGraph(buffer, g.weight if learnable[0] else None,
                         g.weight_t if learnable[1] else None, layout)
    return packed, _views_of(buffer, layout, packed.weight, packed.weight_t)


def without_weights(layout: List[int]) -> List[int]:
    """``layout`` with the edge values (``weight``, ``row_scale``, ``weight_t``)
    marked as not to be read: for other edge values, passed apart."""
    flags = layout[0]
    for name in ("weight", "row_scale", "weight_t"):
        flags |= 1 << (_UNREAD_BITS + GRAPH_FIELDS.index(name))
    return [flags, *layout[1:]]


def layout_dtype(layout: List[int], name: str) -> Optional[torch.dtype]:
    """The type of field ``name`` in the buffer (None: absent)."""
    i = GRAPH_FIELDS.index(name)
    return _PACKED_DTYPES[_field_type(layout[0], i) - 1] if _is_read(layout[0], i) else None


def layout_numel(layout: List[int], name: str) -> int:
    """Entries of field ``name`` in the buffer (-1: absent)."""
    i = GRAPH_FIELDS.index(name)
    return _field_length(layout, i) if _is_read(layout[0], i) else -1


def _views_of(index: Tensor, layout: List[int], weight: Optional[Tensor],
              weight_t: Optional[Tensor]) -> GraphOperands:
    # The layout's arithmetic written out (every new graph's pack comes here).
    flags = layout[0]
    views: List[Optional[Tensor]] = []
    offset = 0
    for i, (size, plus) in enumerate(_FIELD_LENGTHS):
        code = (flags >> (_TYPE_BITS * i)) & _TYPE_MASK
        if not code:
            views.append(None)
            continue
        dtype = _PACKED_DTYPES[code - 1]
        nbytes = (layout[1 + size] + plus) * dtype.itemsize
        unread = (flags >> (_UNREAD_BITS + i)) & 1
        views.append(None if unread else index[offset:offset + nbytes].view(dtype))
        offset += _padded(nbytes)
    return _with_weights(GraphOperands(*views), weight, weight_t)


def _with_weights(g: GraphOperands, weight: Optional[Tensor],
                  weight_t: Optional[Tensor]) -> GraphOperands:
    if weight is not None:
        g = g._replace(weight=weight)
    if weight_t is not None:
        g = g._replace(weight_t=weight_t)
    return g


def unpack(index: Tensor, weight: Optional[Tensor], weight_t: Optional[Tensor],
           layout: List[int]) -> GraphOperands:
    """The :class:`GraphOperands` of a :class:`PackedGraph`'s fields: views of
    ``index`` (for the buffer of a live graph, the views made when it was
    packed: a dictionary lookup instead of twelve slices in eager mode), with
    ``weight`` and ``weight_t`` where given."""
    entry = _known_views(index)
    if entry is None:
        return _views_of(index, layout, weight, weight_t)
    views = entry.views
    if layout[0] != entry.flags:  # fields not to be read (:func:`without_weights`)
        views = entry.masked.get(layout[0])
        if views is None:
            views = entry.masked[layout[0]] = GraphOperands(
                *[v if _is_read(layout[0], i) else None for i, v in enumerate(entry.views)])
    return _with_weights(views, weight, weight_t)


class _Views:
    """The views of one packed buffer and its layout's flags, owned by its
    graph (see :func:`_known_views`); ``masked``: the views that a layout
    with other flags reads, by its flags."""
    __slots__ = ("index", "views", "flags", "masked", "__weakref__")

    def __init__(self, index: Tensor, views: GraphOperands, flags: int) -> None:
        self.index, self.views, self.flags = index, views, flags
        self.masked: Dict[int, GraphOperands] = {}


#: ``id(buffer) -> weakref(_Views)``: an entry holds its buffer, so the
#: registry holds it weakly and it dies with its graph.
_VIEWS: Dict[int, "weakref.ref[_Views]"] = {}


def _register_views(packed: PackedGraph, views: GraphOperands) -> _Views:
    entry = _Views(packed.index, views, packed.layout[0])
    key = id(packed.index)

    def forget(ref):
        if _VIEWS.get(key) is ref:
            del _VIEWS[key]

    _VIEWS[key] = weakref.ref(entry, forget)
    return entry


def _known_views(index: Tensor) -> Optional[_Views]:
    ref = _VIEWS.get(id(index))
    entry = ref() if ref is not None else None
    return entry if entry is not None and entry.index is index else None


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
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"Unknown normalization {normalization!r}; "
                             f"choose one of {NORMALIZATIONS}")
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
        self._bounded: set = set()  # keys of _operands built with a bounded schedule
        self._cache_hits = 0
        self._views: Dict[int, _Views] = {}  # keeps unpack()'s shortcut alive
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
        graph.gcn_options = self.gcn_options
        for max_edges in self._operands:
            graph._build_operands(max_edges)
        if self._static:
            graph._mark_static()
        return graph

    #: ``(improved, add_self_loops)`` of the ``gcn_norm`` a ``"gcn"`` graph holds.
    gcn_options: Optional[Tuple[bool, bool]] = None

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
        schedule = _work_schedule(self.rowptr.long(), self.num_edges, max_edges, bounded)
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
        graph._views = self._views
        if self._transposed is not None:
            colptr, row_t, _ = self._transposed
            # Read by the CPU backward only, which takes no gradient through it.
            graph._transposed = (colptr, row_t,
                                 weight.detach().index_select(0, self._transpose_order))
            graph._transpose_order = self._transpose_order
        graph._bounded = set(self._bounded)
        for max_edges, ops in self._operands.items():
            weight_t = None if layout_numel(ops.layout, "row_t") < 0 else graph._transposed[2]
            graph._operands[max_edges] = PackedGraph(ops.index, weight, weight_t,
                                                     without_weights(ops.layout))
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
        return _build_operands_eagerly(self, max_edges_per_item(k), False)

    def operands_without_sync(self, k: int) -> PackedGraph:
        """:meth:`operands`, built with the bounded work schedule where the
        graph is on a GPU and has fewer than :data:`BOUNDED_MAX_EDGES`
        edges (no host sync: what a layer asks for an adjacency it has not
        seen, such as a new mini-batch's)."""
        cached = self._operands.get(max_edges_per_item(k))
        if cached is not None:
            return cached
        bounded = self.device.type == "cuda" and self.num_edges < BOUNDED_MAX_EDGES
        return _build_operands_eagerly(self, max_edges_per_item(k), bounded)

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
        colptr = row_t = weight_t = None
        items = [None] * 5
        if self.device.type == "cpu":
            colptr, row_t, weight_t = self.transposed()
        if self.device.type != "cpu" or _simulated_kernels():
            schedule = self.schedule(max_edges, bounded)
            items = [schedule.row, schedule.start, schedule.end, schedule.split,
                     schedule.zeroed_rows]
        operands = GraphOperands(self.rowptr, self.kernel_col(), self.weight, self.row_scale,
                                 *items, colptr, row_t, weight_t)
        packed, views = pack(operands)
        self._views[max_edges] = _register_views(packed, views)
        if set(self._operands) <= {max_edges}:
            self._hold_views(operands, views)
        self._operands[max_edges] = packed
        if bounded:
            self._bounded.add(max_edges)
        else:
            self._bounded.discard(max_edges)
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
        if normalization == "mean":
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
        edge_index = _plain(edge_index)
        num_src, num_dst = size
        src, dst = edge_index[0], edge_index[1]
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
        # Row r starts at the first edge whose target is r or more: a binary
        # search over the sorted targets, with no host sync (a CUDA bincount
        # reads its input's range back to the host).
        rowptr = torch.searchsorted(
            dst, torch.arange(num_dst + 1, dtype=dst.dtype, device=dst.device))
        if checked_on_device and dst.numel() > 0:
            _assert_in_range(src, rowptr, num_src, dst.numel())
        value = None
        if edge_weight is not None:
            value = edge_weight if perm is None else edge_weight[perm]
        graph = cls.from_csr(rowptr, src, value, size, normalization, dtype)
        graph.edge_order = perm
        return graph

    @classmethod
    def from_adj(cls, adj: Any, size: Optional[Tuple[Optional[int], Optional[int]]] = None,
                 *, edge_weight: Optional[Tensor] = None, normalization: str = "sum",
                 use_sparse_tensor_values: bool = True, gcn_improved: bool = False,
                 gcn_add_self_loops: bool = True, dtype: torch.dtype = torch.float32,
                 cache: bool = True) -> "CSRGraph":
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
        """
        if isinstance(adj, CSRGraph):
            return adj
        if not (isinstance(adj, Tensor) or _is_sparse_tensor(adj)):
            raise TypeError(
                f"pyg_maxk cannot build a graph from {type(adj).__name__}: "
                f"expected an edge_index [2, E] tensor, torch_geometric.EdgeIndex, "
                f"torch_sparse.SparseTensor, a torch.sparse COO/CSR/CSC tensor "
                f"or a pyg_maxk.CSRGraph")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"Unknown normalization {normalization!r}; "
                             f"choose one of {NORMALIZATIONS}")
        if edge_weight is not None:
            _check_same_device(adj, edge_weight)
        if edge_weight is not None and torch.is_grad_enabled() and edge_weight.requires_grad:
            # Learnable edge values: the cached structure, values per call.
            return graph_with_edge_values(adj, size, edge_weight, None, normalization,
                                          gcn_improved, gcn_add_self_loops, dtype)
        anchors, versions = _fingerprint(adj, edge_weight)
        params = (normalization, use_sparse_tensor_values, gcn_improved,
                  gcn_add_self_loops, dtype, tuple(size) if size is not None else None)
        if cache:
            hit = _CACHE.get(anchors, versions, params)
            if hit is not None:
                return hit
        graph = _build(adj, size, edge_weight, normalization,
                       use_sparse_tensor_values, gcn_improved,
                       gcn_add_self_loops, dtype)
        if normalization == "gcn":
            graph.gcn_options = (bool(gcn_improved), bool(gcn_add_self_loops))
        if cache:
            _CACHE.put(anchors, versions, params, graph)
        return graph


def _simulated_kernels() -> bool:
    """Whether the CUDA kernels, the only readers of the work schedule, run
    on CPU tensors here (Numba's simulator)."""
    from .kernels import simulator_enabled
    return simulator_enabled()


@torch.compiler.disable
def _build_operands_eagerly(graph: CSRGraph, max_edges: int, bounded: bool) -> PackedGraph:
    # The schedule's sizes depend on the degrees (or, bounded, on the
    # graph's shape): built outside any compiled graph (a graph break where
    # the graph was not prepared for this k).
    return graph._build_operands(max_edges, bounded)


# ---------------------------------------------------------------- building
def _plain(t: Tensor) -> Tensor:
    """``t`` as a plain tensor (strips :class:`EdgeIndex`)."""
    return t.as_tensor() if _is_edge_index_type(t) else t


def _check_same_device(adj, edge_weight: Tensor) -> None:
    device = adj.device() if callable(getattr(adj, "device", None)) else adj.device
    if edge_weight.device != device:
        raise ValueError(f"edge_weight is on {edge_weight.device} but the adjacency on "
                         f"{device}; move both to one device")


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


def _check_edge_index(edge_index: Tensor) -> None:
    if edge_index.dtype.is_floating_point or edge_index.dtype in (torch.bool, torch.complex64):
        raise ValueError(f"Expected 'edge_index' to be of integer type "
                         f"(got '{edge_index.dtype}')")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"Expected 'edge_index' of shape [2, num_edges] "
                         f"(got {list(edge_index.shape)})")


def _sparse_size(adj: Any) -> Tuple[int, int]:
    """``(num_src, num_dst)`` of an ``adj_t``."""
    return int(adj.size(1)), int(adj.size(0))


def _build(adj: Any, size, edge_weight, normalization, use_sparse_tensor_values,
           gcn_improved, gcn_add_self_loops, dtype) -> CSRGraph:
    if _is_sparse_tensor(adj):
        sizes = _sparse_size(adj)
        if normalization == "gcn":
            from torch_geometric.nn.conv.gcn_conv import gcn_norm
            adj = gcn_norm(adj, None, sizes[0], gcn_improved, gcn_add_self_loops,
                           "source_to_target", dtype)
        rowptr, col, value = adj.csr()
        if not use_sparse_tensor_values and normalization != "gcn":
            value = None
        return CSRGraph.from_csr(rowptr, col, value, sizes, normalization, dtype)

    if _is_torch_sparse(adj):
        sizes = _sparse_size(adj)
        if normalization == "gcn":
            from torch_geometric.nn.conv.gcn_conv import gcn_norm
            adj, _ = gcn_norm(adj, None, sizes[0], gcn_improved, gcn_add_self_loops,
                              "source_to_target", dtype)
        csr = _as_sparse_csr(adj)
        return CSRGraph.from_csr(csr.crow_indices(), csr.col_indices(), csr.values(),
                                 sizes, normalization, dtype)

    _check_edge_index(adj)
    if size is None or size[0] is None or size[1] is None:
        raise ValueError("Building a CSRGraph from an edge_index needs "
                         "size=(num_src, num_dst)")
    sizes = (int(size[0]), int(size[1]))
    if normalization == "gcn":
        if sizes[0] != sizes[1]:
            raise ValueError("gcn normalisation needs a square adjacency, got "
                             f"size={sizes}")
        from torch_geometric.nn.conv.gcn_conv import gcn_norm
        edge_index, edge_weight = gcn_norm(_plain(adj), edge_weight, sizes[0],
                                           gcn_improved, gcn_add_self_loops,
                                           "source_to_target", dtype)
        return CSRGraph.from_edge_index(edge_index, edge_weight, sizes, "gcn", dtype)
    return CSRGraph.from_edge_index(adj, edge_weight, sizes, normalization, dtype)


# ------------------------------------------------------------------- cache
def _fingerprint(adj: Any, edge_weight: Optional[Tensor]) -> Tuple[List[Any], Tuple[int, ...]]:
    """The objects a graph is built from (kept as weak references) and the
    version counters that change when any of them is edited in place."""
    if _is_sparse_tensor(adj):
        storage = adj.storage
        tensors = [storage.rowptr(), storage.col()]
        if storage.has_value():
            tensors.append(storage.value())
        anchors = list(tensors)
    elif _is_torch_sparse(adj):
        anchors = [adj]
        values = adj._values() if adj.layout == torch.sparse_coo else adj.values()
        tensors = [adj, values]
    else:
        anchors = [adj]
        tensors = [adj]
    if edge_weight is not None:
        anchors.append(edge_weight)
        tensors.append(edge_weight)
    return anchors, tuple(t._version for t in tensors)


#: Cache hits after which a graph gets exact work schedules
#: (:meth:`CSRGraph.settle`): a new graph per mini-batch is served once per
#: layer, a fixed one on every step.
SETTLE_AFTER_HITS = 16


class _GraphCache:
    """A small LRU of graphs keyed on the identity of their source objects;
    a graph it serves often is settled (:data:`SETTLE_AFTER_HITS`)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: "OrderedDict[Hashable, Tuple[List[weakref.ref], Tuple[int, ...], CSRGraph]]"
        self._entries = OrderedDict()

    def _key(self, anchors: List[Any], params: Tuple) -> Hashable:
        return (tuple(id(a) for a in anchors), params)

    def get(self, anchors, versions, params) -> Optional[CSRGraph]:
        key = self._key(anchors, params)
        entry = self._entries.get(key)
        if entry is None:
            return None
        refs, cached_versions, graph = entry
        # A dead reference means the id was reused by a new object.
        if any(r() is not a for r, a in zip(refs, anchors)) or cached_versions != versions:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        graph._cache_hits += 1
        if graph._cache_hits == SETTLE_AFTER_HITS:
            graph.settle()
        return graph

    def put(self, anchors, versions, params, graph: CSRGraph) -> None:
        # Entries whose source objects died can never hit again.
        for key in [k for k, (refs, _, _) in self._entries.items()
                    if any(r() is None for r in refs)]:
            del self._entries[key]
        self._entries[self._key(anchors, params)] = (
            [weakref.ref(a) for a in anchors], versions, graph)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_CACHE = _GraphCache()


def clear_graph_cache() -> None:
    """Drop every cached graph (and its kernel schedules)."""
    _CACHE.clear()
    _STRUCTURES.clear()
    _SPARSE_STRUCTURES.clear()


_STRUCTURES = _GraphCache()
_SPARSE_STRUCTURES: Dict[Hashable, CSRGraph] = {}


def edge_structure(edge_index: Tensor, size: Tuple[int, int], gcn_self_loops: bool,
                   dtype: torch.dtype = torch.float32) -> CSRGraph:
    """The unweighted CSR structure of an ``edge_index`` (with the self-loops
    that PyG's ``gcn_norm`` adds when ``gcn_self_loops``), cached like
    :meth:`CSRGraph.from_adj`'s graphs: edge values computed per call go on
    it with :meth:`CSRGraph.with_weight`, in the order of
    :attr:`CSRGraph.edge_order` (positions in the edge list, self-loops
    after the edges, as ``gcn_norm`` returns them)."""
    _check_edge_index(edge_index)
    anchors, versions = _fingerprint(edge_index, None)
    params = ("structure", bool(gcn_self_loops), dtype, tuple(size))
    hit = _STRUCTURES.get(anchors, versions, params)
    if hit is not None:
        return hit
    edges = _plain(edge_index)
    if gcn_self_loops:
        from torch_geometric.utils import add_remaining_self_loops
        edges = add_remaining_self_loops(edges, None, 1.0, size[0])[0]
    graph = CSRGraph.from_edge_index(edges, None, size, "sum", dtype)
    if graph.edge_order is None:
        graph.edge_order = torch.arange(graph.num_edges, device=graph.device)
    _STRUCTURES.put(anchors, versions, params, graph)
    return graph



def graph_with_edge_values(adj: Any, size: Optional[Tuple[Optional[int], Optional[int]]],
                           edge_weight: Optional[Tensor], edge_mask: Optional[Tensor],
                           normalization: str, gcn_improved: bool = False,
                           gcn_add_self_loops: bool = True,
                           dtype: torch.dtype = torch.float32,
                           k: Optional[int] = None,
                           loop_mask: Optional[Tensor] = None) -> CSRGraph:
    """The graph of an adjacency whose edge values are recomputed on every
    call, differentiably, from ``edge_weight`` and ``edge_mask`` (either may
    need a gradient): PyG's semantics, in the order of the edge list (of an
    ``edge_index``) or of the stored entries (of a sparse ``adj_t``, whose
    learnable values play ``edge_weight``'s part).

    * ``"gcn"``: ``gcn_norm(edge_index, edge_weight)``'s values (self-loops
      added after the edges), each times the mask. A mask of one entry per
      input edge covers the non-loop edges; the loops ``gcn_norm`` adds get
      1 (what PyG's ``explain_message`` does).
    * ``"sum"``: ``edge_weight`` (or ones) times the mask.
    * ``"mean"``: the mask over the in-degree (PyG's mean counts every
      message, masked or not).
    * With a mask, SAGE and GIN ignore a sparse ``adj_t``'s values (PyG's
      explained ``propagate`` sends plain messages); GCN's normalised sparse
      matrix has its self-loops in place, and the mask is extended as PyG
      extends it: its entries at ``loop_mask`` (PyG's explainers set it),
      then ones.

    The structure and its work schedules (built for ``k`` when given) come
    from :func:`edge_structure` (cached); only the ``[E]`` values are new per
    call.
    """
    if _is_sparse_tensor(adj) or _is_torch_sparse(adj):
        return _sparse_graph_with_values(adj, normalization, gcn_improved,
                                         gcn_add_self_loops, dtype, k, edge_mask, loop_mask)
    if size is None or size[0] is None or size[1] is None:
        raise ValueError("Building a CSRGraph from an edge_index needs size=(num_src, num_dst)")
    sizes = (int(size[0]), int(size[1]))
    edge_index = _plain(adj)
    _check_edge_index(edge_index)
    gcn = normalization == "gcn"
    if gcn and sizes[0] != sizes[1]:
        raise ValueError(f"gcn normalisation needs a square adjacency, got size={sizes}")
    structure = edge_structure(edge_index, sizes, gcn and gcn_add_self_loops, dtype)
    if k is not None:
        structure.operands_without_sync(k)
    num_edges = edge_index.size(1)
    if gcn:
        from torch_geometric.nn.conv.gcn_conv import gcn_norm
        _, values = gcn_norm(edge_index, edge_weight, sizes[0], gcn_improved,
                             gcn_add_self_loops, "source_to_target", dtype)
    elif edge_weight is not None and normalization == "sum":
        values = edge_weight.to(dtype)
    else:
        values = torch.ones(num_edges, dtype=dtype, device=edge_index.device)
    if edge_mask is not None:
        if edge_mask.numel() != num_edges:
            raise ValueError(f"The edge mask has {edge_mask.numel()} entries for "
                             f"{num_edges} edges")
        if values.numel() != num_edges:  # gcn_norm replaced the self-loops
            kept = edge_mask[edge_index[0] != edge_index[1]]
            edge_mask = torch.cat([kept, kept.new_ones(values.numel() - kept.numel())])
        values = values * edge_mask.to(dtype)
    # index_select, not indexing: its backward is an index_add (a
    # permutation: one add per entry), where indexing's sorts on CUDA.
    values = values.index_select(0, structure.edge_order)
    if normalization == "mean":
        values = values * _inverse_degree_per_edge(structure).to(values.dtype)
    return structure.with_weight(values.contiguous(), normalization)


def _sparse_graph_with_values(adj: Any, normalization: str, gcn_improved: bool,
                              gcn_add_self_loops: bool, dtype: torch.dtype, k: Optional[int],
                              edge_mask: Optional[Tensor],
                              loop_mask: Optional[Tensor]) -> CSRGraph:
    """:func:`graph_with_edge_values` of a sparse ``adj_t``: PyG's
    ``gcn_norm`` of it (differentiable in the values), times the mask, on
    the cached structure."""
    if normalization == "mean" and edge_mask is None:
        raise NotImplementedError("pyg_maxk's mean aggregation ignores the sparse values")
    sizes = _sparse_size(adj)
    if normalization == "gcn":
        from torch_geometric.nn.conv.gcn_conv import gcn_norm
        adj = gcn_norm(adj, None, sizes[0], gcn_improved, gcn_add_self_loops,
                       "source_to_target", dtype)
        adj = adj[0] if isinstance(adj, tuple) else adj
    if _is_sparse_tensor(adj):
        rowptr, col, values = adj.csr()
    else:
        csr = _as_sparse_csr(adj)
        rowptr, col, values = csr.crow_indices(), csr.col_indices(), csr.values()
    # The normalised tensor is new on every call: its structure is looked up
    # by shape and checked equal (one pass over the indices), never assumed.
    key = (sizes, col.numel(), col.device, rowptr.dtype, col.dtype)
    structure = _SPARSE_STRUCTURES.get(key)
    if structure is None or not (torch.equal(structure.rowptr, rowptr)
                                 and torch.equal(structure.col, col)):
        structure = CSRGraph.from_csr(rowptr, col, None, sizes, "sum", dtype)
        _SPARSE_STRUCTURES[key] = structure
        while len(_SPARSE_STRUCTURES) > _STRUCTURES.capacity:
            _SPARSE_STRUCTURES.pop(next(iter(_SPARSE_STRUCTURES)))
    if k is not None:
        structure.operands_without_sync(k)
    if edge_mask is not None:
        if normalization != "gcn":  # plain messages: the stored values do not count
            values = torch.ones(col.numel(), dtype=dtype, device=col.device)
        if edge_mask.numel() != values.numel() and loop_mask is not None:
            edge_mask = edge_mask[loop_mask]
            edge_mask = torch.cat([edge_mask, edge_mask.new_ones(values.numel()
                                                                 - edge_mask.numel())])
        if edge_mask.numel() != values.numel():
            raise ValueError(f"The edge mask has {edge_mask.numel()} entries for "
                             f"{values.numel()} edges")
        values = values.to(dtype) * edge_mask.to(dtype)
        if normalization == "mean":
            values = values * _inverse_degree_per_edge(structure).to(dtype)
    return structure.with_weight(values.to(dtype).contiguous(), normalization)


def _inverse_degree_per_edge(graph: CSRGraph) -> Tensor:
    """``1 / in-degree`` of every edge's target (cached on the structure)."""
    cached = getattr(graph, "_inverse_degree", None)
    if cached is None:
        deg = graph.in_degree()
        inv = 1.0 / deg.to(torch.float64).clamp(min=1)
        cached = torch.repeat_interleave(inv, deg.long(), output_size=graph.num_edges)
        graph._inverse_degree = cached
    return cached

"""The operands the aggregation ops read (:class:`GraphOperands`), packed
into one byte buffer as the custom ops take them (:class:`PackedGraph`),
and the views that give them back (:func:`unpack`)."""
from __future__ import annotations

import functools
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor


class GraphOperands(NamedTuple):
    """Every tensor the aggregation ops read, for one ``k``: what the
    backends' implementations take (:mod:`pyg_maxk.ops`). The custom ops
    take it packed (:class:`PackedGraph`); :func:`unpack` gives it back.

    ``colptr``, ``row_t`` and ``weight_t`` (the graph grouped by source: the
    CPU kernels' backward) exist on CPU graphs only.

    An edge list (:class:`~pyg_maxk.graph.EdgeListGraph`) has no ``rowptr``
    and no schedule: ``col`` and ``row`` are each edge's source and target,
    in the list's order, and ``weight`` its value in that order.
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
    row: Optional[Tensor] = None  # [E]: each edge's target, in an edge list only


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
#: Each packed type's code in a layout's flags: 1 + its index above (0: absent).
_TYPE_CODES = {dtype: 1 + i for i, dtype in enumerate(_PACKED_DTYPES)}
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
    (1, 0),                          # row
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
    num_dst = length(g.rowptr, 1) if g.rowptr is not None else length(g.row_scale)
    return [num_dst, g.col.numel(), length(g.item_row), length(g.zeroed_rows),
            length(g.colptr, 1)]


_Placement = Tuple[Tuple[int, int, int, torch.dtype], ...]  # (field, offset, bytes, type)


def _placement(dtypes: Sequence[Optional[torch.dtype]], sizes: Sequence[int]
               ) -> Tuple[int, _Placement, int]:
    """``(flags, placement, bytes)`` of a buffer of the fields whose type is
    given in ``dtypes`` (None: absent), with lengths from ``sizes``."""
    return _placement_of(tuple(dtypes), tuple(sizes))


@functools.lru_cache(maxsize=256)  # new graphs of one shape share it
def _placement_of(dtypes: Tuple[Optional[torch.dtype], ...], sizes: Tuple[int, ...]
                  ) -> Tuple[int, _Placement, int]:
    flags = 0
    fields = []
    offset = 0
    for i, dtype in enumerate(dtypes):
        if dtype is None:
            continue
        size, plus = _FIELD_LENGTHS[i]
        flags |= _TYPE_CODES[dtype] << (_TYPE_BITS * i)
        nbytes = (sizes[size] + plus) * dtype.itemsize
        fields.append((i, offset, nbytes, dtype))
        offset += _padded(nbytes)
    return flags, tuple(fields), offset


def _attach_views(buffer: Tensor, flags: int, fields: _Placement,
                  views: Optional[Sequence[Tensor]] = None) -> GraphOperands:
    """The views of ``buffer``'s fields (``views``: made already, one per
    field), kept on the buffer itself: :func:`unpack`'s eager shortcut,
    alive exactly as long as the buffer (they hold its memory, not the
    buffer)."""
    found: List[Optional[Tensor]] = [None] * len(GRAPH_FIELDS)
    for j, (i, at, nbytes, dtype) in enumerate(fields):
        found[i] = buffer[at:at + nbytes].view(dtype) if views is None else views[j]
    operands = GraphOperands(*found)
    setattr(buffer, _VIEWS_ATTR, _Views(operands, flags))
    return operands


def allocate_on_cpu(dtypes: Sequence[Optional[torch.dtype]], sizes: List[int]
                    ) -> Tuple[Tensor, List[int], GraphOperands, GraphOperands]:
    """An unset CPU buffer for the fields of :data:`GRAPH_FIELDS` whose type
    is given in ``dtypes`` (None: absent), with lengths from ``sizes``
    (:data:`LAYOUT_SIZES`): ``(buffer, layout, views, arrays)``, the views
    being the fields to write and ``arrays`` the same memory as numpy
    arrays (what the CPU kernels take). A graph built on the CPU writes its
    arrays there in place, with no copy into a buffer afterwards. The
    memory is numpy's, which the buffer and the views share: slicing it is
    cheaper than slicing a tensor, and nothing in it refers back to the
    buffer (whose attribute holds the views)."""
    flags, fields, nbytes = _placement(dtypes, sizes)
    memory = np.empty(nbytes, np.uint8)
    found: List[Optional[np.ndarray]] = [None] * len(GRAPH_FIELDS)
    views = []
    for i, at, size, dtype in fields:
        found[i] = memory[at:at + size].view(_NUMPY_TYPES[dtype])
        views.append(torch.from_numpy(found[i]))
    buffer = torch.from_numpy(memory)
    return (buffer, [flags, *sizes], _attach_views(buffer, flags, fields, views),
            GraphOperands(*found))


_NUMPY_TYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8,
                torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def pack(g: GraphOperands) -> Tuple[PackedGraph, GraphOperands]:
    """``g`` copied into one buffer, and the views of it that :func:`unpack`
    gives (equal to ``g``'s arrays). Edge values that need a gradient stay
    apart (a copy would cut them off from it)."""
    learnable = [t is not None and t.requires_grad for t in (g.weight, g.weight_t)]
    sizes = _layout_sizes(g)
    dtypes: List[Optional[torch.dtype]] = []
    for i, a in enumerate(g):
        if a is None or (i in _WEIGHT_FIELDS and learnable[_WEIGHT_FIELDS.index(i)]):
            dtypes.append(None)
            continue
        size, plus = _FIELD_LENGTHS[i]
        if a.numel() != sizes[size] + plus:
            raise ValueError(f"{GRAPH_FIELDS[i]} has {a.numel()} entries, "
                             f"not {sizes[size] + plus}")
        dtypes.append(a.dtype)
    flags, fields, _ = _placement(dtypes, sizes)
    # Bytes that pad each array to PACK_ALIGN; never read, so left unset.
    padding = torch.empty(PACK_ALIGN, dtype=torch.uint8, device=g.col.device)
    pieces: List[Tensor] = []
    for i, _, nbytes, _ in fields:
        a = g[i] if not g[i].requires_grad else g[i].detach()
        pieces.append(a.contiguous().view(torch.uint8))  # every field is one-dimensional
        if _padded(nbytes) > nbytes:
            pieces.append(padding[:_padded(nbytes) - nbytes])
    # One copy of every array (a new graph per batch is built on every step,
    # and each launch there costs host time).
    buffer = torch.cat(pieces) if pieces else padding[:0].clone()
    views = _attach_views(buffer, flags, fields)
    packed = PackedGraph(buffer, g.weight if learnable[0] else None,
                         g.weight_t if learnable[1] else None, [flags, *sizes])
    return packed, _with_weights(views, packed.weight, packed.weight_t)


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
    ``index`` (for a buffer made by :func:`pack`, the views made there: an
    attribute lookup instead of twelve slices in eager mode), with
    ``weight`` and ``weight_t`` where given."""
    entry = getattr(index, _VIEWS_ATTR, None)
    if entry is None:  # a copy, or a traced stand-in for the buffer
        return _views_of(index, layout, weight, weight_t)
    views = entry.views
    if layout[0] != entry.flags:  # fields not to be read (:func:`without_weights`)
        views = entry.masked.get(layout[0])
        if views is None:
            views = entry.masked[layout[0]] = GraphOperands(
                *[v if _is_read(layout[0], i) else None for i, v in enumerate(entry.views)])
    return _with_weights(views, weight, weight_t)


#: The attribute of a packed buffer that holds its views (:class:`_Views`).
_VIEWS_ATTR = "_pyg_maxk_views"


class _Views:
    """The views of one packed buffer (edge values that come apart left
    out) and its layout's flags; ``masked``: the views that a layout with
    other flags reads, by its flags."""
    __slots__ = ("views", "flags", "masked")

    def __init__(self, views: GraphOperands, flags: int) -> None:
        self.views, self.flags = views, flags
        self.masked: Dict[int, GraphOperands] = {}

"""The work schedule of the CUDA aggregation kernels: a CSR graph's rows cut
into items of at most ``max_edges`` edges, one warp's share each."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
from torch import Tensor

#: Target (edge, slot) pairs per kernel work item (one warp's share): a row
#: with more edges than ``PAIRS_PER_ITEM // k`` is cut into several items.
PAIRS_PER_ITEM = 8192


def max_edges_per_item(k: int) -> int:
    """Edges of one work item of the SpGEMM/SSpMM at ``k`` entries per row."""
    return max(1, PAIRS_PER_ITEM // int(k))


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


def _nonzero(mask: Tensor, count: int, fill_value: int = -1) -> Tensor:
    """The first ``count`` positions where ``mask`` holds, padded with
    ``fill_value`` to ``count`` entries: no host sync where torch has
    ``nonzero_static`` for the device (else ``nonzero`` and a pad)."""
    try:
        return torch.nonzero_static(mask, size=count, fill_value=fill_value).view(-1)
    except (AttributeError, NotImplementedError, RuntimeError):
        found = torch.nonzero(mask).view(-1)[:count]
        return torch.cat([found, found.new_full((count - found.numel(),), fill_value)])


def work_schedule(rowptr: Tensor, num_edges: int, max_edges: int,
                  bounded: bool) -> "WorkSchedule":
    """The :class:`WorkSchedule` of the CSR rows ``rowptr``: a bounded one
    by the Numba kernels where they run (three launches), else, and exact
    ones (built once per graph), by torch ops."""
    if bounded and numba_builds(rowptr):
        from ..ops.numba_ops import bounded_work_items
        num_dst = rowptr.numel() - 1
        num_items, num_zeroed = bounded_sizes(num_dst, num_edges, max_edges)
        items, zeroed_rows = bounded_work_items(rowptr, num_items, num_zeroed, max_edges)
        row, start, end, split = items
        return WorkSchedule(max_edges=max_edges, row=row, start=start, end=end, split=split,
                            zeroed_rows=zeroed_rows, bounded=True)
    return schedule_with_torch(rowptr.long(), num_edges, max_edges, bounded)


def bounded_sizes(num_dst: int, num_edges: int, max_edges: int) -> Tuple[int, int]:
    """``(items, zeroed rows)`` of a bounded schedule: known from the shape."""
    return num_dst + num_edges // max_edges, min(num_dst, num_edges // (max_edges + 1))


def numba_builds(t: Tensor) -> bool:
    """Whether Numba kernels build a new graph's arrays on ``t``'s device: a
    GPU (or Numba's simulator) where Numba's CUDA target imports."""
    from ..kernels import numba_status, simulator_enabled
    if not (t.is_cuda or simulator_enabled()):
        return False
    status = numba_status()
    return status.importable and (status.cuda_available or status.simulator)


def schedule_with_torch(rowptr: Tensor, num_edges: int, max_edges: int,
                        bounded: bool) -> "WorkSchedule":
    """The :class:`WorkSchedule` of the CSR rows ``rowptr`` (int64) in torch
    ops."""
    device = rowptr.device
    num_dst = rowptr.numel() - 1
    deg = rowptr[1:] - rowptr[:-1]
    pieces = ((deg + (max_edges - 1)) // max_edges).clamp_(min=1)
    is_split = pieces > 1
    if bounded:
        num_items, num_zeroed = bounded_sizes(num_dst, num_edges, max_edges)
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

"""The CUDA kernels' launch geometry in this process, and the shapes it
takes: what :mod:`pyg_maxk.ops.numba_ops` launches with and what
:mod:`pyg_maxk.dispatch` asks before it picks the ``"numba"`` backend (one
source for both). Numba's simulator runs one-warp blocks.
"""
from __future__ import annotations

from ._numba import simulator_enabled
from ._warp import WARP
from .linear import LINEAR_WARPS, linear_fits
from .maxk_select import ROWS_PER_BLOCK, densify_fits
from .spgemm import fits_shared_memory

#: Threads of an SpGEMM/SSpMM/SDDMM block on a GPU.
THREADS = 128


def block_threads() -> int:
    """Threads of one SpGEMM/SSpMM/SDDMM block here."""
    return WARP if simulator_enabled() else THREADS


def rows_per_block() -> int:
    """Rows (one per warp) of a select/densify block here."""
    return 1 if simulator_enabled() else ROWS_PER_BLOCK


def linear_warps() -> int:
    """Warps of one CBSR-linear block here."""
    return 1 if simulator_enabled() else LINEAR_WARPS


def takes_aggregation(k: int, dim: int) -> bool:
    """Whether the SpGEMM/SSpMM/SDDMM take CBSR features of this shape (their
    shared-memory rows hold ``dim`` floats per warp)."""
    return fits_shared_memory(k, dim, block_threads() // WARP)


def takes_densify(dim: int) -> bool:
    """Whether the densify kernel takes rows of width ``dim`` (one row per
    warp in shared memory); MaxK's widths (``dispatch.MAX_SELECT_DIM``)
    always fit."""
    return densify_fits(dim, rows_per_block())


def takes_linear(dim: int, k: int) -> bool:
    """Whether the CBSR-linear kernel takes CBSR rows of this shape (a
    ``W^T`` tile of ``dim`` rows in shared memory)."""
    return linear_fits(dim, k, linear_warps())

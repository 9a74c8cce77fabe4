"""Warp-level helpers shared by the kernels.

Numba's simulator has no ``syncwarp`` (nor shuffles or ballots): there the
launcher uses one-warp blocks and ``syncthreads`` stands in (the same
semantics for a one-warp block). Kernels using :func:`warp_sync` keep every
loop bound warp-uniform, so every lane reaches every barrier.
"""
from __future__ import annotations

import functools

from ._numba import cuda_module, simulator_enabled

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()

WARP = 32


@functools.lru_cache(maxsize=None)
def warp_sync():
    """A device function that synchronises the lanes of a warp."""
    if simulator_enabled():
        @cuda.jit(device=True, inline=True)
        def sync():
            cuda.syncthreads()  # launched with one-warp blocks
    else:
        @cuda.jit(device=True, inline=True)
        def sync():
            cuda.syncwarp()
    return sync

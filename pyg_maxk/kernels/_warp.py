"""Warp-level helpers shared by the kernels, and the grid-stride span of
the kernels that take one thread per element.

Numba's simulator has no ``syncwarp``, shuffles or ballots: there the
launchers use one-warp blocks, ``syncthreads`` stands in for ``syncwarp`` (the
same semantics for a one-warp block) and the reductions go through a
per-warp shared-memory ``scratch`` row (``[warps, 32]`` uint32, unused on a
GPU). Kernels using these keep every loop bound warp-uniform, so every lane
reaches every barrier and every shuffle.
"""
from __future__ import annotations

import functools

from ._cache import stable_identity
from ._numba import cuda_module, simulator_enabled

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import int32, uint32  # noqa: E402 (after the numpy shim)

WARP = 32
FULL_MASK = 0xFFFFFFFF


@functools.lru_cache(maxsize=None)
def thread_span():
    """``first, stride = span()``: this thread's first element of a
    grid-stride loop over a flat array and the loop's stride, as uint32
    (Numba compares mixed signed/unsigned bounds in float64)."""
    @cuda.jit(device=True, inline=True)
    def span():
        threads = uint32(cuda.blockDim.x)
        return (uint32(cuda.blockIdx.x) * threads + uint32(cuda.threadIdx.x),
                uint32(cuda.gridDim.x) * threads)
    return span


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


@functools.lru_cache(maxsize=None)
def warp_sum(redux: bool = False):
    """``warp_sum(value, lane, scratch_row) -> uint32``: the sum of a uint32
    over the warp's lanes, returned to every lane. With ``redux`` (the
    device must be sm_80 or later) one ``redux.sync`` instruction, else five
    shuffle-and-add steps."""
    if simulator_enabled():
        return _scratch_sum(below_only=False)
    if redux:
        add_over_warp = _redux_add()

        @cuda.jit(device=True, inline=True)
        def total(value, lane, scratch_row):
            return add_over_warp(uint32(value))
    else:
        @cuda.jit(device=True, inline=True)
        def total(value, lane, scratch_row):
            # Spelled out: a loop over a tuple of offsets compiles to a
            # branchy switch per step (seen in SASS), not to immediates.
            # Shuffles take signed ints (counts fit); int32(...) keeps the
            # sums 32-bit (int32 + int32 is int64 in Numba: two shuffles).
            s = int32(value)
            s = int32(s + cuda.shfl_xor_sync(FULL_MASK, s, 16))
            s = int32(s + cuda.shfl_xor_sync(FULL_MASK, s, 8))
            s = int32(s + cuda.shfl_xor_sync(FULL_MASK, s, 4))
            s = int32(s + cuda.shfl_xor_sync(FULL_MASK, s, 2))
            s = int32(s + cuda.shfl_xor_sync(FULL_MASK, s, 1))
            return uint32(s)
    return total


@functools.lru_cache(maxsize=None)
def _scratch_sum(below_only: bool):
    """The simulator's warp sums: through the warp's ``scratch_row``, over all
    lanes or (``below_only``) over the lanes below this one."""
    @cuda.jit(device=True, inline=True)
    def total(value, lane, scratch_row):
        scratch_row[lane] = uint32(value)
        cuda.syncthreads()
        s = uint32(0)
        for other in range(WARP):
            if not below_only or other < lane:
                s += scratch_row[other]
        cuda.syncthreads()
        return s

    return total


@functools.lru_cache(maxsize=None)
def _redux_add():
    """``add_over_warp(value: uint32) -> uint32``: PTX ``redux.sync.add.u32``
    over all 32 lanes (sm_80+), which Numba does not emit on its own."""
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def add_over_warp(typingctx, value):
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32]),
                               "redux.sync.add.u32 $0, $1, $2;", "=r,r,r", side_effect=True)
            return builder.call(asm, [args[0], ir.Constant(i32, FULL_MASK)])

        return types.uint32(types.uint32), codegen

    return stable_identity(add_over_warp)


@functools.lru_cache(maxsize=None)
def warp_exclusive_sum():
    """``warp_exclusive_sum(value, lane, scratch_row) -> uint32``: the sum of
    a uint32 over the lanes below this one (0 on lane 0)."""
    if simulator_enabled():
        return _scratch_sum(below_only=True)

    @cuda.jit(device=True, inline=True)
    def below(value, lane, scratch_row):
        # An inclusive scan (a shuffle from ``delta`` lanes down returns
        # the lane's own value below ``delta``: not added), minus its own.
        v = int32(value)
        s = v
        t = cuda.shfl_up_sync(FULL_MASK, s, 1)
        s = int32(s + (t if lane >= uint32(1) else int32(0)))
        t = cuda.shfl_up_sync(FULL_MASK, s, 2)
        s = int32(s + (t if lane >= uint32(2) else int32(0)))
        t = cuda.shfl_up_sync(FULL_MASK, s, 4)
        s = int32(s + (t if lane >= uint32(4) else int32(0)))
        t = cuda.shfl_up_sync(FULL_MASK, s, 8)
        s = int32(s + (t if lane >= uint32(8) else int32(0)))
        t = cuda.shfl_up_sync(FULL_MASK, s, 16)
        s = int32(s + (t if lane >= uint32(16) else int32(0)))
        return uint32(s - v)
    return below


@functools.lru_cache(maxsize=None)
def warp_rank():
    """``warp_rank(flag, lane, scratch_row) -> (below, total)``: how many lanes
    below this one have ``flag`` set, and how many lanes in all."""
    if simulator_enabled():
        @cuda.jit(device=True, inline=True)
        def rank(flag, lane, scratch_row):
            scratch_row[lane] = uint32(1) if flag else uint32(0)
            cuda.syncthreads()
            below = uint32(0)
            count = uint32(0)
            for other in range(WARP):
                f = scratch_row[other]
                count += f
                if other < lane:
                    below += f
            cuda.syncthreads()
            return below, count
    else:
        @cuda.jit(device=True, inline=True)
        def rank(flag, lane, scratch_row):
            mask = uint32(cuda.ballot_sync(FULL_MASK, flag))
            lower = (uint32(1) << lane) - uint32(1)
            return uint32(cuda.popc(mask & lower)), uint32(cuda.popc(mask))
    return rank


@functools.lru_cache(maxsize=None)
def cbsr_row_loader(k: int, ahead: int):
    """``load(values, indices, row, lane, val, pos)``: slots ``lane + 32 * c``
    (``c < ahead``) of CBSR row ``row`` into a lane's ``val``/``pos`` arrays
    (registers after unrolling), so that a warp can load its next row while
    it works on this one. A slot past ``k - 1`` loads slot ``k - 1`` instead:
    in bounds, and the caller never uses it."""
    last_slot = uint32(k - 1)

    @cuda.jit(device=True, inline=True)
    def load(values, indices, row, lane, val, pos):
        for c in range(ahead):
            j = min(lane + uint32(c * WARP), last_slot)
            val[c] = values[row, j]
            pos[c] = uint32(indices[row, j])

    return load

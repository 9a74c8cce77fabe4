"""MaxK selection: the ``k`` largest entries of every row, written straight
into CBSR, and the way back from CBSR to dense rows (its backward).

One warp per row. Each lane holds ``ceil(dim / 32)`` entries of the row in
registers as order-preserving uint32 keys, and a radix select over the key
bits (most significant first) finds the ``k``-th largest key ``T``: one
warp-wide count per bit, 32 at most, stopping early once exactly ``k`` keys
lie at or above the candidate prefix. The cost per row is
``O(32 * dim / 32)`` whatever ``k``; ``torch.topk`` costs several times more
on the shapes MaxK sees (measured in ``benchmarks/kernels.py``). On sm_80 and
later a warp-wide count is one ``redux.sync`` instead of five shuffle-add
steps.

A half-precision row is ranked by the float32 key's upper bits alone: the
lower 16 (bfloat16) or 13 (float16) are the same for every value of that
type with the same upper bits (zeros for numbers at or above zero, ones
below), so 16 or 19 bits are selected over instead of 32. Ties are common
among half values, and a row with a tie at ``T`` never stops early: this
shortens exactly the longest selections.

The kernel keeps every key above ``T`` and, among the keys equal to ``T``,
the lowest columns. As in :func:`torch.topk`, NaN ranks above every number
and ``-0.0`` ties with ``0.0``.

A row's kept entries are written in *bank-major* order: by column modulo 32
(the lane that holds them, and the shared-memory bank the column falls in),
then by column; one warp-wide prefix sum of the lanes' kept counts places
them. The SpGEMM and SSpMM read a neighbour's slots a few per lane and
per instruction (:mod:`.spgemm`), and their shared-memory accesses at a
row's columns then spread over more banks than in column order, where the
slots one instruction reads lie about 32 columns apart, often in the same
bank (fewer conflicts, a faster SpGEMM and SSpMM: ``docs/design.md``).
Nothing relies on the order for its result.
"""
from __future__ import annotations

import functools
import math

from ._numba import cuda_module, kernel_jit

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32, int16, int32, uint32  # noqa: E402 (after the numpy shim)

from ._half import float_bits, or_into_pair_word, stores_pairs  # noqa: E402
from ._warp import (  # noqa: E402
    WARP,
    cbsr_row_loader,
    thread_span,
    warp_exclusive_sum,
    warp_rank,
    warp_sum,
    warp_sync,
)

#: Rows (warps) per block on a GPU; the simulator runs one-warp blocks.
ROWS_PER_BLOCK = 4

_SIGN = uint32(0x80000000)
_ABS = uint32(0x7FFFFFFF)
_INF = uint32(0x7F800000)
_ALL = uint32(0xFFFFFFFF)


@functools.lru_cache(maxsize=None)
def _order_key():
    @cuda.jit(device=True, inline=True)
    def order_key(bits):
        """A uint32 whose unsigned order is the float32 order of ``bits`` (a
        float32 bit pattern), with -0.0 equal to 0.0 and NaN above +inf."""
        b = uint32(bits)
        if b == _SIGN:
            b = uint32(0)
        if (b & _ABS) > _INF:
            return _ALL
        if b & _SIGN:
            return b ^ _ALL
        return b | _SIGN

    return order_key


@functools.lru_cache(maxsize=None)
def select_kernel(dim: int, k: int, rows_per_block: int, redux: bool = False,
                  half: str = "", scaled: bool = False, densify: bool = False,
                  zero_fill: bool = False, zero_sums: bool = False):
    """The compiled selection kernel for one ``(dim, k)``; ``x_bits`` is ``x``
    viewed as int32. ``redux``: count with ``redux.sync`` (sm_80+; see
    :func:`~._warp.warp_sum`). ``half`` (``"bf16"``/``"fp16"``): ``x``,
    ``x_bits`` and ``values`` are that type's 16-bit patterns (``int16``),
    ranked by their float32 value and copied bit for bit (:mod:`._half`).

    The steps of :func:`~pyg_maxk.ops.numba_ops.maxk_aggregate` that it can
    take on the way, each a launch or an op fewer (float32 only): ``scaled``
    multiplies each kept value by ``scale[row, slot]`` (the dropout),
    ``densify`` writes each row's dense form into ``dense`` as well (zeros
    at the columns not kept), ``zero_fill`` zeroes ``partial`` (the
    aggregation's float32 sums of its split rows, which its next launch adds
    into), ``zero_sums`` zeroes ``sums`` (``[num_rows, k]``, one cell per
    kept slot: the float32 sums that the backward's SSpMM adds into). The
    arrays of the steps not taken are never touched."""
    if half and (scaled or densify or zero_sums):
        raise ValueError("the select kernel scales, densifies and zeroes sums of float32 "
                         "rows only")
    is_half = bool(half)
    key_bits = float_bits(half) if is_half else None
    per_lane = math.ceil(dim / WARP)
    if per_lane > WARP:  # a lane's kept entries are the bits of one uint32
        raise ValueError(f"dim={dim} is too wide for the select kernel (at most {WARP * WARP})")
    order_key = _order_key()
    # The key bits below a half type's precision carry nothing (module docs).
    unused_bits = {"bf16": 16, "fp16": 13}.get(half, 0)
    key_shift, top_bit = uint32(unused_bits), 31 - unused_bits
    count_all, rank, lanes_below = warp_sum(redux), warp_rank(), warp_exclusive_sum()
    kk, d32, w32, zero, one = uint32(k), uint32(dim), uint32(WARP), uint32(0), uint32(1)
    rpb = uint32(rows_per_block)

    @kernel_jit()
    def maxk_select(x, x_bits, values, indices, num_rows, scale, dense, partial, sums):
        if zero_fill:
            cells = uint32(partial.shape[0]) * d32
            for i in range(uint32(cuda.grid(1)), cells, uint32(cuda.gridsize(1))):
                partial[i // d32, i % d32] = float32(0)
        lane = uint32(cuda.threadIdx.x) % w32
        warp = uint32(cuda.threadIdx.x) // w32
        scratch = cuda.shared.array((rows_per_block, WARP), uint32)  # simulator only
        mine = scratch[warp]
        keys = cuda.local.array(per_lane, uint32)  # registers after unrolling
        for first in range(uint32(cuda.blockIdx.x) * rpb, uint32(num_rows),
                           uint32(cuda.gridDim.x) * rpb):
            row = first + warp
            if row < uint32(num_rows):  # warp-uniform
                for m in range(per_lane):
                    c = lane + uint32(m * WARP)
                    if c >= d32:
                        keys[m] = zero  # below every key
                    elif is_half:
                        keys[m] = order_key(key_bits(x_bits[row, c])) >> key_shift
                    else:
                        keys[m] = order_key(x_bits[row, c])
                # threshold = the largest T with at least k keys >= T
                threshold = zero
                exact = False  # exactly k keys >= threshold: no ties to break
                for bit in range(top_bit, -1, -1):
                    # uint32 again: Numba widens integer arithmetic to 64 bits,
                    # and 64-bit compares cost two instructions each.
                    candidate = uint32(threshold | (one << uint32(bit)))
                    n = zero
                    for m in range(per_lane):
                        if keys[m] >= candidate:
                            n += one
                    n = count_all(n, lane, mine)
                    if n >= kk:
                        threshold = candidate
                        if n == kk:
                            exact = True
                            break
                ties_wanted = zero
                if not exact:
                    n = zero
                    for m in range(per_lane):
                        if keys[m] > threshold:
                            n += one
                    ties_wanted = kk - count_all(n, lane, mine)
                # Which of the lane's entries are kept (bit m: column lane + 32 m);
                # among keys equal to T the lowest columns are kept.
                kept = zero
                ties_seen = zero
                for m in range(per_lane):
                    key = keys[m]
                    tie_below, tie_total = zero, zero
                    if not exact:  # warp-uniform; exact (no ties to rank) is the usual case
                        tie_below, tie_total = rank(key == threshold, lane, mine)
                    if key > threshold or (key == threshold and (
                            exact or ties_seen + tie_below < ties_wanted)):
                        kept |= one << uint32(m)
                    ties_seen += tie_total
                # Bank-major order (module docs): lane after lane, each lane's
                # entries by column.
                slot = lanes_below(cuda.popc(kept), lane, mine)
                for m in range(per_lane):
                    c = lane + uint32(m * WARP)
                    if kept & (one << uint32(m)):
                        value = x[row, c]
                        if scaled:
                            value *= scale[row, slot]
                        values[row, slot] = value
                        indices[row, slot] = c
                        if zero_sums:
                            sums[row, slot] = float32(0)
                        slot += one
                        if densify:
                            dense[row, c] = value
                    elif densify and c < d32:
                        dense[row, c] = float32(0)

    return maxk_select


#: Shared memory a densify block may use: one ``dim``-wide row per warp.
DENSIFY_SHARED_BYTES = 48 * 1024


def densify_fits(dim: int, rows_per_block: int = ROWS_PER_BLOCK) -> bool:
    """Whether :func:`densify_kernel` takes rows of width ``dim``."""
    return rows_per_block * dim * 4 <= DENSIFY_SHARED_BYTES


#: Slots per lane (32 entries of a row each) that the densify kernel loads
#: one row ahead, in registers: every slot while ``k <= 128``.
DENSIFY_AHEAD = 4


@functools.lru_cache(maxsize=None)
def _entry_setter():
    """``put(row_buf, warp, column, value)``: one entry into a shared row."""
    @cuda.jit(device=True, inline=True)
    def put(row_buf, warp, column, value):
        row_buf[warp, column] = value
    return put


@functools.lru_cache(maxsize=None)
def densify_kernel(dim: int, k: int, rows_per_block: int, bits16: bool = False):
    """``dense[r, indices[r, j]] = values[r, j]``, every other entry 0: the
    dense form of a CBSR, and so also the MaxK backward (the gradient of the
    kept values scattered into a dense row). With ``bits16``, ``values`` and
    ``dense`` are the 16-bit patterns (``int16``) of a half type: copied as
    they are, and 0 is +0.0 in both.

    One warp per row builds the row in shared memory and writes all of it
    with coalesced stores, so ``dense`` needs no zero-fill beforehand (one
    pass over ``[N, dim]`` instead of a fill and a scattered second one).
    Indices of a row are distinct (as :func:`maxk` writes them), so the
    lanes' shared-memory stores never collide.

    The warp loads its next row's values and indices before it writes the
    current row, so their latency hides behind the stores. Half rows of even
    ``dim`` are built and stored as 32-bit words of two entries
    (:func:`~._half.stores_pairs`: ``dense`` is then viewed as
    ``int32 [N, dim / 2]``): half the shared-memory zeroing and reading, and
    twice the bytes per global store. Two
    lanes may set the two halves of one word, so an entry is OR-ed into its
    zeroed word atomically.
    """
    if not densify_fits(dim, rows_per_block):
        raise ValueError(f"dim={dim} is too wide for the densify kernel's shared memory")
    sync = warp_sync()
    kk, w32 = uint32(k), uint32(WARP)
    rpb = uint32(rows_per_block)
    ahead = min(-(-k // WARP), DENSIFY_AHEAD)
    load_ahead = cbsr_row_loader(k, ahead)
    rest_from = uint32(ahead * WARP)  # slots beyond: loaded when their row is built
    pairs = stores_pairs(bits16, dim)
    # The shared row: 32-bit words of two half entries, else one entry each.
    element = uint32 if pairs else (int16 if bits16 else float32)
    width = dim // 2 if pairs else dim
    w_row = uint32(width)
    zero = element(0)
    loaded, stored = (int16 if bits16 else float32), (int32 if pairs else element)
    put = or_into_pair_word() if pairs else _entry_setter()

    @kernel_jit()
    def densify(values, indices, dense, num_rows):
        row_buf = cuda.shared.array((rows_per_block, width), element)
        val = cuda.local.array(ahead, loaded)  # registers after unrolling
        pos = cuda.local.array(ahead, uint32)
        lane = uint32(cuda.threadIdx.x) % w32
        warp = uint32(cuda.threadIdx.x) // w32
        n = uint32(num_rows)
        stride = uint32(cuda.gridDim.x) * rpb
        row = uint32(cuda.blockIdx.x) * rpb + warp
        if row < n:
            load_ahead(values, indices, row, lane, val, pos)
        while row < n:  # warp-uniform
            following = row + stride
            for d in range(lane, w_row, w32):
                row_buf[warp, d] = zero
            sync()
            for c in range(ahead):
                if lane + uint32(c * WARP) < kk:
                    put(row_buf, warp, pos[c], val[c])
            for j in range(lane + rest_from, kk, w32):
                put(row_buf, warp, uint32(indices[row, j]), values[row, j])
            if following < n:
                load_ahead(values, indices, following, lane, val, pos)
            sync()
            for d in range(lane, w_row, w32):
                dense[row, d] = stored(row_buf[warp, d])
            sync()  # the next row's zeros wait for these reads
            row = following

    return densify


@functools.lru_cache(maxsize=None)
def densify_sum_kernel(dim: int, k: int, rows_per_block: int, has_kept: bool,
                       has_values: bool, has_dense: bool, has_scale: bool = False):
    """``dense[r, c] = (kept[r, j] + values[r, j] + source[r, c]) * scale[r, j]``
    for ``c = indices[r, j]``, each term where its flag is set (added in
    that order), every other entry 0, all float32: the features' gradient
    of MaxK and the aggregation of its CBSR from the gradients of the kept
    values (the SSpMM's ``kept``, the CBSR's own ``values``) and of the
    dense form (``source``, sampled at the pattern), through the dropout
    that scaled the kept values (``scale``: zero or ``1 / (1 - p)`` per
    slot). :func:`gather_kernel`, the sums and :func:`densify_kernel` in one
    launch. An absent argument is never read (any float32 ``[N, *]`` array
    stands in for it).

    One warp per row builds the row in shared memory and writes all of it
    with coalesced stores, as :func:`densify_kernel` does; a row's indices
    are distinct, so its lanes' shared-memory stores never collide.
    """
    if not densify_fits(dim, rows_per_block):
        raise ValueError(f"dim={dim} is too wide for the densify kernel's shared memory")
    if not (has_kept or has_values or has_dense):
        raise ValueError("densify_sum_kernel needs at least one term")
    sync = warp_sync()
    kk, w32, w_dim = uint32(k), uint32(WARP), uint32(dim)
    rpb = uint32(rows_per_block)
    zero = float32(0)

    @kernel_jit()
    def densify_sum(kept, values, source, scale, indices, dense, num_rows):
        row_buf = cuda.shared.array((rows_per_block, dim), float32)
        lane = uint32(cuda.threadIdx.x) % w32
        warp = uint32(cuda.threadIdx.x) // w32
        n = uint32(num_rows)
        stride = uint32(cuda.gridDim.x) * rpb
        row = uint32(cuda.blockIdx.x) * rpb + warp
        while row < n:  # warp-uniform
            for d in range(lane, w_dim, w32):
                row_buf[warp, d] = zero
            sync()
            for j in range(lane, kk, w32):
                column = uint32(indices[row, j])
                total = zero  # as the SSpMM's sums start
                if has_kept:
                    total += kept[row, j]
                if has_values:
                    total += values[row, j]
                if has_dense:
                    total += source[row, column]
                if has_scale:
                    total *= scale[row, j]
                row_buf[warp, column] = total
            sync()
            for d in range(lane, w_dim, w32):
                dense[row, d] = row_buf[warp, d]
            sync()  # the next row's zeros wait for these reads
            row += stride

    return densify_sum


@functools.lru_cache(maxsize=None)
def gather_kernel(k: int, bits16: bool = False):
    """``values[r, j] = dense[r, indices[r, j]]``: a dense matrix sampled at a
    CBSR pattern (the backward of :func:`densify_kernel`, and of the CBSR
    linear map with respect to the kept values). ``values`` and ``indices``
    are flat (``[N * k]``); with ``bits16`` the arrays hold the 16-bit
    patterns (``int16``) of a half type, copied as they are.

    One thread per slot (grid-stride): consecutive threads read consecutive
    indices and the entries of one row, which lie within a few sectors, so
    it reads the indices as they are stored (uint8, int16) and about the
    bytes of the sampled rows, where :func:`torch.gather` first needs an
    int64 copy of the indices."""
    kk = uint32(k)
    span = thread_span()

    @kernel_jit()
    def gather(dense, indices, values, num_slots):
        first, stride = span()
        for s in range(first, uint32(num_slots), stride):
            values[s] = dense[s // kk, uint32(indices[s])]

    return gather

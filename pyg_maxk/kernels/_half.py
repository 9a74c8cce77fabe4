"""Half-precision storage read by the float32 kernels.

The kernels take float16 and bfloat16 arrays as their raw 16-bit patterns
(an ``int16`` view: the CUDA Array Interface has no bfloat16) and widen each
element to float32 in registers, so that half precision halves the bytes
they gather while every sum stays float32. ``kind`` names the format:

* ``"bf16"``: the upper half of a float32, so widening is a shift (exact);
* ``"fp16"``: IEEE binary16, widened by the hardware conversion
  (``cvt.f32.f16``; exact: every binary16 is a float32).

``float_bits(kind)(bits)`` gives the float32 bit pattern of the widened
value (what the select kernel orders), ``widen(kind)(bits)`` the float32,
and ``narrow(kind)(x)`` the 16-bit pattern of a float32 rounded to the half
type (to nearest even, as torch's ``.to(dtype)``: a sum the kernel rounds
once as it stores it); ``widen("")`` and ``narrow("")`` are the identity
(float32 storage), so that a kernel reads and writes every storage type
through one call.

Under Numba's simulator they are plain Python on numpy scalars.
"""
from __future__ import annotations

import functools

from ._cache import stable_identity
from ._numba import cuda_module, simulator_enabled

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import int16, int32, uint32  # noqa: E402 (after the numpy shim)

HALF_KINDS = ("bf16", "fp16")
_LOW16 = uint32(0xFFFF)
_SIXTEEN = uint32(16)
_ABS_MASK = uint32(0x7FFFFFFF)
_INFINITY_BITS = uint32(0x7F800000)
_BF16_NAN = uint32(0x7FC0)
_BF16_HALFWAY = uint32(0x7FFF)


def _check(kind: str) -> None:
    if kind not in HALF_KINDS:
        raise ValueError(f"Unknown half-precision kind {kind!r}; one of {HALF_KINDS}")


@functools.lru_cache(maxsize=None)
def _identity():
    """``x -> x``: :func:`widen` and :func:`narrow` of float32 storage. Under
    the simulator a plain function, as the half conversions are: a simulated
    device function takes two locks per call, and a kernel whose threads call
    it per element crawl under that contention (minutes for a ``[1000,
    256]`` column sum in a full test run)."""
    def same(x):
        return x
    if simulator_enabled():
        return same
    return cuda.jit(device=True, inline=True)(same)


@functools.lru_cache(maxsize=None)
def float_bits(kind: str):
    """``bits(x) -> uint32``: the float32 bit pattern of the ``kind`` half
    whose 16-bit pattern is ``x``."""
    _check(kind)
    if simulator_enabled():
        return _simulated_float_bits(kind)
    if kind == "bf16":
        @cuda.jit(device=True, inline=True)
        def bits(x):
            return (uint32(x) & _LOW16) << _SIXTEEN
        return bits
    to_bits, fp16_to_float = _bitcast(to_float=False), _fp16_to_float32()

    @cuda.jit(device=True, inline=True)
    def bits(x):
        return to_bits(fp16_to_float(uint32(x) & _LOW16))
    return bits


@functools.lru_cache(maxsize=None)
def widen(kind: str):
    """``value(x) -> float32``: the ``kind`` half whose 16-bit pattern is
    ``x``, as a float32 (``x`` itself for ``kind`` ``""``)."""
    if not kind:
        return _identity()
    _check(kind)
    if simulator_enabled():
        return _simulated_widen(kind)
    if kind == "bf16":
        from_bits = _bitcast(to_float=True)

        @cuda.jit(device=True, inline=True)
        def value(x):
            return from_bits((uint32(x) & _LOW16) << _SIXTEEN)
        return value
    fp16_to_float = _fp16_to_float32()

    @cuda.jit(device=True, inline=True)
    def value(x):
        return fp16_to_float(uint32(x) & _LOW16)
    return value


@functools.lru_cache(maxsize=None)
def narrow(kind: str):
    """``bits(x) -> int16``: the 16-bit pattern of the float32 ``x`` rounded
    to the ``kind`` half, to nearest even (a NaN to a quiet NaN); ``x``
    itself for ``kind`` ``""``."""
    if not kind:
        return _identity()
    _check(kind)
    if simulator_enabled():
        return _simulated_narrow(kind)
    if kind == "bf16":
        float_as_int = cuda.libdevice.float_as_int

        # Integer rounding (no bf16 conversion instruction before sm_80):
        # add just under half an ulp of bf16, plus the kept lowest bit.
        @cuda.jit(device=True, inline=True)
        def bits(x):
            b = uint32(float_as_int(x))
            if (b & _ABS_MASK) > _INFINITY_BITS:
                return int16(_BF16_NAN)
            return int16((b + _BF16_HALFWAY + ((b >> _SIXTEEN) & uint32(1))) >> _SIXTEEN)
        return bits
    float_to_fp16 = _float32_to_fp16()

    @cuda.jit(device=True, inline=True)
    def bits(x):
        return float_to_fp16(x)
    return bits


def stores_pairs(half: bool, dim: int) -> bool:
    """Whether a kernel writing rows of ``dim`` half-precision entries
    stores them two at a time, as 32-bit words (the array then viewed as
    ``int32 [N, dim / 2]``): twice the bytes per store, where a 2-byte
    store per lane leaves a row-writing kernel well below the memory's
    bandwidth."""
    return half and dim % 2 == 0


@functools.lru_cache(maxsize=None)
def pair_word():
    """``word(lo, hi) -> int32``: two 16-bit patterns as one 32-bit word,
    ``lo`` in its low half (the first of two consecutive half elements)."""
    @cuda.jit(device=True, inline=True)
    def word(lo, hi):
        return int32((uint32(lo) & _LOW16) | (uint32(hi) << _SIXTEEN))
    return word


@functools.lru_cache(maxsize=None)
def or_into_pair_word():
    """``put(words, row, column, bits)``: the 16-bit pattern ``bits`` of half
    element ``column`` into its half of the zeroed 32-bit word ``words[row,
    column // 2]`` (the low half for an even column, as :func:`pair_word`),
    OR-ed atomically: another lane may set the other half at the same time."""
    one = uint32(1)

    @cuda.jit(device=True, inline=True)
    def put(words, row, column, bits):
        word = (uint32(bits) & _LOW16) << ((column & one) * _SIXTEEN)
        cuda.atomic.or_(words, (row, column >> one), word)
    return put


# ------------------------------------------------------------- intrinsics
@functools.lru_cache(maxsize=None)
def _bitcast(to_float: bool):
    """``cast(x)``: a uint32's bits as a float32 (``to_float``) or back."""
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    source, target = (types.uint32, types.float32) if to_float else (types.float32, types.uint32)
    llvm_target = ir.FloatType() if to_float else ir.IntType(32)

    @intrinsic
    def cast(typingctx, x):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], llvm_target)
        return target(source), codegen

    return stable_identity(cast, to_float)


@functools.lru_cache(maxsize=None)
def _fp16_to_float32():
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def fp16_to_float(typingctx, bits):
        def codegen(context, builder, sig, args):
            half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
            return builder.fpext(half, ir.FloatType())
        return types.float32(types.uint32), codegen

    return stable_identity(fp16_to_float)


@functools.lru_cache(maxsize=None)
def _float32_to_fp16():
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def float_to_fp16(typingctx, x):
        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.int16(types.float32), codegen

    return stable_identity(float_to_fp16)


# -------------------------------------------------------------- simulator
def half_bits(kind: str, x: float) -> int:
    """The 16-bit pattern (0 to 0xFFFF) of ``x`` rounded to the ``kind``
    half, to nearest even (the simulator's rounding)."""
    import numpy as np

    if kind == "fp16":
        with np.errstate(over="ignore"):  # overflow rounds to infinity, as intended
            return int(np.array(x, dtype=np.float16).view(np.uint16))
    bits = int(np.array(x, dtype=np.float32).view(np.uint32))
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FC0
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _simulated_narrow(kind: str):
    import numpy as np

    def bits(x):
        return np.array(half_bits(kind, x), dtype=np.uint16).view(np.int16)[()]
    return bits

def _simulated_float_bits(kind: str):
    import numpy as np

    widened = _simulated_widen(kind)

    def bits(x):
        return np.uint32(np.array(widened(x), dtype=np.float32).view(np.uint32))
    return bits


def _simulated_widen(kind: str):
    import numpy as np

    def value(x):
        b = np.array(np.uint32(int(x) & 0xFFFF), dtype=np.uint32)
        if kind == "bf16":
            return np.float32((b << np.uint32(16)).view(np.float32))
        return np.float32(b.astype(np.uint16).view(np.float16))
    return value

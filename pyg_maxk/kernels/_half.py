"""Half-precision storage read by the float32 kernels.

The kernels take float16 and bfloat16 arrays as their raw 16-bit patterns
(an ``int16`` view: the CUDA Array Interface has no bfloat16) and widen each
element to float32 in registers, so that half precision halves the bytes
they gather while every sum stays float32. ``kind`` names the format:

* ``"bf16"``: the upper half of a float32, so widening is a shift (exact);
* ``"fp16"``: IEEE binary16, widened by the hardware conversion
  (``cvt.f32.f16``; exact: every binary16 is a float32).

``float_bits(kind)(bits)`` gives the float32 bit pattern of the widened
value (what the select kernel orders), ``widen(kind)(bits)`` the float32;
``widen("")`` is the identity (float32 storage), so that a kernel reads
every storage type through one call.

Under Numba's simulator they are plain Python on numpy scalars.
"""
from __future__ import annotations

import functools

from ._cache import stable_identity
from ._numba import cuda_module, simulator_enabled

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import uint32  # noqa: E402 (after the numpy shim)

HALF_KINDS = ("bf16", "fp16")
_LOW16 = uint32(0xFFFF)
_SIXTEEN = uint32(16)


def _check(kind: str) -> None:
    if kind not in HALF_KINDS:
        raise ValueError(f"Unknown half-precision kind {kind!r}; one of {HALF_KINDS}")


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
        @cuda.jit(device=True, inline=True)
        def same(x):
            return x
        return same
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


# -------------------------------------------------------------- simulator
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

"""Vector memory instructions that Numba does not emit on its own.

``vector_load(w)(array, i)`` reads ``array[i:i + w]`` (w = 2 or 4) with one
load (``LDG.E.128`` for 4 float32) and ``vector_atomic_add(w)(array, i, ...)``
adds ``w`` float32 to ``array[i:i + w]`` with one vector reduction
(``REDG.E.ADD.F32x4``; sm_90 and later, scalar atomics before).
``packed_half_atomic_add(kind)(words, i, v0, ..., v7)`` rounds eight float32
to a half type and adds them to four words of packed half pairs with one
16-byte reduction (``red.global.add.noftz.v4.bf16x2`` / ``.f16x2``, sm_90
and later), each pair's sum rounded to the half type. All need ``i`` a
multiple of the access's element count in an array whose data is aligned to
the access (16 bytes for 4 float32); callers check it on the host.

Why: gathering CBSR rows with one 4-byte load per slot is limited by load
instructions, not bytes (``benchmarks/gather_ceiling.py``).

Under Numba's simulator they are plain Python over the elements (the packed
reduction a compare-and-swap loop that rounds as the hardware does).
"""
from __future__ import annotations

import functools

from ._cache import stable_identity
from ._half import half_bits
from ._numba import cuda_module, simulator_enabled

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()


@functools.lru_cache(maxsize=None)
def vector_load(width: int):
    """``load(array, i) -> (array[i], ..., array[i + width - 1])``, one load
    of ``width`` (2 or 4) elements."""
    if simulator_enabled():
        if width == 2:
            @cuda.jit(device=True)
            def load(array, i):
                return array[i], array[i + 1]
        else:
            @cuda.jit(device=True)
            def load(array, i):
                return array[i], array[i + 1], array[i + 2], array[i + 3]
        return load
    return _vector_load_intrinsic(width)


@functools.lru_cache(maxsize=None)
def vector_atomic_add(width: int, native: bool = True):
    """``add(array, i, a, b[, c, d])``: ``array[i + j] += (a, b, ...)[j]``
    atomically for ``width`` (2 or 4) float32; one vector reduction when
    ``native`` (the device must be sm_90 or later), else scalar ones."""
    if native and not simulator_enabled():
        return _vector_red_intrinsic(width)
    if width == 2:
        @cuda.jit(device=True)
        def add(array, i, a, b):
            cuda.atomic.add(array, i, a)
            cuda.atomic.add(array, i + 1, b)
    else:
        @cuda.jit(device=True)
        def add(array, i, a, b, c, d):
            cuda.atomic.add(array, i, a)
            cuda.atomic.add(array, i + 1, b)
            cuda.atomic.add(array, i + 2, c)
            cuda.atomic.add(array, i + 3, d)
    return add


#: Float32 values one packed half reduction adds (four words of two halves).
PACKED_HALF_SLOTS = 8


@functools.lru_cache(maxsize=None)
def packed_half_atomic_add(kind: str):
    """``add(words, w, v0, ..., v7)``: rounds the eight float32 ``v`` to the
    ``kind`` half (``"bf16"``/``"fp16"``, to nearest even) and adds them to
    the packed half pairs ``words[w:w + 4]`` (32-bit words, the even slot in
    the low half; ``w`` a multiple of 4) with one reduction, each pair's sum
    rounded to the half type. The device must be sm_90 or later."""
    if kind not in ("bf16", "fp16"):
        raise ValueError(f"Unknown half-precision kind {kind!r}")
    if simulator_enabled():
        return _simulated_packed_half_add(kind)
    return _packed_half_red_intrinsic(kind)


def _element_pointer(context, builder, array_type, array, index, index_type):
    from numba.core import cgutils, types

    ary = context.make_array(array_type)(context, builder, array)
    i = context.cast(builder, index, index_type, types.intp)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [i], wraparound=False)


def _vector_load_intrinsic(width: int):
    from llvmlite import ir
    from numba.core import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load(typingctx, array, index):
        signature = types.UniTuple(array.dtype, width)(array, index)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            element = context.get_data_type(sig.args[0].dtype)
            vector = ir.VectorType(element, width)
            vptr = builder.bitcast(ptr, vector.as_pointer(ptr.type.addrspace))
            loaded = builder.load(vptr, align=width * sig.args[0].dtype.bitwidth // 8)
            parts = [builder.extract_element(loaded, ir.Constant(ir.IntType(32), j))
                     for j in range(width)]
            return context.make_tuple(builder, sig.return_type, parts)

        return signature, codegen

    return stable_identity(load, width)


def _reduction_codegen(asm_text: str, floats: int):
    """Codegen of ``red(array, index, *floats)``: the inline PTX ``asm_text``
    with the element's address as ``$0`` and the float32 operands after it."""
    from llvmlite import ir

    constraints = "l," + ",".join("f" * floats) + ",~{memory}"

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        fn = ir.FunctionType(ir.VoidType(), [ptr.type] + [ir.FloatType()] * floats)
        builder.call(ir.InlineAsm(fn, asm_text, constraints, side_effect=True),
                     [ptr] + list(args[2:]))
        return context.get_dummy_value()

    return codegen


def _vector_red_intrinsic(width: int):
    from numba.core import types
    from numba.cuda.extending import intrinsic

    operands = ", ".join(f"${j + 1}" for j in range(width))
    codegen = _reduction_codegen(f"red.global.add.v{width}.f32 [$0], {{{operands}}};", width)
    f32 = types.float32
    if width == 2:
        @intrinsic
        def add(typingctx, array, index, a, b):
            return types.void(array, index, f32, f32), codegen
    else:
        @intrinsic
        def add(typingctx, array, index, a, b, c, d):
            return types.void(array, index, f32, f32, f32, f32), codegen
    return stable_identity(add, width)


def _packed_half_red_intrinsic(kind: str):
    from numba.core import types
    from numba.cuda.extending import intrinsic

    packed = "bf16x2" if kind == "bf16" else "f16x2"
    # cvt.rn.<packed>.f32 d, a, b puts a in the upper half: the odd slot.
    cvts = " ".join(f"cvt.rn.{packed}.f32 p{j}, ${2 * j + 2}, ${2 * j + 1};" for j in range(4))
    codegen = _reduction_codegen(f"{{ .reg .b32 p0, p1, p2, p3; {cvts} "
                                 f"red.global.add.noftz.v4.{packed} [$0], {{p0, p1, p2, p3}}; }}",
                                 PACKED_HALF_SLOTS)

    @intrinsic
    def add(typingctx, words, w, v0, v1, v2, v3, v4, v5, v6, v7):
        return types.void(words, w, *([types.float32] * PACKED_HALF_SLOTS)), codegen

    return stable_identity(add, kind)


def _simulated_packed_half_add(kind: str):
    import numpy as np

    def to_half_bits(x):
        return half_bits(kind, x)

    def from_half_bits(b):
        if kind == "fp16":
            return float(np.array(b, dtype=np.uint16).view(np.float16))
        return float(np.array(b << 16, dtype=np.uint32).view(np.float32))

    def add_pair(old, low, high):
        # The exact sum of two halves, then one rounding: as the hardware.
        old = int(old) & 0xFFFFFFFF
        low_sum = from_half_bits(old & 0xFFFF) + from_half_bits(to_half_bits(low))
        high_sum = from_half_bits(old >> 16) + from_half_bits(to_half_bits(high))
        new = to_half_bits(low_sum) | (to_half_bits(high_sum) << 16)
        return np.array(new, dtype=np.uint32).view(np.int32)[()]

    @cuda.jit(device=True)
    def add(words, w, v0, v1, v2, v3, v4, v5, v6, v7):
        values = (v0, v1, v2, v3, v4, v5, v6, v7)
        for j in range(4):
            while True:
                old = words[w + j]
                if cuda.atomic.cas(words, w + j, old, add_pair(old, values[2 * j],
                                                                 values[2 * j + 1])) == old:
                    break
    return add

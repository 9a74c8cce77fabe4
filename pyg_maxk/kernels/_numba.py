"""Importing Numba's CUDA target, and whether it can run here.

numpy 2.5 removed ``numpy.row_stack`` (deprecated alias of ``numpy.vstack``
since numpy 2.0), but numba-cuda 0.30.4 registers an overload for it while it
compiles the first kernel, so every kernel fails to compile with
``module 'numpy' has no attribute 'row_stack'``. :func:`patch_numpy` puts the
alias back before Numba is imported; it is a no-op on a numpy that has it.
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Optional


def patch_numpy() -> bool:
    """Restore ``numpy.row_stack`` if this numpy lacks it. Returns whether it
    patched."""
    import numpy as np

    if "row_stack" in np.__dict__:
        return False
    np.row_stack = np.vstack  # the alias numpy < 2.5 had
    return True


def cuda_module() -> ModuleType:
    """``numba.cuda``, imported with the numpy shim in place. Numba reads its
    environment (``NUMBA_ENABLE_CUDASIM`` among it) when it is first
    imported, and ``numba.cuda`` picks the simulator or the GPU when *it* is:
    the environment is re-read first, so that a process that set the
    variable after importing numba (but before any kernel) gets what it set."""
    patch_numpy()
    if "numba.cuda" not in sys.modules:
        from numba.core import config
        config.reload_config()
    from numba import cuda

    return cuda


@dataclass(frozen=True)
class NumbaStatus:
    importable: bool
    simulator: bool
    cuda_available: bool
    reason: str


@functools.lru_cache(maxsize=None)
def numba_status() -> NumbaStatus:
    """What the ``"numba"`` backend can do in this process (cached)."""
    try:
        cuda = cuda_module()
        from numba import config
    except Exception as err:  # pragma: no cover - numba missing or broken
        return NumbaStatus(False, False, False, f"numba.cuda cannot be imported ({err})")
    simulator = bool(config.ENABLE_CUDASIM)
    if simulator:
        return NumbaStatus(True, True, False, "Numba's CUDA simulator is enabled "
                           "(NUMBA_ENABLE_CUDASIM=1): kernels run on CPU tensors")
    try:
        available = bool(cuda.is_available())
    except Exception as err:  # pragma: no cover
        return NumbaStatus(True, False, False, f"numba.cuda.is_available() failed ({err})")
    if not available:
        return NumbaStatus(True, False, False, "Numba finds no usable CUDA driver/GPU")
    return NumbaStatus(True, False, True, "ok")


def kernel_jit(**options):
    """``cuda.jit(**options)`` as a kernel decorator, with the package's
    on-disk cache of compiled kernels (:mod:`._cache`); plain ``cuda.jit``
    under Numba's simulator, which takes no code-generation options (such as
    ``max_registers``) and compiles nothing."""
    cuda = cuda_module()
    if simulator_enabled():
        return cuda.jit

    def compile_cached(py_func):
        from ._cache import attach_cache
        return attach_cache(cuda.jit(**options)(py_func))

    return compile_cached


_SIMULATOR: Optional[bool] = None


def simulator_enabled() -> bool:
    """Whether the kernels run in Numba's simulator: fixed once ``numba.cuda``
    is imported (asked per op, so the answer is kept from then on)."""
    global _SIMULATOR
    if _SIMULATOR is not None:
        return _SIMULATOR
    answer = (os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
              or numba_status().simulator)
    if "numba.cuda" in sys.modules:
        _SIMULATOR = answer
    return answer

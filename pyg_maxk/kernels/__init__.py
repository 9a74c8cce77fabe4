"""Numba CUDA kernels of pyg-maxk. They see plain device arrays and launch
parameters only; :mod:`pyg_maxk.ops.numba_ops` wraps them as torch ops.

* :mod:`.maxk_select`: top-k per row into CBSR, and CBSR back to dense rows.
* :mod:`.spgemm`: forward CSR x CBSR product and backward SSpMM.
* :mod:`.linear`: CBSR x dense weight (SAGE's root term) without densifying.
* :mod:`.build`: a new graph's CSR and work schedule on the GPU.

Every kernel is compiled once per specialisation (``dim``, ``k``, ...) and
cached. Importing this package does not import Numba; :func:`cuda_module`
does, with the numpy shim of :mod:`._numba` in place.
"""
from ._numba import NumbaStatus, cuda_module, numba_status, patch_numpy, simulator_enabled

__all__ = ["NumbaStatus", "cuda_module", "numba_status", "patch_numpy", "simulator_enabled"]

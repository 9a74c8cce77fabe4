"""The one place that decides how sparse aggregations and MaxK selection run.

Backends:

* ``"torch"``: pure PyTorch (CPU and CUDA). It is the semantics oracle: MaxK is
  :func:`torch.topk`, the aggregation a ``torch.sparse`` CSR product.
* ``"numba"``: the Numba CUDA kernels of :mod:`pyg_maxk.kernels`. It needs CUDA
  tensors, or CPU tensors under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``).
* ``"cpu"``: Numba's parallel CPU kernels for the selection and the
  aggregation (:mod:`pyg_maxk.kernels.cpu`; float32/float64 CPU tensors).
* ``"auto"`` (default): ``"numba"`` for float32/float16/bfloat16 CUDA tensors
  when the kernels can run, ``"cpu"`` for float32/float64 CPU tensors when
  Numba imports, ``"torch"`` otherwise.

Select one with :func:`use_backend` (a context manager, also usable as a plain
call) or the ``PYG_MAXK_BACKEND`` environment variable.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

BACKENDS = ("auto", "torch", "numba", "cpu")
ENV_VAR = "PYG_MAXK_BACKEND"

#: Feature types the Numba kernels take (they accumulate in float32).
NUMBA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Feature types the CPU kernels take (they compute in that type).
CPU_DTYPES = (torch.float32, torch.float64)

_override: Optional[str] = None


def _check(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise ValueError(f"Unknown pyg_maxk backend {name!r}; choose one of "
                         f"{', '.join(repr(b) for b in BACKENDS)}")
    return name.lower()


def get_backend() -> str:
    """The backend asked for: the innermost :func:`use_backend`, else
    ``$PYG_MAXK_BACKEND``, else ``"auto"``."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            return _check(env)
        except ValueError as err:
            raise ValueError(f"${ENV_VAR}: {err}") from None
    return "auto"


class use_backend(contextlib.ContextDecorator):
    """Run the enclosed code with the given backend.

    .. code-block:: python

        with pyg_maxk.use_backend("torch"):
            out = model(x, edge_index)
    """

    def __init__(self, name: str) -> None:
        self.name = _check(name)
        self._previous: list[Optional[str]] = []

    def __enter__(self) -> "use_backend":
        global _override
        self._previous.append(_override)
        _override = self.name
        return self

    def __exit__(self, *exc) -> None:
        global _override
        _override = self._previous.pop()


def resolve_backend(tensor: torch.Tensor) -> str:
    """The concrete backend (``"torch"``, ``"numba"`` or ``"cpu"``) for data
    on ``tensor``'s device, raising when a forced backend cannot run there."""
    name = get_backend()
    if name == "torch":
        return "torch"
    if name == "cpu":
        if tensor.is_cuda or tensor.dtype not in CPU_DTYPES:
            raise TypeError(f"pyg_maxk backend 'cpu' takes float32/float64 CPU tensors, got "
                            f"{tensor.dtype} on {tensor.device}")
        return "cpu"
    from .kernels import numba_status  # lazy: importing Numba is slow

    status = numba_status()
    if name == "auto":
        if tensor.is_cuda:
            usable = status.cuda_available and tensor.dtype in NUMBA_DTYPES
            return "numba" if usable else "torch"
        return "cpu" if status.importable and tensor.dtype in CPU_DTYPES else "torch"
    # Forced "numba".
    if tensor.dtype not in NUMBA_DTYPES:
        raise TypeError(
            f"pyg_maxk backend 'numba' computes in float32 and takes float32, "
            f"float16 or bfloat16 features, got {tensor.dtype}. Use the 'torch' "
            f"backend for {tensor.dtype}.")
    if tensor.is_cuda:
        if not status.cuda_available:
            raise RuntimeError(
                f"pyg_maxk backend 'numba' cannot run on {tensor.device}: "
                f"{status.reason}. Use the 'torch' backend instead.")
        return "numba"
    if status.simulator:
        return "numba"
    raise RuntimeError(
        f"pyg_maxk backend 'numba' needs CUDA tensors, got tensors on "
        f"{tensor.device}. Move the model and data to a GPU, use the 'torch' "
        f"backend on the CPU, or set NUMBA_ENABLE_CUDASIM=1 (before the first "
        f"import of numba) to run the kernels in Numba's simulator.")



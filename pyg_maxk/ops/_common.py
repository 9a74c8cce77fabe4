"""Small helpers the backends' implementations share."""
from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch
from torch import Tensor

#: The tensor types that the eager paths take as they are, checked with
#: ``type(t) in PLAIN_TENSORS``: unlike ``isinstance``, that leaves out
#: tensor subclasses (traced or wrapper tensors), which need the dispatcher.
PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def aggregation_dtype(values_dtype: torch.dtype, weight_dtype: Optional[torch.dtype],
                      row_scale_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The type of ``A @ h`` for features of ``values_dtype``, as PyG's convs
    give it: promoted with the edge values' type where they weight the sum
    (GCN's float32 normalisation times bf16 features under autocast is
    float32), the features' own type for an unweighted sum or a mean (a
    per-row scale, as PyG's mean of the messages)."""
    if weight_dtype is None or row_scale_dtype is not None:
        return values_dtype
    return torch.promote_types(values_dtype, weight_dtype)


def spgemm_dtype(values: Tensor, g) -> torch.dtype:
    """:func:`aggregation_dtype` of CBSR ``values`` on the graph operands ``g``."""
    return aggregation_dtype(values.dtype, dtype_of(g.weight), dtype_of(g.row_scale))


def dtype_of(t: Optional[Tensor]) -> Optional[torch.dtype]:
    """``t``'s type, None for no tensor."""
    return None if t is None else t.dtype


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, skipped when ``t`` has that type already: even a
    no-op ``to`` costs host time, and small graphs are host-bound."""
    return t if t.dtype == dtype else t.to(dtype)


def autocast_disabled(device_type: str) -> ContextManager:
    """``torch.autocast(device_type, enabled=False)`` where autocast is on, a
    no-op context elsewhere: entering an autocast context costs host time on
    every call, and small graphs are host-bound."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()

"""Small helpers the backends' implementations share."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def aggregation_dtype(values_dtype: torch.dtype, weight: Optional[Tensor],
                      row_scale: Optional[Tensor]) -> torch.dtype:
    """The type of ``A @ h`` for features of ``values_dtype``, as PyG's convs
    give it: promoted with the edge values' type where they weight the sum
    (GCN's float32 normalisation times bf16 features under autocast is
    float32), the features' own type for an unweighted sum or a mean (a
    per-row scale, as PyG's mean of the messages)."""
    if weight is None or row_scale is not None:
        return values_dtype
    return torch.promote_types(values_dtype, weight.dtype)


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, skipped when ``t`` has that type already: even a
    no-op ``to`` costs 1-2 us of host time, and small graphs are host-bound."""
    return t if t.dtype == dtype else t.to(dtype)

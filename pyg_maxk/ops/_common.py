"""Small helpers the backends' implementations share."""
from __future__ import annotations

import torch
from torch import Tensor


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, skipped when ``t`` has that type already: even a
    no-op ``to`` costs 1-2 us of host time, and small graphs are host-bound."""
    return t if t.dtype == dtype else t.to(dtype)

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from ..cbsr import CBSR
from ..ops import check_k, maxk, to_dense


class MaxK(torch.nn.Module):
    r"""The MaxK nonlinearity: keep the ``k`` largest entries of every row and
    zero the rest (a drop-in replacement for :class:`torch.nn.ReLU`).

    .. math::
        \mathrm{MaxK}_k(\mathbf{x})_{ij} = x_{ij} \text{ if } x_{ij} \text{ is
        among the } k \text{ largest of row } i \text{, else } 0

    Args:
        k (int): entries kept per row; ``k >= channels`` is the identity.
        dropout (float): dropout on the kept values, in training mode.
        sparse_output (bool): return a :class:`~pyg_maxk.CBSR` (which the
            MaxK convs take directly) instead of a dense tensor.

    Shapes:
        - **input:** :math:`(N, F)`
        - **output:** :math:`(N, F)`, or a CBSR with ``[N, min(k, F)]`` values
    """

    def __init__(self, k: int, dropout: float = 0.0, sparse_output: bool = False) -> None:
        super().__init__()
        self.k = check_k(k)
        self.dropout = float(dropout)
        self.sparse_output = sparse_output

    def forward(self, x: Tensor) -> Union[Tensor, CBSR]:
        out = maxk(x, self.k, dropout=self.dropout, training=self.training)
        return out if self.sparse_output else to_dense(out)

    def extra_repr(self) -> str:
        extra = f"k={self.k}"
        if self.dropout:
            extra += f", dropout={self.dropout}"
        if self.sparse_output:
            extra += ", sparse_output=True"
        return extra

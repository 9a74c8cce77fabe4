"""CBSR: the compressed balanced sparse row format of MaxK outputs.

After MaxK every row of a feature matrix holds exactly ``k`` non-zeros, so the
row pointer of CSR is implicit (row ``i`` starts at ``i * k``) and only two
dense ``[N, k]`` arrays remain: the kept values and their column indices.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .dispatch import get_backend


def index_dtype_for(dim: int) -> torch.dtype:
    """The narrowest integer type that holds a column index below ``dim``."""
    if dim <= 256:
        return torch.uint8
    if dim <= 2**15:
        return torch.int16
    return torch.int32


class CBSR:
    r"""A row-balanced sparse matrix of shape ``[N, dim]`` with ``k`` entries
    per row.

    Args:
        values (torch.Tensor): the kept values, shape ``[N, k]``; it carries the
            autograd history (gradients flow only to these entries).
        indices (torch.Tensor): their column indices, shape ``[N, k]``, of type
            :func:`index_dtype_for` ``(dim)`` (``uint8`` while ``dim <= 256``).
        dim (int): the number of columns of the dense matrix.

    No operation relies on the order of a row's entries (:func:`~pyg_maxk.maxk`
    writes them in column order on the ``"numba"`` backend's CPU kernel, by
    column mod 32 then column on its GPU kernel, by decreasing value on the
    others).
    """

    __slots__ = ("values", "indices", "dim")

    def __init__(self, values: Tensor, indices: Tensor, dim: int) -> None:
        if values.dim() != 2 or values.shape != indices.shape:
            raise ValueError(
                f"CBSR expects values and indices of the same shape [N, k], got "
                f"{tuple(values.shape)} and {tuple(indices.shape)}")
        if indices.dtype.is_floating_point or indices.dtype == torch.bool:
            raise TypeError(f"CBSR indices must be integers, got {indices.dtype}")
        if values.device != indices.device:
            raise ValueError("CBSR values and indices are on different devices "
                             f"({values.device} and {indices.device})")
        if values.size(1) > dim:
            raise ValueError(f"CBSR has k={values.size(1)} entries per row but "
                             f"only dim={dim} columns")
        self.values = values
        self.indices = indices
        self.dim = int(dim)

    @property
    def k(self) -> int:
        return self.values.size(1)

    @property
    def num_rows(self) -> int:
        return self.values.size(0)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_rows, self.dim))

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def is_full(self) -> bool:
        """True when every column is kept (``k == dim``): the matrix is dense."""
        return self.k == self.dim

    def long_indices(self) -> Tensor:
        """The indices as ``int64``, the type :func:`torch.gather` and
        :func:`torch.scatter` index with."""
        return self.indices.long()

    def to_dense(self) -> Tensor:
        """The dense ``[N, dim]`` matrix, differentiable w.r.t. ``values``:
        :func:`pyg_maxk.ops.to_dense`, reached through its registered custom
        op (``torch.ops.pyg_maxk``) so that the format imports nothing of the
        op layer (the layers call :func:`pyg_maxk.ops.to_dense` itself, which
        skips the dispatcher in eager mode)."""
        if self.is_full:  # a plain scatter, differentiable by torch itself
            return self.values.new_zeros(self.num_rows, self.dim).scatter(
                1, self.long_indices(), self.values)
        return torch.ops.pyg_maxk.cbsr_to_dense(self.values, self.indices, self.dim,
                                                get_backend())

    def add_to(self, dense: Tensor, alpha: Optional[Tensor | float] = None,
               inplace: bool = False) -> Tensor:
        """``dense + alpha * self`` without materialising ``self`` densely;
        ``inplace=True`` adds into ``dense`` (saving a copy of it), which
        autograd allows when nothing saved ``dense`` for its backward."""
        values = self.values if alpha is None else alpha * self.values
        add = dense.scatter_add_ if inplace else dense.scatter_add
        return add(1, self.long_indices(), values.to(dense.dtype))

    def with_values(self, values: Tensor) -> "CBSR":
        """The same sparsity pattern with other values (e.g. after dropout)."""
        return CBSR(values, self.indices, self.dim)

    def __repr__(self) -> str:
        return (f"CBSR(num_rows={self.num_rows}, dim={self.dim}, k={self.k}, "
                f"dtype={self.dtype}, index_dtype={self.indices.dtype}, "
                f"device={self.device})")

"""The adjacency forms PyG's convs accept, told apart without importing
torch_sparse, and the checks every build makes on them."""
from __future__ import annotations

import warnings
from typing import Any, Tuple

import torch
from torch import Tensor

#: The aggregations' normalisations: PyG's sum (GIN), mean (SAGE) and
#: symmetric GCN normalisation.
NORMALIZATIONS = ("sum", "mean", "gcn")


def check_normalization(normalization: str) -> None:
    """A ValueError naming the choices unless ``normalization`` is one."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"Unknown normalization {normalization!r}; "
                         f"choose one of {NORMALIZATIONS}")


def is_sparse_tensor(adj: Any) -> bool:
    """True for a :class:`torch_sparse.SparseTensor` (without importing it)."""
    return type(adj).__name__ == "SparseTensor" and hasattr(adj, "storage")


def is_torch_sparse(adj: Any) -> bool:
    """True for a ``torch.sparse`` COO, CSR or CSC tensor."""
    return isinstance(adj, Tensor) and adj.layout in (
        torch.sparse_coo, torch.sparse_csr, torch.sparse_csc)


def is_edge_index_type(adj: Any) -> bool:
    """True for a :class:`torch_geometric.EdgeIndex`."""
    global _EDGE_INDEX
    if _EDGE_INDEX is None:  # asked on every layer call: the import looked up once
        try:
            from torch_geometric import EdgeIndex as _EDGE_INDEX
        except ImportError:  # pragma: no cover - very old PyG
            _EDGE_INDEX = ()
    return isinstance(adj, _EDGE_INDEX)


_EDGE_INDEX: Any = None


def as_sparse_csr(adj: Tensor) -> Tensor:
    """A ``torch.sparse`` COO/CSC/CSR adjacency as CSR. The conversion is the
    package's own, so torch's "sparse CSR support is in beta" warning would
    tell the user nothing."""
    if adj.layout == torch.sparse_csr:
        return adj
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return adj.to_sparse_csr()


def plain(t: Tensor) -> Tensor:
    """``t`` as a plain tensor (strips :class:`EdgeIndex`)."""
    return t.as_tensor() if is_edge_index_type(t) else t


def check_same_device(adj: Any, edge_weight: Tensor) -> None:
    """A clear error where ``edge_weight`` is not on the adjacency's device."""
    device = adj.device() if callable(getattr(adj, "device", None)) else adj.device
    if edge_weight.device != device:
        raise ValueError(f"edge_weight is on {edge_weight.device} but the adjacency on "
                         f"{device}; move both to one device")


def check_edge_index(edge_index: Tensor) -> None:
    """PyG's errors for an ``edge_index`` of another type or shape than
    integer ``[2, E]``."""
    if edge_index.dtype.is_floating_point or edge_index.dtype in (torch.bool, torch.complex64):
        raise ValueError(f"Expected 'edge_index' to be of integer type "
                         f"(got '{edge_index.dtype}')")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"Expected 'edge_index' of shape [2, num_edges] "
                         f"(got {list(edge_index.shape)})")


def sparse_size(adj: Any) -> Tuple[int, int]:
    """``(num_src, num_dst)`` of an ``adj_t``."""
    return int(adj.size(1)), int(adj.size(0))

"""pyg-maxk: MaxK-GNN training for PyTorch Geometric.

MaxK keeps the ``k`` largest features of every node; the result is stored as
CBSR and aggregated by a sparse-sparse product (Numba CUDA kernels on GPUs).
"""
from .cbsr import CBSR, index_dtype_for
from .dispatch import (
                       BackendError,
                       allow_half_reductions,
                       get_backend,
                       half_reductions_allowed,
                       use_backend,
)
from .graph import CSRGraph, clear_graph_cache
from .ops import aggregate, maxk
from .transforms import ToCSRGraph

__version__ = "0.1.0"

__all__ = [
    "BackendError", "CBSR", "CSRGraph", "aggregate", "allow_half_reductions",
    "clear_graph_cache", "get_backend", "half_reductions_allowed",
    "ToCSRGraph", "index_dtype_for", "maxk", "use_backend", "__version__",
]

"""MaxK layers and models for PyTorch Geometric.

``from pyg_maxk.nn import SAGEConv, GCNConv, GINConv`` swaps the MaxK convs
into code written for PyG's stock ones (``k`` defaults to 32).
"""
from .conv_base import MaxKConv
from .gcn_conv import MaxKGCNConv
from .gin_conv import MaxKGINConv
from .maxk import MaxK
from .models import MaxKBasicGNN, MaxKGCN, MaxKGIN, MaxKGraphSAGE
from .sage_conv import MaxKSAGEConv

# One-import swap aliases.
SAGEConv = MaxKSAGEConv
GCNConv = MaxKGCNConv
GINConv = MaxKGINConv

__all__ = [
    "MaxK", "MaxKConv", "MaxKSAGEConv", "MaxKGCNConv", "MaxKGINConv",
    "MaxKBasicGNN", "MaxKGraphSAGE", "MaxKGCN", "MaxKGIN",
    "SAGEConv", "GCNConv", "GINConv",
]

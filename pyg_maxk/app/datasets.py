"""Synthetic graphs generated in the package: no files, no network.

:func:`power_law_edge_index` gives graphs with the degree shape of the large
benchmark graphs (lognormal in-degrees with a heavy tail); :func:`synthetic_node_dataset`
adds class-correlated features, homophilous edges (a planted partition) and
label noise, so that accuracy means something and stays below 1 however many
neighbours a node averages. Presets mirror the sizes of real datasets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Preset:
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    max_degree: Optional[int] = None


#: Shapes of the real graphs (directed edge counts).
PRESETS: Dict[str, Preset] = {
    "cora-like": Preset(2_708, 10_556, 1_433, 7),
    "arxiv-like": Preset(169_343, 1_166_243, 128, 40, max_degree=13_161),
    "reddit-like": Preset(232_965, 114_615_892, 602, 41, max_degree=60_000),
    "products-like": Preset(2_449_029, 123_718_280, 100, 47, max_degree=20_000),
    "small": Preset(5_000, 100_000, 64, 8, max_degree=2_000),
}


def lognormal_degrees(num_nodes: int, num_edges: int, *, sigma: float = 1.5,
                      max_degree: Optional[int] = None,
                      generator: Optional[torch.Generator] = None) -> Tensor:
    """``[num_nodes]`` in-degrees summing to ``num_edges``, lognormal-shaped;
    node 0 gets ``max_degree`` (when given) so the tail is always present."""
    normal = torch.randn(num_nodes, generator=generator, dtype=torch.float64)
    weights = torch.exp(sigma * normal)
    if max_degree is not None:
        weights[0] = 0.0
        rest = num_edges - max_degree
    else:
        rest = num_edges
    deg = torch.floor(weights / weights.sum() * rest).long()
    if max_degree is not None:
        deg = deg.clamp(max=max_degree)
        deg[0] = max_degree
    short = num_edges - int(deg.sum())
    if short > 0:  # spread the rounding remainder over random nodes
        extra = torch.randint(1, num_nodes, (short,), generator=generator) if num_nodes > 1 \
            else torch.zeros(short, dtype=torch.long)
        deg += torch.bincount(extra, minlength=num_nodes)
    return deg


def power_law_edge_index(num_nodes: int, num_edges: int, *, max_degree: Optional[int] = None,
                         seed: int = 0, device: torch.device | str = "cpu") -> Tensor:
    """``[2, num_edges]`` edges (source, target) with lognormal in-degrees;
    sources are drawn in proportion to the same degrees (as in a symmetric
    graph, hubs are also popular sources). Sorted by target."""
    gen = torch.Generator().manual_seed(seed)
    deg = lognormal_degrees(num_nodes, num_edges, max_degree=max_degree, generator=gen)
    device = torch.device(device)
    dst = torch.repeat_interleave(torch.arange(num_nodes, device=device), deg.to(device))
    probs = (deg.double() + 1.0).to(device)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    src = torch.multinomial(probs, num_edges, replacement=True, generator=dev_gen)
    return torch.stack([src, dst])


def synthetic_node_dataset(num_nodes: int, num_edges: int, num_features: int, num_classes: int,
                           *, homophily: float = 0.8, noise: float = 3.0,
                           label_noise: float = 0.2,
                           max_degree: Optional[int] = None, seed: int = 0,
                           train_ratio: float = 0.6, val_ratio: float = 0.2):
    """A planted-partition node classification graph as a PyG ``Data``.

    Every node has a class, uniform over ``num_classes``; its features are the
    class centroid plus Gaussian ``noise`` (so one node alone is hard to
    classify); each edge's source shares the target's class with probability
    ``homophily``, else it is any node (so aggregation helps, the more the
    more neighbours a node has). In-degrees are lognormal (power law-like).

    The label ``y`` is the class, except for a ``label_noise`` fraction of
    the nodes (in every split), whose label is another class drawn
    uniformly: no model can recover those, so test accuracy stays below
    ``1 - label_noise``. Without it, high-degree graphs are trivial (a mean
    over hundreds of neighbours recovers every class: ``reddit-like``
    reached 0.9996 test accuracy), and the stock and MaxK models could not
    differ.
    """
    from torch_geometric.data import Data

    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, num_classes, (num_nodes,), generator=gen)
    centroids = torch.randn(num_classes, num_features, generator=gen)
    x = centroids[y] + noise * torch.randn(num_nodes, num_features, generator=gen)

    deg = lognormal_degrees(num_nodes, num_edges, max_degree=max_degree, generator=gen)
    dst = torch.repeat_interleave(torch.arange(num_nodes), deg)
    # Same-class sources: a random member of the target's class.
    order = torch.argsort(y)
    counts = torch.bincount(y, minlength=num_classes)
    starts = torch.cumsum(counts, 0) - counts
    cls = y[dst]
    pick = (torch.rand(dst.numel(), generator=gen) * counts[cls].clamp(min=1)).long()
    same = order[(starts[cls] + pick).clamp(max=num_nodes - 1)]
    other = torch.randint(0, num_nodes, (dst.numel(),), generator=gen)
    src = torch.where(torch.rand(dst.numel(), generator=gen) < homophily, same, other)
    edge_index = torch.stack([src, dst])

    perm = torch.randperm(num_nodes, generator=gen)
    n_train = int(math.floor(train_ratio * num_nodes))
    n_val = int(math.floor(val_ratio * num_nodes))
    masks = [torch.zeros(num_nodes, dtype=torch.bool) for _ in range(3)]
    masks[0][perm[:n_train]] = True
    masks[1][perm[n_train:n_train + n_val]] = True
    masks[2][perm[n_train + n_val:]] = True
    # Drawn last, so that features, edges and splits do not depend on it.
    flip = torch.rand(num_nodes, generator=gen) < label_noise
    shift = torch.randint(1, max(2, num_classes), (num_nodes,), generator=gen)
    y = torch.where(flip, (y + shift) % num_classes, y)
    return Data(x=x, edge_index=edge_index, y=y, train_mask=masks[0], val_mask=masks[1],
                test_mask=masks[2], num_classes=num_classes)


def preset_dataset(name: str, *, scale: float = 1.0, seed: int = 0, **kwargs):
    """:func:`synthetic_node_dataset` with the shape of a :data:`PRESETS`
    entry, nodes and edges multiplied by ``scale``."""
    if name not in PRESETS:
        raise ValueError(f"Unknown synthetic preset {name!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[name]
    num_nodes = max(16, int(p.num_nodes * scale))
    num_edges = max(num_nodes, int(p.num_edges * scale))
    max_degree = None if p.max_degree is None else max(1, min(int(p.max_degree * scale) or 1,
                                                              num_edges // 4))
    return synthetic_node_dataset(num_nodes, num_edges, p.num_features, p.num_classes,
                                  max_degree=max_degree, seed=seed, **kwargs)


# ------------------------------------------------------------- real datasets
@dataclass
class NodeTask:
    """A node-classification task: the graph, its splits and how it is scored.

    ``data`` holds ``x [N, F]``, ``edge_index [2, E]``, ``y`` (``[N]`` class
    ids, or ``[N, C]`` 0/1 targets when ``multilabel``) and boolean
    ``train_mask``/``val_mask``/``test_mask``. ``metric`` is ``"accuracy"``,
    ``"rocauc"`` (ogbn-proteins, scored by ogb's ``Evaluator``) or
    ``"f1_micro"`` (Yelp).
    """
    name: str
    data: object
    num_classes: int
    multilabel: bool = False
    metric: str = "accuracy"
    ogb_name: Optional[str] = None


PLANETOID = ("Cora", "CiteSeer", "PubMed")
PYG_DATASETS = ("Reddit", "Flickr", "Yelp")
OGB_DATASETS = ("ogbn-arxiv", "ogbn-products", "ogbn-proteins")


def dataset_names() -> list:
    """Every name :func:`load_dataset` accepts."""
    return sorted(PRESETS) + list(PLANETOID) + list(PYG_DATASETS) + list(OGB_DATASETS)


class DatasetUnavailable(RuntimeError):
    """A dataset that is neither on disk nor downloadable here."""


def _unavailable(name: str, where: str, err: Exception) -> DatasetUnavailable:
    return DatasetUnavailable(
        f"Could not load {name}: its files are not under {where} and downloading them "
        f"failed ({type(err).__name__}: {err}). Without network, put the dataset's raw "
        f"files in {where} (as PyG/ogb lay them out) and pass that folder's parent as "
        f"--root, or use a synthetic preset (--dataset {'/'.join(sorted(PRESETS))}).")


def load_dataset(name: str, root: str = "data", *, scale: float = 1.0, seed: int = 0) -> NodeTask:
    """Load ``name`` as a :class:`NodeTask`.

    Synthetic presets are generated in memory (``scale`` multiplies their size;
    ``seed`` fixes them). Planetoid datasets are read from ``root/<name>``,
    Reddit/Flickr/Yelp from ``root/<name>`` and ogbn-* from ``root`` (ogb's
    layout); PyG/ogb download them there when the files are missing and the
    network allows, otherwise :class:`DatasetUnavailable` says where to put them.
    """
    import os

    if name in PRESETS:
        data = preset_dataset(name, scale=scale, seed=seed)
        return NodeTask(name, data, PRESETS[name].num_classes)
    if name in PLANETOID:
        from torch_geometric.datasets import Planetoid
        where = os.path.join(root, name)
        try:
            data = Planetoid(root, name)[0]
        except (OSError, ValueError) as err:  # URLError is an OSError
            raise _unavailable(name, os.path.join(where, "raw"), err) from err
        return NodeTask(name, data, int(data.y.max()) + 1)
    if name in PYG_DATASETS:
        import torch_geometric.datasets as pyg_datasets
        where = os.path.join(root, name)
        try:
            data = getattr(pyg_datasets, name)(where)[0]
        except (OSError, ValueError) as err:
            raise _unavailable(name, os.path.join(where, "raw"), err) from err
        if name == "Yelp":  # 100 binary labels per node
            return NodeTask(name, data, data.y.size(1), multilabel=True, metric="f1_micro")
        return NodeTask(name, data, int(data.y.max()) + 1)
    if name in OGB_DATASETS:
        return _load_ogb(name, root)
    raise ValueError(f"Unknown dataset {name!r}; choose one of {dataset_names()}")


def _load_ogb(name: str, root: str) -> NodeTask:
    import os

    from ogb.nodeproppred import PygNodePropPredDataset

    where = os.path.join(root, name.replace("-", "_"))
    try:
        dataset = PygNodePropPredDataset(name, root=root)
    except (OSError, ValueError) as err:
        raise _unavailable(name, os.path.join(where, "raw"), err) from err
    data = dataset[0]
    split = dataset.get_idx_split()
    for key, mask_name in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
        mask = torch.zeros(data.num_nodes, dtype=torch.bool)
        mask[split[key]] = True
        data[mask_name] = mask
    if name == "ogbn-proteins":
        # No node features: use the mean of each node's incoming edge features.
        from torch_geometric.utils import scatter
        data.x = scatter(data.edge_attr, data.edge_index[1], dim=0,
                         dim_size=data.num_nodes, reduce="mean")
        data.edge_attr = None
        return NodeTask(name, data, data.y.size(1), multilabel=True, metric="rocauc",
                        ogb_name=name)
    data.y = data.y.view(-1)
    return NodeTask(name, data, int(data.y.max()) + 1, ogb_name=name)

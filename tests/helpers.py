"""Shared test helpers: random graphs in every adjacency form, and the
stock-vs-MaxK comparison the layer contract is written in."""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

import pyg_maxk

FORMS = ("edge_index", "EdgeIndex", "SparseTensor", "coo", "csr", "csc")


def random_edge_index(num_src: int, num_dst: int, num_edges: int, *, seed: int = 0,
                      self_loops: bool = True, multi_edges: bool = True,
                      isolated: int = 2, device="cpu") -> Tensor:
    """Random edges; the last ``isolated`` target nodes receive none."""
    g = torch.Generator().manual_seed(seed)
    hi_dst = max(1, num_dst - isolated)
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    dst = torch.randint(0, hi_dst, (num_edges,), generator=g)
    if self_loops and num_edges >= 4 and num_src == num_dst:
        src[:3] = dst[:3]
    if multi_edges and num_edges >= 6:
        src[-2:] = src[3]
        dst[-2:] = dst[3]
    return torch.stack([src, dst]).to(device)


def adjacency(form: str, edge_index: Tensor, size: Tuple[int, int],
              value: Optional[Tensor] = None):
    """``edge_index`` (source row 0, target row 1) in one of :data:`FORMS`;
    sparse forms are ``adj_t`` of shape ``[num_dst, num_src]``."""
    num_src, num_dst = size
    src, dst = edge_index
    if form == "edge_index":
        return edge_index
    if form == "EdgeIndex":
        from torch_geometric import EdgeIndex
        return EdgeIndex(edge_index, sparse_size=(num_src, num_dst))
    if form == "SparseTensor":
        from torch_sparse import SparseTensor
        return SparseTensor(row=dst, col=src, value=value, sparse_sizes=(num_dst, num_src))
    if value is None:
        value = torch.ones(src.numel(), device=edge_index.device)
    coo = torch.sparse_coo_tensor(torch.stack([dst, src]), value, (num_dst, num_src))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if form == "coo":
            return coo
        if form == "csr":
            return coo.to_sparse_csr()
        if form == "csc":
            return coo.coalesce().to_sparse_csc()
    raise ValueError(form)


def dense_reference(h: pyg_maxk.CBSR) -> Tensor:
    """``h`` as a dense matrix by a plain scatter (no backend kernel)."""
    return h.values.new_zeros(h.num_rows, h.dim).scatter_(1, h.long_indices(), h.values)


def dense_maxk(x, k: int):
    """The stock layers' input: MaxK of ``x`` by the torch backend, dense."""
    if isinstance(x, (tuple, list)):
        return tuple(None if t is None else dense_maxk(t, k) for t in x)
    with pyg_maxk.use_backend("torch"):
        return pyg_maxk.maxk(x, k).to_dense()


def clone_features(x, requires_grad=True):
    if isinstance(x, (tuple, list)):
        return tuple(None if t is None else clone_features(t, requires_grad) for t in x)
    return x.detach().clone().requires_grad_(requires_grad)


def feature_grads(x):
    if isinstance(x, (tuple, list)):
        return [t.grad for t in x if t is not None]
    return [x.grad]


def assert_same_as_stock(maxk_conv, stock_conv, x, args, k, *, rtol=1e-4, atol=1e-5,
                         backend="torch"):
    """``maxk_conv(x, *args) == stock_conv(dense_maxk(x, k), *args)`` in value
    and in the gradients of the features and of every parameter."""
    maxk_conv.load_state_dict(stock_conv.state_dict())
    x_ours = clone_features(x)
    x_stock = clone_features(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pyg_maxk.use_backend(backend):
            out = maxk_conv(x_ours, *args)
        ref = stock_conv(dense_maxk(x_stock, k), *args)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    weight = torch.randn_like(ref)  # a random (never all-ones) output gradient
    with pyg_maxk.use_backend(backend):
        (out * weight).sum().backward()
    (ref * weight).sum().backward()
    for g_ours, g_stock in zip(feature_grads(x_ours), feature_grads(x_stock)):
        torch.testing.assert_close(g_ours, g_stock, rtol=rtol, atol=atol)
    stock_params = dict(stock_conv.named_parameters())
    for name, p in maxk_conv.named_parameters():
        q = stock_params[name]
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)
    return out


def assert_same_selection(h: pyg_maxk.CBSR, x: Tensor, k: int, order: str = "column") -> None:
    """``h`` keeps exactly the entries torch.topk keeps, in ``order``:
    ``"column"`` (the CPU kernels) or ``"bank"`` (the GPU kernel: by column
    mod 32, then column). Among equal values the kernels keep the lowest
    columns, torch.topk unspecified ones, so tied columns may differ (their
    values do not)."""
    values, _ = torch.topk(x, k, dim=1)
    cols = h.indices.long()
    rank = {"column": cols, "bank": (cols % 32) * x.size(1) + cols // 32}[order]
    assert (rank.diff(dim=1) > 0).all(), f"columns are not in {order} order"
    # Each kept value is the entry at its column, and the kept values are
    # topk's: so a value that occurs once in its row sits at topk's column.
    torch.testing.assert_close(x.gather(1, cols), h.values, rtol=0, atol=0)
    torch.testing.assert_close(h.values.sort(dim=1, descending=True).values, values,
                               rtol=0, atol=0)


def few_valued_rows(seed: int, rows: int = 9, dim: int = 70) -> Tensor:
    """Rows of -2, -1, -0.0, 0.0 and 1: selections cut through runs of ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 2, (rows, dim), generator=g).float()
    x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
    return x


def assert_ties_keep_lowest_columns(h: pyg_maxk.CBSR, x: Tensor) -> None:
    """Among the entries equal to a row's k-th largest value, ``h`` keeps
    exactly the first ones in column order."""
    kth = h.values.min(dim=1, keepdim=True).values
    cols = h.indices.long()
    for r in range(x.size(0)):
        tied = (x[r] == kth[r]).nonzero().view(-1)
        picked = cols[r][h.values[r] == kth[r]].sort().values
        assert torch.equal(picked, tied[:picked.numel()])

"""Training loops behind ``pyg-maxk train``: full batch, NeighborLoader
mini-batches, and data-parallel (DDP) mini-batches under ``torchrun``.

Each loop trains one model (MaxK, or the stock ReLU baseline with ``k=None``)
and returns a :class:`RunResult`; the CLI prints and compares them.
"""
from __future__ import annotations

import copy
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..graph import clear_graph_cache
from ..nn import MaxKGCN, MaxKGIN, MaxKGraphSAGE
from .datasets import NodeTask

MODELS = {"sage": MaxKGraphSAGE, "gcn": MaxKGCN, "gin": MaxKGIN}


@dataclass
class TrainConfig:
    model: str = "sage"
    k: Optional[int] = 32
    hidden: int = 256
    layers: int = 2
    epochs: int = 50
    lr: float = 0.01
    weight_decay: float = 0.0
    dropout: float = 0.2
    seed: int = 0
    device: str = "cpu"
    fanout: List[int] = field(default_factory=lambda: [25, 10])
    batch_size: int = 1024
    num_workers: int = 0
    log_every: int = 0          # print a line every n epochs (0: ~10 lines per run)
    stock_form: str = "auto"    # the stock model's adjacency (full batch): see stock_adjacency
    autocast: Optional[str] = None  # "bf16"/"fp16": forward passes under torch.autocast
    progress: Optional[bool] = None  # tqdm bar; None: only on a terminal


@dataclass
class RunResult:
    label: str
    test_metric: float
    val_metric: float
    epoch_ms: float
    peak_mib: float
    losses: List[float]
    seeds_per_s: Optional[float] = None
    model: Optional[torch.nn.Module] = field(default=None, repr=False)
    adjacency: str = "edge_index"  # the adjacency form the model trained on

    def as_dict(self) -> Dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "model"}


def flush_denormals(device: str | torch.device) -> bool:
    """On a CPU, make float arithmetic flush denormal numbers to zero
    (FTZ/DAZ) from now on, in this thread and in the threads it starts later,
    which include PyTorch's intra-op pool if no parallel op has run yet.

    As training drives the loss down, gradients reach the denormal range
    (below 1.2e-38 in float32), where x86 GEMMs slow down several times, so
    late epochs would run slower than early ones. Values this small change
    no result that matters. Returns whether it took effect (False on a GPU
    device and on CPUs without FTZ/DAZ)."""
    if torch.device(device).type != "cpu":
        return False
    return bool(torch.set_flush_denormal(True))


def build_model(cfg: TrainConfig, in_channels: int, out_channels: int,
                k: Optional[int], **conv_kwargs) -> torch.nn.Module:
    """The MaxK model (``k`` an int) or the stock ReLU model (``k=None``)."""
    if cfg.model not in MODELS:
        raise ValueError(f"Unknown model {cfg.model!r}; choose one of {sorted(MODELS)}")
    return MODELS[cfg.model](in_channels, cfg.hidden, cfg.layers, out_channels, k=k,
                             dropout=cfg.dropout, **conv_kwargs)


#: Adjacency forms the stock model can train on (full batch).
STOCK_FORMS = ("auto", "edge_index", "csr", "SparseTensor")
#: Edges below which stock PyG trains fastest on ``edge_index`` on a GPU (its
#: gather/scatter launches fewer kernels than the CSR product); from here and
#: on a CPU a ``torch.sparse`` CSR ``adj_t`` is faster (``benchmarks/train.py``:
#: ``train.json``, ``train-cpu*.json``).
EDGE_INDEX_MAX_EDGES = 1 << 20


def fastest_stock_form(device: torch.device, num_edges: int, autocast: bool = False) -> str:
    """The adjacency form in which stock PyG trains fastest here (measured).
    Under autocast only ``edge_index`` runs: PyG's sparse products get bf16
    features with a float32 matrix, which cuSPARSE and the CPU's sparse
    kernels reject."""
    if autocast or (torch.device(device).type == "cuda" and num_edges < EDGE_INDEX_MAX_EDGES):
        return "edge_index"
    return "csr"


def stock_adjacency(form: str, edge_index: Tensor, num_nodes: int, device: torch.device,
                    autocast: bool = False):
    """``(adj, form)``: the stock model's adjacency in ``form`` (``"auto"``:
    :func:`fastest_stock_form`)."""
    if form == "auto":
        form = fastest_stock_form(device, edge_index.size(1), autocast)
    if form == "edge_index":
        return edge_index, form
    if form == "csr":
        from torch_geometric.utils import to_torch_csr_tensor
        with warnings.catch_warnings():  # torch's "sparse CSR support is in beta" notes
            warnings.simplefilter("ignore", UserWarning)
            adj = to_torch_csr_tensor(edge_index.flip(0), size=(num_nodes, num_nodes))
        return adj, form
    if form == "SparseTensor":
        from torch_sparse import SparseTensor
        return SparseTensor(row=edge_index[1], col=edge_index[0],
                            sparse_sizes=(num_nodes, num_nodes)), form
    raise ValueError(f"Unknown stock form {form!r}; choose one of {STOCK_FORMS}")


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------ metrics
def loss_fn(task: NodeTask, out: Tensor, y: Tensor) -> Tensor:
    if task.multilabel:
        return F.binary_cross_entropy_with_logits(out, y.float())
    return F.cross_entropy(out, y)


def score(task: NodeTask, out: Tensor, y: Tensor) -> float:
    """The task's metric of logits ``out`` against targets ``y``."""
    if y.numel() == 0:
        return float("nan")
    if task.metric == "rocauc":
        from ogb.nodeproppred import Evaluator
        return float(Evaluator(task.ogb_name).eval(
            {"y_true": y.cpu(), "y_pred": out.detach().cpu()})["rocauc"])
    if task.metric == "f1_micro":
        pred, true = out > 0, y > 0.5
        tp = (pred & true).sum().item()
        denom = pred.sum().item() + true.sum().item()
        return 2 * tp / denom if denom else 0.0
    if task.ogb_name is not None:
        from ogb.nodeproppred import Evaluator
        return float(Evaluator(task.ogb_name).eval(
            {"y_true": y.view(-1, 1).cpu(),
             "y_pred": out.argmax(-1, keepdim=True).cpu()})["acc"])
    return (out.argmax(-1) == y).float().mean().item()


# ---------------------------------------------------------------- progress
class Progress:
    """A tqdm bar per run (on a terminal) plus a log line every few epochs."""

    def __init__(self, label: str, epochs: int, cfg: TrainConfig, enabled: bool = True) -> None:
        self.label = label
        self.enabled = enabled
        self.every = cfg.log_every or max(1, epochs // 10)
        self.epochs = epochs
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm
            # disable=None: tqdm shows the bar on a terminal only.
            disable = True if cfg.progress is False else (None if cfg.progress is None else False)
            self.bar = tqdm(total=epochs, desc=label, unit="epoch", leave=False, disable=disable)

    def update(self, epoch: int, loss: float, val: float, metric: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", val=f"{val:.4f}")
            self.bar.update(1)
        if epoch == 1 or epoch % self.every == 0 or epoch == self.epochs:
            line = f"[{self.label}] epoch {epoch:4d}  loss {loss:.4f}  val {metric} {val:.4f}"
            if self.bar is not None:
                self.bar.write(line)
            else:  # pragma: no cover
                print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _label(k: Optional[int]) -> str:
    return f"MaxK k={k}" if k is not None else "stock ReLU"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return float("nan")


def _start_run(cfg: TrainConfig, device: torch.device, k: Optional[int],
               verbose: bool) -> Progress:
    """Reset the peak-memory counter and open the run's progress display."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return Progress(_label(k), cfg.epochs, cfg, verbose)


def _steady(times: List[float]) -> float:
    """Median epoch time without the first epochs (kernel compilation, graph
    build, allocator warm-up)."""
    return statistics.median(times[min(3, len(times) - 1):])


#: ``TrainConfig.autocast`` names and their dtypes.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(cfg: TrainConfig, device: torch.device):
    """``torch.autocast`` with ``cfg.autocast``'s dtype (disabled when None)."""
    if cfg.autocast is not None and cfg.autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast must be one of {sorted(AUTOCAST_DTYPES)}, "
                         f"got {cfg.autocast!r}")
    dtype = AUTOCAST_DTYPES.get(cfg.autocast, torch.bfloat16)
    return torch.autocast(device.type, dtype=dtype, enabled=cfg.autocast is not None)


# -------------------------------------------------------------- full batch
def train_full_batch(task: NodeTask, cfg: TrainConfig, k: Optional[int],
                     verbose: bool = True) -> RunResult:
    """Train one model (MaxK, or stock with ``k=None``) on the whole graph."""
    run = FullBatchRun(_on_device(task, cfg), cfg, k, verbose)
    for _ in range(cfg.epochs):
        run.epoch()
    return run.result()


def train_full_batch_side_by_side(task: NodeTask, cfg: TrainConfig, ks: List[Optional[int]],
                                  verbose: bool = True) -> List[RunResult]:
    """Train one model per ``k`` on the whole graph, their epochs alternating
    (each model's first, then each one's second, ...): a small graph's epoch
    is bound by host time, which drifts by tens of percent within a minute,
    and alternating exposes every model to the same drift. Each model trains
    as :func:`train_full_batch` trains it alone: the same random draws (each
    run keeps its own generator states), the same results."""
    task = _on_device(task, cfg)
    runs = [FullBatchRun(task, cfg, k, verbose) for k in ks]
    for _ in range(cfg.epochs):
        for run in runs:
            run.epoch()
    return [run.result() for run in runs]


def _on_device(task: NodeTask, cfg: TrainConfig) -> NodeTask:
    """``task`` with its data on the training device, leaving the caller's
    task as it is (PyG's ``Data.to`` moves in place): moved before any run
    counts its memory, the dataset that every run reads counts against none."""
    return replace(task, data=copy.copy(task.data).to(torch.device(cfg.device)))


class FullBatchRun:
    """One model's full-batch training, an epoch per :meth:`epoch` call.

    Between its epochs other runs may train: each run restores its own
    random generator states around its epochs, and counts as its peak memory
    what it would have allocated alone (its own resident tensors plus the
    peak above them during its epochs), not the other runs' tensors nor the
    dataset already on the device (the training functions move it there
    first, for every run alike). (Bytes
    that another run allocated and this run's epoch frees, such as a dead
    graph that the graph cache drops at its next insertion, count as this
    run's.)"""

    def __init__(self, task: NodeTask, cfg: TrainConfig, k: Optional[int],
                 verbose: bool = True) -> None:
        self.task, self.cfg, self.k = task, cfg, k
        self.device = device = torch.device(cfg.device)
        allocated_before = _allocated(device)
        self.data = data = copy.copy(task.data).to(device)  # the caller's task unmoved
        self.adj, self.form = data.edge_index, None
        if k is None:  # the stock model, in its fastest (or the requested) form
            self.adj, self.form = stock_adjacency(cfg.stock_form, data.edge_index,
                                                  data.num_nodes, device,
                                                  cfg.autocast is not None)
        seed_everything(cfg.seed)
        # Full batch: GCN's normalisation is computed once on both sides.
        kwargs = {"cached": True} if cfg.model == "gcn" else {}
        self.model = build_model(cfg, data.num_features, task.num_classes, k,
                                 **kwargs).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr,
                                    weight_decay=cfg.weight_decay)
        self.progress = Progress(_label(k), cfg.epochs, cfg, verbose)
        self.random_states = _random_states(device)
        self.resident = _allocated(device) - allocated_before  # bytes this run holds
        self.peak = self.resident
        self._warm_up()
        self.times: List[float] = []
        self.losses: List[float] = []
        self.best_val, self.test_at_best = -1.0, 0.0

    def epoch(self) -> None:
        """One training step, timed, then the validation (and test) scores."""
        task, data, device, model = self.task, self.data, self.device, self.model
        _set_random_states(device, self.random_states)
        allocated_before = _allocated(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        loss = self._train_step(model, self.opt)
        _sync(device)
        self.times.append((time.perf_counter() - start) * 1e3)
        out = self._evaluate(model)
        val = score(task, out[data.val_mask], data.y[data.val_mask])
        if val > self.best_val:
            self.best_val = val
            self.test_at_best = score(task, out[data.test_mask], data.y[data.test_mask])
        self.losses.append(loss.item())
        del out, loss
        if device.type == "cuda":
            above = torch.cuda.max_memory_allocated(device) - allocated_before
            self.peak = max(self.peak, self.resident + above)
            self.resident += _allocated(device) - allocated_before  # e.g. Adam's state
        self.random_states = _random_states(device)
        self.progress.update(len(self.losses), self.losses[-1], val, task.metric)

    def _train_step(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Tensor:
        data, task = self.data, self.task
        model.train()
        opt.zero_grad(set_to_none=True)
        with autocast(self.cfg, self.device):
            out = model(data.x, self.adj)
            loss = loss_fn(task, out[data.train_mask], data.y[data.train_mask])
        loss.backward()
        opt.step()
        return loss

    def _evaluate(self, model: torch.nn.Module) -> Tensor:
        """The output of ``model`` in eval mode, without autograd."""
        model.eval()
        with torch.no_grad(), autocast(self.cfg, self.device):
            return model(self.data.x, self.adj)

    def _warm_up(self) -> None:
        """One epoch (a step and the evaluation) on copies of the model and
        optimizer, then the graph cache cleared: what a process allocates
        once on its first epoch (cuBLAS workspaces, tens of MiB, and smaller
        buffers of the evaluation's ops) exists before any run counts its
        memory, so it counts against none, and each run still builds (and
        counts) its own graph. (Its random draws are undone: each epoch
        starts from the run's saved generator states.)"""
        model = copy.deepcopy(self.model)
        opt = type(self.opt)(model.parameters(), **self.opt.defaults)
        self._train_step(model, opt)
        data = self.data
        score(self.task, self._evaluate(model)[data.val_mask], data.y[data.val_mask])
        del model, opt
        _sync(self.device)
        clear_graph_cache()

    def result(self) -> RunResult:
        self.progress.close()
        peak = self.peak / 2**20 if self.device.type == "cuda" else float("nan")
        return RunResult(_label(self.k), self.test_at_best, self.best_val, _steady(self.times),
                         peak, self.losses, model=self.model,
                         adjacency=self.form or "edge_index")


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _random_states(device: torch.device) -> tuple:
    """The states of torch's generators that a training step draws from."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_random_states(device: torch.device, states: tuple) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


# -------------------------------------------------------------- mini-batch
def neighbor_loader(data, seeds: Tensor, cfg: TrainConfig, shuffle: bool,
                    generator: Optional[torch.Generator] = None, like=None):
    """PyG's NeighborLoader over ``seeds`` with ``cfg.fanout`` per hop (the
    first entry is the hop next to the seeds). ``like``: another such loader
    whose sampler (and the graph it converted) is reused."""
    from torch_geometric.loader import NeighborLoader

    if len(cfg.fanout) != cfg.layers:
        raise ValueError(f"--fanout has {len(cfg.fanout)} hops but the model has "
                         f"{cfg.layers} layers; give one fanout per layer")
    return NeighborLoader(data, num_neighbors=list(cfg.fanout), input_nodes=seeds,
                          batch_size=cfg.batch_size, shuffle=shuffle,
                          num_workers=cfg.num_workers, generator=generator,
                          neighbor_sampler=None if like is None else like.node_sampler)


def _batch_forward(model, batch, device):
    """The seed nodes' outputs and targets. With pyg-lib's sampler the batch
    has per-hop counts and every layer shrinks to the nodes still needed;
    torch_sparse's sampler gives none, and the model then runs on the whole
    sampled subgraph (the seeds' outputs are the same, with more work)."""
    batch = batch.to(device, non_blocking=True)
    nodes = getattr(batch, "num_sampled_nodes", None)
    edges = getattr(batch, "num_sampled_edges", None)
    if nodes is not None and edges is not None:
        out = model(batch.x, batch.edge_index, num_sampled_nodes_per_hop=nodes,
                    num_sampled_edges_per_hop=edges)
    else:
        out = model(batch.x, batch.edge_index)
    return out[:batch.batch_size], batch.y[:batch.batch_size]


def train_neighbor(task: NodeTask, cfg: TrainConfig, k: Optional[int], verbose: bool = True,
                   rank: int = 0, world_size: int = 1,
                   all_reduce: Optional[Callable[[Tensor], Tensor]] = None) -> RunResult:
    """Mini-batch training with NeighborLoader. Under DDP (``world_size > 1``)
    every rank takes an equal share of the training seeds, its model is
    wrapped in DistributedDataParallel, and metrics are summed over ranks."""
    device = torch.device(cfg.device)
    data = task.data
    seed_everything(cfg.seed)
    model = build_model(cfg, data.num_features, task.num_classes, k).to(device)
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                        else None)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_seeds = _share(data.train_mask.nonzero().view(-1), rank, world_size)
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    loader = neighbor_loader(data, train_seeds, cfg, shuffle=True, generator=generator)
    # Built once: each new sampler would convert the whole graph again.
    eval_loaders = [neighbor_loader(data, _share(mask.nonzero().view(-1), rank, world_size),
                                    cfg, shuffle=False, like=loader)
                    for mask in (data.val_mask, data.test_mask)]
    progress = _start_run(cfg, device, k, verbose)
    times, losses = [], []
    best_val, test_at_best = -1.0, 0.0
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        _sync(device)
        start = time.perf_counter()
        total, count = 0.0, 0
        for batch in loader:
            opt.zero_grad(set_to_none=True)
            with autocast(cfg, device):
                out, y = _batch_forward(model, batch, device)
                loss = loss_fn(task, out, y)
            loss.backward()
            opt.step()
            total += loss.detach() * y.size(0)
            count += y.size(0)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        stats = torch.stack([torch.as_tensor(total, dtype=torch.float64).cpu(),
                             torch.tensor(float(count), dtype=torch.float64)])
        if all_reduce is not None:
            stats = all_reduce(stats)
        losses.append(float(stats[0] / stats[1]))
        with autocast(cfg, device):
            val, test = _evaluate(model, task, eval_loaders, device, all_reduce)
        if val > best_val:
            best_val, test_at_best = val, test
        progress.update(epoch, losses[-1], val, task.metric)
    progress.close()
    epoch_ms = _steady(times)
    seeds = train_seeds.numel() * world_size
    return RunResult(_label(k), test_at_best, best_val, epoch_ms, _peak_mib(device), losses,
                     seeds_per_s=seeds / (epoch_ms / 1e3), model=model)


def _share(seeds: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s share of ``seeds``; every rank gets the same number
    (DDP needs the same number of steps on every rank)."""
    per_rank = seeds.numel() // world_size
    return seeds[rank * per_rank:(rank + 1) * per_rank]


@torch.no_grad()
def _evaluate(model, task, loaders, device, all_reduce):
    """Validation and test metric of this rank's share (``loaders``), with the
    training fanout. Accuracy is summed exactly over ranks; other metrics are
    weighted averages over ranks."""
    model.eval()
    results = []
    for loader in loaders:
        outs, ys = [], []
        for batch in loader:
            out, y = _batch_forward(model, batch, device)
            outs.append(out.float())
            ys.append(y)
        out = torch.cat(outs) if outs else torch.empty(0, task.num_classes)
        y = torch.cat(ys) if ys else torch.empty(0, dtype=torch.long)
        value = torch.tensor([score(task, out, y) * y.size(0), float(y.size(0))],
                             dtype=torch.float64)
        if all_reduce is not None:
            value = all_reduce(value)
        results.append(float(value[0] / value[1]) if value[1] > 0 else float("nan"))
    return results[0], results[1]


# -------------------------------------------------------------------- DDP
def ddp_context(device: str):
    """Join the process group ``torchrun`` set up: NCCL on GPUs (one per local
    rank), gloo on CPUs. Returns ``(rank, world_size, device, all_reduce)``."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise RuntimeError("--ddp needs torchrun: torchrun --nproc_per_node N -m pyg_maxk "
                           "train --loader neighbor --ddp ...")
    use_cuda = device.startswith("cuda") and torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    comm_device = torch.device(device) if use_cuda else torch.device("cpu")

    def all_reduce(t: Tensor) -> Tensor:
        t = t.to(comm_device)
        dist.all_reduce(t)
        return t.cpu()

    return rank, world, device, all_reduce


def ddp_shutdown() -> None:
    """Leave the process group, if one was joined. Without this, interpreter
    exit tears down the communication threads while they are still joinable,
    which can abort a rank (``terminate called without an active exception``,
    seen once in CI with gloo) after training finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

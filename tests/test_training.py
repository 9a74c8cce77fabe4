"""Training as a user runs it: mini-batches with per-hop trimming, the
NeighborLoader CLI, data-parallel training under torchrun (gloo, CPU)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pyg_maxk
from pyg_maxk.nn import MaxKGCN, MaxKGIN, MaxKGraphSAGE

ROOT = Path(__file__).resolve().parents[1]


def hop_batch(seed=0):
    """A batch laid out like NeighborLoader's: 4 seeds, 7 hop-1 nodes, 9 hop-2
    nodes; hop-h edges point from hop-h nodes to hop-(h-1) nodes."""
    g = torch.Generator().manual_seed(seed)
    nodes = [4, 7, 9]
    first = [0, 4, 11, 20]
    hop_edges = []
    for h, count in ((1, 15), (2, 20)):
        src = torch.randint(first[h], first[h + 1], (count,), generator=g)
        dst = torch.randint(first[h - 1], first[h], (count,), generator=g)
        hop_edges.append(torch.stack([src, dst]))
    edge_index = torch.cat(hop_edges, dim=1)
    x = torch.randn(20, 12, generator=g)
    return x, edge_index, nodes, [15, 20]


@pytest.mark.parametrize("cls", [MaxKGraphSAGE, MaxKGIN, MaxKGCN])
@pytest.mark.parametrize("k", [4, None])
def test_per_hop_trimming_keeps_the_seed_outputs(cls, k):
    torch.manual_seed(0)
    model = cls(12, 16, 2, 3, k=k).eval()
    x, edge_index, nodes, edges = hop_batch()
    full = model(x, edge_index)[:4]
    trimmed = model(x, edge_index, num_sampled_nodes_per_hop=nodes,
                    num_sampled_edges_per_hop=edges)
    if model.trims_to_hops:
        assert trimmed.size(0) == 4  # the last layer computes the seeds only
    torch.testing.assert_close(trimmed[:4], full, rtol=1e-5, atol=1e-5)


def test_trimming_needs_the_edge_counts():
    model = MaxKGraphSAGE(12, 16, 2, 3, k=4)
    x, edge_index, nodes, _ = hop_batch()
    with pytest.raises(ValueError, match="num_sampled_edges_per_hop"):
        model(x, edge_index, num_sampled_nodes_per_hop=nodes)


def run_cli(*args, env=None, timeout=600):
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def losses(output: str, label: str):
    return [float(m) for m in re.findall(rf"\[{re.escape(label)}\] epoch +\d+ +loss ([0-9.]+)",
                                         output)]


@pytest.mark.slow
def test_neighbor_loader_training_from_the_cli():
    r = run_cli("pyg_maxk", "train", "--loader", "neighbor", "--fanout", "10,5",
                "--batch-size", "256", "--epochs", "4", "--log-every", "1", "--compare",
                "--scale", "0.4", "--device", "cpu", "--no-progress")
    assert r.returncode == 0, r.stderr
    for label in ("MaxK k=16", "stock ReLU"):
        curve = losses(r.stdout, label)
        assert len(curve) == 4 and curve[-1] < curve[0], r.stdout
    assert "seeds/s" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("summary: MaxK k=16")


@pytest.mark.slow
def test_ddp_two_processes_gloo(tmp_path):
    save = tmp_path / "model.pt"
    r = run_cli("torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
                "-m", "pyg_maxk", "train", "--loader", "neighbor", "--ddp", "--fanout", "10,5",
                "--batch-size", "128", "--epochs", "4", "--log-every", "1", "--scale", "0.4",
                "--device", "cpu", "--no-progress", "--save-model", str(save),
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 processes" in r.stdout
    curve = losses(r.stdout, "MaxK k=16")
    assert len(curve) == 4 and curve[-1] < curve[0], r.stdout
    ranks = [torch.load(f"{save}.rank{i}") for i in range(2)]
    assert ranks[0].keys() == ranks[1].keys()
    for name in ranks[0]:
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0, msg=name)


def test_flush_denormals_only_on_a_cpu(monkeypatch):
    from pyg_maxk.app.training import flush_denormals

    calls = []
    monkeypatch.setattr(torch, "set_flush_denormal", lambda on: calls.append(on) or True)
    assert flush_denormals("cpu") is True and calls == [True]
    assert flush_denormals("cuda:0") is False and calls == [True]


def test_flushed_denormals_read_as_zero():
    from pyg_maxk.app.training import flush_denormals

    if not flush_denormals("cpu"):
        pytest.skip("this CPU has no flush-to-zero mode")
    tiny = torch.tensor([1e-39, 1.0])  # 1e-39 is denormal in float32
    assert (tiny * 1.0).tolist() == [0.0, 1.0]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_side_by_side_full_batch_runs_train_as_they_do_alone(device):
    # --compare alternates the two models' epochs; each keeps its own random
    # draws (dropout), so both train exactly as they do one after the other,
    # and each counts its own peak memory, not the other model's tensors (nor
    # the dataset, which the first run in a process would otherwise count).
    from pyg_maxk.app.datasets import load_dataset
    from pyg_maxk.app.training import (
        TrainConfig,
        train_full_batch,
        train_full_batch_side_by_side,
    )
    task = load_dataset("small", "data", scale=0.05 if device == "cpu" else 0.5, seed=0)
    cfg = TrainConfig(model="sage", k=4, hidden=16, epochs=4, dropout=0.5, device=device)
    alone = []
    for k in (4, None):
        alone.append(train_full_batch(task, cfg, k, verbose=False))
        # The cache drops a dead graph at its next insertion: not inside
        # another run's epochs, whose peak would count it as freed.
        pyg_maxk.clear_graph_cache()
    together = train_full_batch_side_by_side(task, cfg, [4, None], verbose=False)
    assert task.data.x.device.type == "cpu"  # the caller's task stays where it was
    for a, b in zip(alone, together):
        assert a.label == b.label and a.adjacency == b.adjacency
        assert a.losses == pytest.approx(b.losses, rel=1e-5)  # GPU sums: float atomics
        if device == "cpu":
            assert a.losses == b.losses
            assert (a.test_metric, a.val_metric) == (b.test_metric, b.val_metric)
            for p, q in zip(a.model.parameters(), b.model.parameters()):
                assert torch.equal(p, q)
        else:
            assert b.peak_mib == pytest.approx(a.peak_mib, rel=0.05)
    assert alone[0].losses != alone[1].losses


@pytest.mark.parametrize("model", ["sage", "gcn"])
def test_full_batch_warm_up_step_changes_no_result(model, monkeypatch):
    # Each full-batch run first takes a step on copies of its model and
    # optimizer (so that one-time allocations count against no run): the
    # run then trains exactly as without it (the same draws, weights and
    # GCN's cached normalisation).
    from pyg_maxk.app.datasets import load_dataset
    from pyg_maxk.app.training import FullBatchRun, TrainConfig, train_full_batch
    task = load_dataset("small", "data", scale=0.05, seed=0)
    cfg = TrainConfig(model=model, k=4, hidden=16, epochs=3, dropout=0.5, device="cpu")
    runs = {}
    for label in ("warm-up", "none"):
        if label == "none":
            monkeypatch.setattr(FullBatchRun, "_warm_up", lambda self: None)
        runs[label] = [train_full_batch(task, cfg, k, verbose=False) for k in (4, None)]
    for a, b in zip(runs["warm-up"], runs["none"]):
        assert a.losses == b.losses
        for p, q in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(p, q)

"""The ``pyg-maxk`` command line: every flag documented, datasets offline,
errors that say what to do."""
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from pyg_maxk.app.cli import build_parser, main

SHARED_PLANETOID = Path(__file__).resolve().parents[2] / "shared" / "data" / "planetoid"


def train_help() -> str:
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    return sub.format_help()


def test_help_explains_every_flag():
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.option_strings
    text = train_help()
    for flag in ("--model", "--k", "--hidden", "--layers", "--epochs", "--lr", "--dropout",
                 "--dataset", "--root", "--device", "--seed", "--compare", "--loader",
                 "--fanout", "--batch-size", "--ddp"):
        assert flag in text


@pytest.mark.parametrize("argv,message", [
    (["--ddp"], "--loader neighbor"),
    (["--loader", "neighbor", "--fanout", "5,5,5"], "one fanout per layer"),
    (["--k", "0"], "--k must be"),
])
def test_bad_arguments_say_what_to_do(argv, message, capsys):
    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


def test_missing_dataset_without_network_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from torch_geometric.datasets import Planetoid

    def offline(self):  # what a download does without network (tests never download)
        raise OSError("network unreachable")

    monkeypatch.setattr(Planetoid, "download", offline)
    assert main(["train", "--dataset", "CiteSeer", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "network unreachable" in err and str(tmp_path / "CiteSeer" / "raw") in err


@pytest.mark.skipif(not SHARED_PLANETOID.exists(), reason="no Planetoid files in ../shared")
def test_planetoid_from_root(tmp_path, capsys):
    shutil.copytree(SHARED_PLANETOID / "Cora", tmp_path / "Cora")
    assert main(["train", "--dataset", "Cora", "--root", str(tmp_path), "--epochs", "3",
                 "--hidden", "16", "--compare", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "dataset Cora: 2708 nodes" in out
    assert out.strip().splitlines()[-1].startswith("summary: MaxK k=16 test accuracy")


def test_the_main_job_prints_no_warnings(capsys):
    # The README's main job (a CPU run here: stock on a torch.sparse CSR
    # adj_t) shows its table, not torch's sparse-beta notes.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", "--compare", "--epochs", "2", "--scale", "0.2",
                     "--no-progress"]) == 0
    assert [str(w.message) for w in caught] == []


def test_seeded_runs_reproduce(capsys):
    argv = ["train", "--epochs", "3", "--dataset", "small", "--scale", "0.2", "--hidden", "16",
            "--no-progress"]
    main(argv)
    first = capsys.readouterr().out.splitlines()
    main(argv)
    second = capsys.readouterr().out.splitlines()
    strip = [line for line in first if "loss" in line]
    assert strip and strip == [line for line in second if "loss" in line]


@pytest.mark.parametrize("extra,expected", [([], [True]), (["--keep-denormals"], [])])
def test_cpu_training_flushes_denormals_unless_asked_not_to(extra, expected, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_flush_denormal", lambda on: calls.append(on) or True)
    assert main(["train", "--epochs", "1", "--dataset", "small", "--scale", "0.2",
                 "--hidden", "16", "--no-progress", "--device", "cpu", *extra]) == 0
    assert calls == expected


class _FakeOgbDataset:
    """Stands in for ogb's PygNodePropPredDataset (tests never download)."""

    def __init__(self, name, root):
        from torch_geometric.data import Data
        g = torch.Generator().manual_seed(0)
        n = 60
        self.name = name
        edge_index = torch.randint(0, n, (2, 300), generator=g)
        if name == "ogbn-proteins":
            self.data = Data(edge_index=edge_index, edge_attr=torch.rand(300, 8, generator=g),
                             y=torch.randint(0, 2, (n, 112), generator=g), num_nodes=n)
        else:
            self.data = Data(x=torch.randn(n, 16, generator=g), edge_index=edge_index,
                             y=torch.randint(0, 5, (n, 1), generator=g))
        perm = torch.randperm(n, generator=g)
        self.split = {"train": perm[:30], "valid": perm[30:45], "test": perm[45:]}

    def __getitem__(self, i):
        return self.data

    def get_idx_split(self):
        return self.split


@pytest.mark.parametrize("name,metric", [("ogbn-arxiv", "accuracy"), ("ogbn-proteins", "rocauc")])
def test_ogb_datasets_use_the_split_and_ogbs_evaluator(name, metric, monkeypatch, capsys):
    # ogb is a dependency of the package (installed with it, as CI does); a
    # bare environment such as the GPU host's may lack it.
    pytest.importorskip("ogb")
    import ogb.nodeproppred
    monkeypatch.setattr(ogb.nodeproppred, "PygNodePropPredDataset", _FakeOgbDataset)
    from pyg_maxk.app.datasets import load_dataset
    task = load_dataset(name, "unused")
    data = task.data
    assert task.metric == metric and int(data.train_mask.sum()) == 30
    assert not (data.train_mask & data.test_mask).any()
    if name == "ogbn-proteins":
        assert task.multilabel and data.x.shape == (60, 8) and task.num_classes == 112
    else:
        assert data.y.dim() == 1 and task.num_classes == int(data.y.max()) + 1
    assert main(["train", "--dataset", name, "--epochs", "2", "--hidden", "16", "--k", "4",
                 "--no-progress"]) == 0
    assert f"test {metric}" in capsys.readouterr().out


def test_autocast_compare_trains_both_models_under_autocast(monkeypatch, capsys):
    # Both models' forward passes under torch.autocast; the stock model takes
    # edge_index, the one form whose message passing runs there.
    entered = []
    original = torch.autocast.__init__

    def spy(self, device_type, dtype=None, enabled=True, *args, **kwargs):
        if enabled:
            entered.append(dtype)
        original(self, device_type, dtype, enabled, *args, **kwargs)

    monkeypatch.setattr(torch.autocast, "__init__", spy)
    assert main(["train", "--autocast", "bf16", "--compare", "--epochs", "2", "--scale", "0.2",
                 "--device", "cpu", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "stock ReLU (edge_index)" in out
    assert entered and set(entered) == {torch.bfloat16}

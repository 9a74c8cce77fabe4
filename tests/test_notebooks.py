"""The notebooks run top to bottom (on the CPU here) and are committed
without outputs. The fast tier runs them with ``PYG_MAXK_SMOKE_TEST=1`` (a
small graph, a few epochs: every cell in seconds); the full tier as written."""
import importlib.util
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
#: PyG's NeighborLoader samples through pyg-lib or torch-sparse.
NEIGHBOR_SAMPLING = any(importlib.util.find_spec(m) for m in ("pyg_lib", "torch_sparse"))


def test_there_are_three_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_benchmarks.ipynb",
                                           "03_minibatch.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, path.name


def _run(path, monkeypatch, smoke):
    if path.stem == "03_minibatch" and not NEIGHBOR_SAMPLING:
        pytest.skip("NeighborLoader needs pyg-lib or torch-sparse (the full tier installs it)")
    NotebookClient = pytest.importorskip("nbclient").NotebookClient
    # The kernel is a fresh process: it must not inherit the simulator switch.
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    if smoke:
        monkeypatch.setenv("PYG_MAXK_SMOKE_TEST", "1")
    else:
        monkeypatch.delenv("PYG_MAXK_SMOKE_TEST", raising=False)
    # ... and finds this checkout's pyg_maxk even when it is not installed.
    root = str(path.parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_cell_runs_in_smoke_mode(path, monkeypatch):
    _run(path, monkeypatch, smoke=True)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_top_to_bottom(path, monkeypatch):
    _run(path, monkeypatch, smoke=False)

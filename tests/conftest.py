import os

import pytest
import torch

# Without a GPU, the "numba" backend runs its kernels in Numba's CUDA simulator
# (on CPU tensors). This must be decided before numba.cuda is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with `-m gpu`)")
    config.addinivalue_line("markers", "sim: runs Numba kernels in the CUDA simulator (slow)")


@pytest.fixture(autouse=True)
def _fresh_graph_cache():
    import pyg_maxk

    pyg_maxk.clear_graph_cache()
    pyg_maxk.dispatch.clear_decisions()
    yield
    pyg_maxk.clear_graph_cache()
    pyg_maxk.dispatch.clear_decisions()


@pytest.fixture(autouse=True)
def _ieee_denormals():
    yield
    torch.set_flush_denormal(False)  # `pyg-maxk train` flushes them on a CPU

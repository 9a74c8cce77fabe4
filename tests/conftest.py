import os

import pytest
import torch

# Without a GPU, the "numba" backend runs its kernels in Numba's CUDA simulator
# (on CPU tensors). This must be decided before numba.cuda is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with `-m gpu`)")
    config.addinivalue_line("markers", "slow: the full tier only (`-m 'not gpu'`): sweeps, "
                            "subprocesses, gradcheck, torch.compile, whole notebooks")
    config.addinivalue_line("markers", "sim: runs Numba kernels in the CUDA simulator; "
                            "slow unless also marked smoke")
    config.addinivalue_line("markers", "smoke: a simulator case the fast tier runs too")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # The simulator runs a kernel's every thread in Python: all but a smoke
    # set (each kernel family on each code path) belong to the full tier.
    for item in items:
        if item.get_closest_marker("sim") and not item.get_closest_marker("smoke"):
            item.add_marker(pytest.mark.slow)


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

import subprocess
import sys
import warnings

import pytest
import torch

import pyg_maxk
from helpers import DEVICE
from pyg_maxk.dispatch import get_backend, resolve_backend
from pyg_maxk.nn import MaxKSAGEConv


def test_context_manager_nests_and_restores():
    assert get_backend() == "auto"
    with pyg_maxk.use_backend("torch"):
        assert get_backend() == "torch"
        with pyg_maxk.use_backend("numba"):
            assert get_backend() == "numba"
        assert get_backend() == "torch"
    assert get_backend() == "auto"


def test_unknown_backend():
    with pytest.raises(ValueError, match="Unknown pyg_maxk backend"):
        pyg_maxk.use_backend("cusparse")


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("PYG_MAXK_BACKEND", "torch")
    assert get_backend() == "torch"
    monkeypatch.setenv("PYG_MAXK_BACKEND", "bogus")
    with pytest.raises(ValueError, match="PYG_MAXK_BACKEND"):
        get_backend()


def test_auto_uses_the_cpu_kernels_on_cpu():
    assert resolve_backend(torch.zeros(1)) == "cpu"
    assert resolve_backend(torch.zeros(1, dtype=torch.float64)) == "cpu"
    assert resolve_backend(torch.zeros(1, dtype=torch.bfloat16)) == "torch"


def test_forced_cpu_backend_rejects_what_it_cannot_take():
    with pyg_maxk.use_backend("cpu"), \
            pytest.raises(pyg_maxk.BackendError, match="float32/float64 CPU"):
        resolve_backend(torch.zeros(1, dtype=torch.float16))


def test_numba_rejects_float64():
    with pyg_maxk.use_backend("numba"), pytest.raises(pyg_maxk.BackendError, match="float64"):
        resolve_backend(torch.zeros(1, dtype=torch.float64))


@pytest.fixture
def deterministic_algorithms():
    """Restores torch's deterministic-algorithms setting after the test."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_deterministic_mode_takes_fixed_order_aggregation(monkeypatch, deterministic_algorithms):
    # As if the Numba kernels ran here (a GPU): only the aggregation adds in
    # float atomics, so only it changes under deterministic mode.
    monkeypatch.setattr(pyg_maxk.dispatch, "_numba_cannot", lambda *args: "")
    choose_on = pyg_maxk.dispatch.choose_on

    def decision(op, requested):
        return choose_on(op, "cuda", torch.float32, dim=256, k=32, requested=requested)

    assert decision("aggregate", "auto") == "numba"
    assert pyg_maxk.dispatch.float_atomics_allowed()
    torch.use_deterministic_algorithms(True)
    assert not pyg_maxk.dispatch.float_atomics_allowed()
    assert decision("aggregate", "auto") == "torch"
    assert decision("select", "auto") == decision("densify", "auto") == "numba"
    assert decision("aggregate", "torch") == "torch"
    with pytest.raises(pyg_maxk.BackendError, match="use_deterministic_algorithms"):
        decision("aggregate", "numba")
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="float atomic"):
        assert decision("aggregate", "numba") == "numba"
    assert decision("aggregate", "auto") == "torch"
    torch.use_deterministic_algorithms(False)
    assert decision("aggregate", "auto") == "numba"


@pytest.mark.sim
@pytest.mark.smoke
def test_a_forced_numba_aggregation_under_deterministic_mode_is_a_clear_error(
        deterministic_algorithms):
    # On a GPU host the kernels' own device; here the simulator's CPU tensors.
    x = torch.randn(6, 16, device=DEVICE)
    ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]], device=DEVICE)
    conv = MaxKSAGEConv(16, 8, k=4).to(DEVICE)
    torch.use_deterministic_algorithms(True)
    with pyg_maxk.use_backend("numba"), \
            pytest.raises(pyg_maxk.BackendError, match="fixed-order sums"):
        conv(x, ei)
    # "auto" runs: fixed-order sums (warn_only: cuBLAS would want its
    # workspace configured on a GPU).
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = conv(x, ei)
    assert out.shape == (6, 8)


@pytest.mark.slow
def test_forced_numba_on_cpu_without_simulator_is_a_clear_error():
    code = ("import torch, pyg_maxk\n"
            "with pyg_maxk.use_backend('numba'):\n"
            "    pyg_maxk.maxk(torch.randn(4, 8), 2)\n")
    env = {k: v for k, v in __import__('os').environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert "needs CUDA tensors" in proc.stderr and "NUMBA_ENABLE_CUDASIM" in proc.stderr


def test_numpy_row_stack_shim(monkeypatch):
    """numba-cuda 0.30.4 needs numpy.row_stack, which numpy 2.5 removed."""
    import numpy as np

    from pyg_maxk.kernels import patch_numpy

    monkeypatch.delattr(np, "row_stack", raising=False)
    assert patch_numpy() is True
    assert np.row_stack is np.vstack
    assert patch_numpy() is False  # idempotent once present


def test_kernel_params_follow_numbas_array_layout():
    # The fast launch path packs what Numba's kernels take: per array meminfo,
    # parent, nitems, itemsize, data, shape..., strides in bytes...; per int
    # one int64 (checked against the kernels on a GPU by the kernel tests).
    from pyg_maxk.ops._launch import kernel_params

    t = torch.zeros(3, 5)
    u = torch.zeros(7, dtype=torch.uint8)
    assert kernel_params([t, 4, u]) == [0, 0, 15, 4, t.data_ptr(), 3, 5, 20, 4,
                                        4,
                                        0, 0, 7, 1, u.data_ptr(), 7, 1]


def _recording_driver():
    """A ``_DriverLaunch`` over a fake ``cuLaunchKernel`` (raw stream 1000 +
    device index), and the list of what each launch handed it: ``(handle,
    blocks, threads, stream, parameter fields)``."""
    import ctypes

    from pyg_maxk.ops._launch import _DriverLaunch, ctypes_launch

    seen = []

    def fake_cu_launch_kernel(handle, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        size = ctypes.c_size_t.from_address(extra[3]).value
        buffer = (ctypes.c_int64 * (size // 8)).from_address(extra[1])
        seen.append((handle, gx, bx, stream, list(buffer)))
        return 0

    return _DriverLaunch(ctypes_launch(fake_cu_launch_kernel), lambda index: 1000 + index), seen


def test_driver_launch_hands_the_packed_fields_to_the_driver():
    # Each launch repacks the kernel's reused buffer; the driver must see this
    # launch's fields (and the buffer's size), not a previous launch's.
    from pyg_maxk.ops._launch import _PackedLaunch, params_and_types

    driver, seen = _recording_driver()
    t, u = torch.zeros(3, 5), torch.zeros(7, dtype=torch.uint8)
    fields, types = params_and_types([t, 4, u])
    assert types == ((torch.float32, 2), int, (torch.uint8, 1))
    packed = _PackedLaunch(handle=77, num_fields=len(fields))
    driver(packed, 6, 128, 0, fields)
    v = torch.zeros(2, 5)
    later, _ = params_and_types([v, 9, u])
    driver(packed, 2, 64, 1, later)
    assert seen == [(77, 6, 128, 1000, fields), (77, 2, 64, 1001, later)]


def test_prepared_launch_writes_each_calls_pointers_and_keeps_the_rest():
    # A prepared launch packs its arguments once; a call writes the data
    # pointers of the tensors given for the variable positions, and the
    # driver sees exactly the fields a full launch with those tensors packs.
    from pyg_maxk.ops._launch import Launcher, _PackedLaunch, params_and_types, pointer_fields

    run = Launcher.__new__(Launcher)  # a fake driver, no GPU
    run._driver, seen = _recording_driver()
    run._multi_gpu = False
    kernel = object()
    static, t, u = torch.zeros(9, dtype=torch.int32), torch.zeros(3, 5), torch.zeros(7)
    args = (static, t, 4, u, 11)
    fields, types = params_and_types(args)
    run._packed = {(id(kernel), 2, types): _PackedLaunch(77, len(fields))}
    device = torch.device("cuda", 2)
    assert pointer_fields(args, (1, 3)) == (7 + 4, 7 + 9 + 1 + 4)
    assert Launcher.prepare(run, object(), 6, 128, device, args, (1, 3)) is None  # not launched
    launch = Launcher.prepare(run, kernel, 6, 128, device, args, (1, 3))
    t2, u2 = torch.ones(3, 5), torch.ones(7)
    launch(t2, u2)
    launch(t, u)
    assert seen == [(77, 6, 128, 1002, params_and_types((static, t2, 4, u2, 11))[0]),
                    (77, 6, 128, 1002, fields)]


def test_a_launch_is_prepared_on_the_second_call_of_its_kind():
    # A kind seen once is only marked: inputs whose kind changes on every
    # call (mini-batches of other sizes) never pay for a preparation.
    from pyg_maxk.ops import numba_ops

    plans, made = {}, []

    def prepare():
        made.append(1)
        return "prepared"

    numba_ops._remember(plans, "kind", prepare)
    assert numba_ops._prepared(plans, "kind") is None and made == []
    numba_ops._remember(plans, "kind", prepare)
    assert numba_ops._prepared(plans, "kind") == "prepared" and made == [1]
    numba_ops._remember(plans, None, prepare)  # no kind (e.g. unaligned input): not kept
    assert None not in plans and made == [1]


def test_edge_list_launches_of_one_kind_share_a_prepared_launch(monkeypatch):
    # Keyed by the flags, the ints and the tensors' shapes and types: the
    # second call of a kind prepares it, later calls of that kind patch every
    # tensor given (fresh ones: a new graph of the same size) in order, and
    # another size, int or flag takes the full path. A fake launcher, no GPU.
    from pyg_maxk.ops import numba_ops

    calls = []

    class FakeLauncher:
        def __call__(self, kernel, blocks, threads, device, *args):
            calls.append(("full", kernel, args))

        def prepare(self, kernel, blocks, threads, device, args, variable):
            return lambda *tensors: calls.append(("prepared", kernel, tensors))

        def max_blocks(self, device, threads):
            return 4

    monkeypatch.setattr(numba_ops, "launcher", FakeLauncher)
    monkeypatch.setattr(numba_ops, "_PLANS", {})
    device = torch.device("cpu")

    def launch(kind, n=5, extra=3, dtype=torch.float32):
        a, b = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=torch.int32)
        numba_ops._flat_launch_of_kind(kind, lambda: kind, n, device, (a, extra, b))
        return a, b

    for _ in range(2):
        launch(("k", True))
    a, b = launch(("k", True))
    assert [c[0] for c in calls] == ["full", "full", "prepared"]
    assert calls[-1][2][0] is a and calls[-1][2][1] is b
    for changed in (dict(n=6), dict(extra=4), dict(dtype=torch.float64)):
        launch(("k", True), **changed)
        assert calls[-1][0] == "full", changed
    launch(("k", False))
    assert calls[-1][0] == "full" and calls[-1][1] == ("k", False)


def test_bindings_launch_hands_the_packed_buffer_to_the_driver():
    # Through cuda.bindings: the kernel's CUfunction, the stream wrapped as a
    # CUstream, no kernelParams, and the address of the packed buffer's
    # "extra" array (a fake driver module stands in for the GPU's).
    from types import SimpleNamespace

    from pyg_maxk.ops._launch import _bindings_launch, _PackedLaunch

    seen = []

    def cu_launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        seen.append((function, gx, gy, gz, bx, by, bz, shared, stream, params, extra))
        return (0,)

    driver = SimpleNamespace(cuLaunchKernel=cu_launch_kernel,
                             CUstream=lambda ptr: ("stream", ptr),
                             CUfunction=lambda handle: ("function", handle))
    packed = _PackedLaunch(77, 3, driver.CUfunction(77))
    assert _bindings_launch(driver)(packed, 4, 128, 1234) == 0
    assert seen == [(("function", 77), 4, 1, 1, 128, 1, 1, 0, ("stream", 1234), 0,
                     packed.extra_address)]


def test_linear_grid_is_one_wave_of_resident_blocks(monkeypatch):
    # The CBSR linear kernel's blocks all have the same work, so its grid is
    # what the SMs hold at once: limited by threads or by shared memory (plus
    # the 1 KiB the driver reserves per block). H200-like properties here.
    from types import SimpleNamespace

    from pyg_maxk.kernels.linear import linear_shared_bytes
    from pyg_maxk.ops._launch import Launcher

    props = SimpleNamespace(multi_processor_count=132, max_threads_per_multi_processor=2048,
                            shared_memory_per_multiprocessor=228 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    run = Launcher.__new__(Launcher)  # no driver needed for the arithmetic
    run.simulator, run._resident = False, {}
    device = torch.device("cuda", 0)
    assert linear_shared_bytes(256, 32, 8) == 34816
    assert run.resident_blocks(device, 256, 34816) == 132 * 6   # by shared memory
    assert run.resident_blocks(device, 256, 1024) == 132 * 8    # by threads
    assert run.resident_blocks(device, 1024, 200_000) == 132    # at least one per SM


def test_forward_rows_are_padded_unless_that_costs_a_group():
    # (groups, row stride) of the SpGEMM forward: rows one float apart in
    # shared memory (popular columns of different groups in different banks)
    # unless the padding leaves room for fewer groups.
    from pyg_maxk.kernels.spgemm import ROW_PAD, SHARED_BYTES, group_rows

    assert group_rows(32, 256, 4, width=4) == (4, 256 + ROW_PAD)
    assert group_rows(8, 256, 4) == (4, 256 + ROW_PAD)
    assert group_rows(16, 512, 4, width=2) == (4, 512 + ROW_PAD)
    assert group_rows(2, 256, 4) == (11, 256)  # padded, only 10 fit
    assert group_rows(3, SHARED_BYTES // 4 + 1, 4)[0] == 0  # not even one row


def test_index_words_and_fallbacks():
    # The kernels read 2 or 4 indices per load as one integer word, when the
    # arrays are aligned to it; else (or for int32 indices) one per load.
    from pyg_maxk.ops.numba_ops import _index_operand

    idx = torch.randint(0, 200, (6, 32), dtype=torch.uint8)
    values = torch.randn(6 * 32)
    words, width, bits = _index_operand(idx, 4, values)
    assert (words.dtype, width, bits) == (torch.int32, 4, 8)
    assert torch.equal(words.view(torch.uint8).view(6, 32), idx)
    assert _index_operand(idx.to(torch.int16), 2, values)[0].dtype == torch.int32
    assert _index_operand(idx.to(torch.int16), 4, values)[0].dtype == torch.int64
    assert _index_operand(idx.to(torch.int32), 4, values)[1:] == (1, 32)
    assert _index_operand(idx, 4, torch.randn(6 * 32 + 1)[1:])[1] == 1  # values off by 4 bytes
    assert _index_operand(torch.zeros(6 * 32 + 1, dtype=torch.uint8)[1:], 4, values)[1] == 1
    assert _index_operand(idx, 1, values)[1] == 1


def test_value_index_pairs():
    # The forward's (value, index) pairs (built by a kernel: on the GPU, or
    # the simulator's CPU tensors): float32 values beside their column
    # indices (as float32), for k up to PAIRS_MAX_K.
    from pyg_maxk.kernels.spgemm import PAIRS_MAX_K, reads_pairs
    from pyg_maxk.ops.numba_ops import value_index_pairs

    device = "cuda" if torch.cuda.is_available() else "cpu"

    assert reads_pairs(1) and reads_pairs(PAIRS_MAX_K) and not reads_pairs(PAIRS_MAX_K + 1)
    for index_dtype in (torch.uint8, torch.int16, torch.int32):
        values = torch.randn(5, 3, device=device)
        high = 300 if index_dtype != torch.uint8 else 256
        idx = torch.randint(0, high, (5, 3)).to(device, index_dtype)
        pairs = value_index_pairs(values, idx)
        assert pairs.shape == (5, 3, 2) and pairs.dtype == torch.float32
        assert torch.equal(pairs[..., 0], values)
        assert torch.equal(pairs[..., 1].long(), idx.long())
    # Half values: one int32 word per slot, the value's bits below the index.
    assert reads_pairs(2 * PAIRS_MAX_K, half=True) and not reads_pairs(2 * PAIRS_MAX_K + 1, True)
    for dtype in (torch.float16, torch.bfloat16):
        values = torch.randn(5, 3).to(device, dtype)
        idx = torch.randint(0, 300, (5, 3)).to(device, torch.int16)
        words = value_index_pairs(values, idx)
        assert words.shape == (5, 3) and words.dtype == torch.int32
        assert torch.equal((words & 0xFFFF).to(torch.int16).view(dtype), values)
        assert torch.equal(words >> 16, idx.int())

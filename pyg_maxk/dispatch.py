"""Which implementation runs each MaxK op: the one home of that decision.

Backends:

* ``"torch"``: pure PyTorch (CPU and CUDA). It is the semantics oracle: MaxK is
  :func:`torch.topk`, the aggregation a ``torch.sparse`` CSR product.
* ``"numba"``: the Numba CUDA kernels of :mod:`pyg_maxk.kernels`. It needs CUDA
  tensors, or CPU tensors under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``).
* ``"cpu"``: Numba's parallel CPU kernels (:mod:`pyg_maxk.kernels.cpu`;
  float32/float64 CPU tensors).
* ``"auto"`` (default): per op, the fastest implementation that takes the
  input (below), else ``"torch"``.

Select one with :func:`use_backend` (a context manager, per thread and per
:mod:`contextvars` context) or the ``PYG_MAXK_BACKEND`` environment variable.

One precision switch, off by default: :func:`allow_half_reductions` lets the
``"numba"`` backward reduce a half-precision gradient in its own type
(faster, each running sum rounded; see its docs).

The rules, per op (``select``: MaxK; ``densify``: CBSR to dense;
``aggregate``: CSR x CBSR and its backward; ``linear``: CBSR x dense weight
and its backward):

* A forced backend runs its own implementation of every op, or raises a
  :class:`BackendError` that names the reason and the fix; it never falls
  back silently.
* ``"auto"`` takes the Numba kernels for float32/float16/bfloat16 CUDA
  tensors where they take the shape, the CPU kernels for float32/float64 CPU
  tensors (select: rows up to :data:`MAX_CPU_SELECT_DIM` wide), and
  ``"torch"`` for the rest.
* The linear kernels also need one float type throughout; the ``"numba"``
  linear kernel runs in float32 only, from :data:`LINEAR_MIN_ROWS` rows and
  where it beats densify + GEMM (:func:`~pyg_maxk.kernels.linear.linear_pays`).
  Elsewhere the linear map densifies (with the backend's densify) and calls
  cuBLAS/MKL: the ``"torch"`` variant of the op.

* Under :func:`torch.use_deterministic_algorithms`, the aggregation (whose
  Numba kernels add in float atomics, so the order of each sum varies from
  run to run) takes ``"torch"``'s implementation, which sums in a fixed
  order on every device (see :func:`float_atomics_allowed`); ``"auto"``
  picks it, a forced ``"numba"`` raises :class:`BackendError` (with
  ``warn_only=True`` it warns once per op and shape, and runs its kernels).
  The other ops' kernels write each output once: they stay as chosen.

A decision depends only on the requested backend, the device type, the
dtypes, the shape parameters (``dim``, ``k``, whether the rows reach a
threshold) and torch's deterministic-algorithms setting, and is computed
once per such key. The custom ops take the
*requested* backend as a string argument and decide inside their
implementation, at run time, where every size is a plain int: so a compiled
graph guards only on the requested backend (a change recompiles), never on
sizes, and the backward, which gets the same string, runs the forward's
implementation on whatever thread autograd runs it.
"""
from __future__ import annotations

import contextvars
import os
import warnings
from typing import Dict, Optional, Tuple

import torch

BACKENDS = ("auto", "torch", "numba", "cpu")
OPS = ("select", "densify", "aggregate", "linear")
ENV_VAR = "PYG_MAXK_BACKEND"

#: Feature types the Numba kernels take (they accumulate in float32).
NUMBA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Feature types the CPU kernels take (they compute in that type).
CPU_DTYPES = (torch.float32, torch.float64)
#: Widest rows the Numba select kernel takes (each lane holds dim / 32 keys in
#: registers); up to this width it beats :func:`torch.topk` for every k
#: (``benchmarks/kernels.py``).
MAX_SELECT_DIM = 1024
#: Widest rows the CPU select kernel takes (its counts are exact below).
MAX_CPU_SELECT_DIM = (1 << 24) - 1
#: Rows from which ``"auto"`` runs the Numba CBSR linear kernel; below, the
#: host-bound dense path is as fast (small graphs are bound by host time).
LINEAR_MIN_ROWS = 1 << 15
#: Rows below which the CPU adds a root term on the dense form (see
#: :func:`dense_root_pays`).
DENSE_ROOT_MAX_CPU_ROWS = 2048
#: Multiply-adds of a dense linear map (``rows * dim * out``) from which the
#: CPU linear kernels run a linear map of MaxK's output (see
#: :func:`cbsr_linear_pays`).
CBSR_LINEAR_MIN_CPU_WORK = 1 << 24

_requested: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "pyg_maxk_backend", default=None)


#: The override most recently set or restored on any thread. Dynamo cannot
#: read a ContextVar, so compiled code reads this plain global instead (and
#: guards on it: a change of backend recompiles); eager code reads the
#: ContextVar, per thread and context.
_traced_override: Optional[str] = None


HALF_REDUCTIONS_ENV_VAR = "PYG_MAXK_HALF_REDUCTIONS"
_half_reductions: Optional[bool] = None  # None: the environment variable decides


def allow_half_reductions(enabled: bool = True) -> None:
    """Allow (or forbid again) reduced-precision reductions in the backward
    of the aggregation under half precision, as
    ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``
    does for matrix products. Off by default (or ``$PYG_MAXK_HALF_REDUCTIONS``
    set to ``1``), process-wide.

    When allowed, the ``"numba"`` backend computes the gradient of
    bfloat16/float16 CBSR values (``k`` a multiple of 8, sm_90 and later)
    with packed half-precision atomic additions: 8 slots per 16-byte
    reduction instead of 4 float32 ones, which halves the reduction traffic
    that binds this kernel (``benchmarks/kernels.py --half-reductions``). Each
    addition rounds the running sum to the half type, so an entry summed
    over ``d`` edges is rounded ``d`` times instead of once: its error is
    at most about ``(d + 1) * u * sum|terms|`` (``u`` = 2**-8 for bfloat16,
    2**-11 for float16) instead of about ``u * |sum|``, largest on hub rows
    (``benchmarks/README.md`` gives the measured errors). float16 sums can overflow
    where a float32 sum would not. Float32 training is unaffected. A CUDA
    graph keeps the kernels it captured: change the setting before capturing.
    """
    global _half_reductions
    _half_reductions = bool(enabled)


def half_reductions_allowed() -> bool:
    """Whether :func:`allow_half_reductions` is in effect."""
    if _half_reductions is not None:
        return _half_reductions
    return os.environ.get(HALF_REDUCTIONS_ENV_VAR, "0").strip().lower() in ("1", "true", "yes")


class BackendError(RuntimeError):
    """A forced backend cannot run an op on its input."""


def _check(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise ValueError(f"Unknown pyg_maxk backend {name!r}; choose one of "
                         f"{', '.join(repr(b) for b in BACKENDS)}")
    return name.lower()


def get_backend() -> str:
    """The backend asked for: the innermost :func:`use_backend`, else
    ``$PYG_MAXK_BACKEND``, else ``"auto"``."""
    name = _traced_override if torch.compiler.is_compiling() else _requested.get()
    if name is not None:
        return name
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            return _check(env)
        except ValueError as err:
            raise ValueError(f"${ENV_VAR}: {err}") from None
    return "auto"


class use_backend:
    """Run the enclosed code with the given backend (this thread/context only).

    .. code-block:: python

        with pyg_maxk.use_backend("torch"):
            out = model(x, edge_index)

    Also a decorator. Under ``torch.compile`` a change of backend recompiles.
    """

    def __init__(self, name: str) -> None:
        self.name = _check(name)
        self._tokens: list = []

    def __enter__(self) -> "use_backend":
        global _traced_override
        self._tokens.append(_requested.set(self.name))
        _traced_override = self.name
        return self

    def __exit__(self, *exc) -> None:
        global _traced_override
        _requested.reset(self._tokens.pop())
        _traced_override = _requested.get()

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with use_backend(self.name):
                return fn(*args, **kwargs)
        return wrapped


def choose(op: str, tensor: torch.Tensor, *, dim: int = 0, k: int = 0,
           uniform: bool = True, large: bool = True, requested: Optional[str] = None) -> str:
    """The concrete backend (``"torch"``, ``"numba"`` or ``"cpu"``) of ``op``
    on data like ``tensor``.

    Args:
        op: one of :data:`OPS`.
        tensor: the op's main input (device and dtype).
        dim, k: the CBSR's width and entries per row.
        uniform: (``linear``) whether every operand has ``tensor``'s dtype.
        large: (``linear``) whether there are :data:`LINEAR_MIN_ROWS` rows.
        requested: the backend asked for (default: :func:`get_backend`).
    """
    return choose_on(op, tensor.device.type, tensor.dtype, dim=dim, k=k, uniform=uniform,
                     large=large, requested=requested)


def choose_on(op: str, device_type: str, dtype: torch.dtype, *, dim: int = 0, k: int = 0,
              uniform: bool = True, large: bool = True, requested: Optional[str] = None) -> str:
    """:func:`choose` for data of ``dtype`` on a device of ``device_type``
    (``"cuda"``, ``"cpu"``), without a tensor at hand."""
    if requested is None:
        requested = get_backend()
    key = (op, requested, device_type, dtype, int(dim), int(k), bool(uniform), bool(large),
           _determinism())
    decision = _DECISIONS.get(key)
    if decision is None:
        decision = _DECISIONS[key] = _decision(*key)
    return decision


def maxk_aggregate_kernels(device_type: str, dtype: torch.dtype, dim: int, k: int,
                           requested: str) -> Optional[str]:
    """The kernels that run every step of ``maxk_aggregate`` (the select,
    the aggregation, the densify and their backward) on data of ``dtype`` on
    a device of ``device_type``: ``"numba"`` (float32 only; its select launch
    then also takes the dropout, the dense form and the zero-fills of the
    aggregation and of its backward), ``"cpu"``, or None where the steps take
    different backends."""
    return _one_family(("select", "aggregate", "densify"), device_type, dtype, dim, k,
                       requested)


def maxk_input_grad_kernels(device_type: str, dtype: torch.dtype, dim: int, k: int,
                            requested: str) -> Optional[str]:
    """:func:`maxk_aggregate_kernels` for its backward alone (the SSpMM and
    the densify of the features' gradient, no select)."""
    return _one_family(("aggregate", "densify"), device_type, dtype, dim, k, requested)


def _one_family(steps: Tuple[str, ...], device_type: str, dtype: torch.dtype, dim: int, k: int,
                requested: str) -> Optional[str]:
    """The backend that runs all of ``steps`` where one does and has fused
    kernels for them on ``dtype`` ("numba" in float32, "cpu"), else None."""
    key = (steps, requested, device_type, dtype, int(dim), int(k), _determinism())
    decision = _DECISIONS.get(key, False)
    if decision is False:
        chosen = {choose_on(op, device_type, dtype, dim=dim, k=k, requested=requested)
                  for op in steps}
        decision = chosen.pop() if len(chosen) == 1 else None
        if decision == "torch" or (decision == "numba" and dtype != torch.float32):
            decision = None
        _DECISIONS[key] = decision
    return decision


#: The ops whose Numba CUDA kernels add in float atomics (the order of each
#: sum varies between runs): the aggregation, its backward, its edge values'
#: gradient and the edge-list aggregation.
ATOMIC_OPS = ("aggregate",)
_DETERMINISTIC, _WARN_ONLY = 1, 2


def _determinism() -> int:
    """0 where torch's deterministic algorithms are off, else
    :data:`_DETERMINISTIC` or (``warn_only=True``) :data:`_WARN_ONLY`."""
    if not torch.are_deterministic_algorithms_enabled():
        return 0
    return _WARN_ONLY if torch.is_deterministic_algorithms_warn_only_enabled() else _DETERMINISTIC


def float_atomics_allowed() -> bool:
    """Whether sums may run in an order that varies between runs (float
    atomics): not under :func:`torch.use_deterministic_algorithms`, where
    the ops take fixed-order implementations (see the module docs)."""
    return not torch.are_deterministic_algorithms_enabled()


def resolve_backend(tensor: torch.Tensor) -> str:
    """The backend the aggregation would take for data like ``tensor`` at
    any shape the kernels take (used to label runs)."""
    return choose("aggregate", tensor, dim=32, k=8)


def dense_root_pays(tensor: torch.Tensor) -> bool:
    """Whether a conv adds its root term (a multiple of MaxK of ``tensor``)
    on the dense form, densified with the aggregation (fewer launches and
    autograd nodes: a small graph's step is bound by them), rather than
    scattered from the CBSR (fewer bytes): on a GPU below
    :data:`LINEAR_MIN_ROWS` rows, on the CPU below
    :data:`DENSE_ROOT_MAX_CPU_ROWS`."""
    limit = DENSE_ROOT_MAX_CPU_ROWS if tensor.device.type == "cpu" else LINEAR_MIN_ROWS
    return tensor.size(0) < limit


def root_loops_pay(tensor: torch.Tensor) -> bool:
    """Whether GIN's root term (at ``eps = 0``) runs as one self-loop per node
    of the graph (one sum, no dense root term to add nor its autograd node)
    rather than as :func:`dense_root_pays` says: wherever the dense root
    pays (small graphs, whose steps are bound by ops and nodes)."""
    return dense_root_pays(tensor)


def cbsr_linear_pays(tensor: torch.Tensor, dim: int, k: int, out: int) -> bool:
    """Whether a linear map ``dim -> out`` of MaxK's output (``k`` of ``dim``
    entries kept per row of ``tensor``) runs better as a CBSR linear op than
    as stock's dense linear map of the dense form. From
    :data:`LINEAR_MIN_ROWS` rows, always. On the CPU, where its kernels run
    it, also from :data:`CBSR_LINEAR_MIN_CPU_WORK` multiply-adds of the dense
    map: they do ``k / dim`` of them, but below that the step is bound by the
    op's fixed costs (its transposed weight, five kernels forward and
    backward against three GEMMs). Elsewhere a small step is bound by host
    time, of which torch's own autograd nodes spend less."""
    rows = tensor.size(0)
    if rows >= LINEAR_MIN_ROWS:
        return True
    # The device first: a GPU layer's trace under torch.compile then never
    # reaches the backend probe (Numba's driver checks are not traceable).
    return (tensor.device.type == "cpu" and rows * dim * out >= CBSR_LINEAR_MIN_CPU_WORK
            and choose("linear", tensor, dim=dim, k=k, large=False) == "cpu")


_DECISIONS: Dict[Tuple, object] = {}


def clear_decisions() -> None:
    """Forget every cached decision (after a threshold is changed, in tests)."""
    _DECISIONS.clear()


def _decision(op, requested, device_type, dtype, dim, k, uniform, large, determinism) -> str:
    decision = _decision_of_setting(op, requested, device_type, dtype, dim, k, uniform, large)
    if decision != "numba" or not determinism or op not in ATOMIC_OPS:
        return decision
    if requested == "auto":
        return "torch"
    message = (f"pyg_maxk backend 'numba' runs {op!r} with float atomic additions, whose "
               f"order (and so the rounding of each sum) varies between runs, and "
               f"torch.use_deterministic_algorithms(True) is set. Use backend 'auto' or "
               f"'torch' (fixed-order sums), or warn_only=True to run the kernels anyway.")
    if determinism == _DETERMINISTIC:
        raise BackendError(message)
    warnings.warn(message, UserWarning, stacklevel=3)
    return decision


def _decision_of_setting(op, requested, device_type, dtype, dim, k, uniform, large) -> str:
    """The decision with torch's deterministic algorithms off."""
    if op not in OPS:
        raise ValueError(f"Unknown pyg_maxk op {op!r}")
    if requested == "torch":
        return "torch"
    on_cuda = device_type == "cuda"
    if requested == "cpu":
        if on_cuda or dtype not in CPU_DTYPES:
            raise BackendError(
                f"pyg_maxk backend 'cpu' takes float32/float64 CPU tensors, got {dtype} "
                f"on {device_type}. Use backend 'auto' (it picks per device and dtype) "
                f"or 'torch'.")
        if op == "select" and dim > MAX_CPU_SELECT_DIM:
            raise BackendError(
                f"pyg_maxk backend 'cpu' selects in rows up to {MAX_CPU_SELECT_DIM} wide, "
                f"got {dim}. Use backend 'auto' (torch.topk there) or 'torch'.")
        return _cpu_decision(op, dtype, uniform)
    if requested == "numba" or on_cuda:
        reason = _numba_cannot(op, device_type, dtype, dim, k)
        if reason:
            if requested == "auto":
                return "torch"
            raise BackendError(f"pyg_maxk backend 'numba' cannot run {op!r}: {reason}")
        if op == "linear" and not (large and _linear_kernel_takes(dtype, dim, k, uniform)
                                   and _linear_pays(dim, k)):
            # The numba backend's linear map is then densify + GEMM (the GEMM
            # wins outside the kernel's range; the densify is still numba's).
            return "torch"
        return "numba"
    if dtype in CPU_DTYPES and _numba_importable() and not (
            op == "select" and dim > MAX_CPU_SELECT_DIM):
        return _cpu_decision(op, dtype, uniform)
    return "torch"


def _cpu_decision(op: str, dtype: torch.dtype, uniform: bool) -> str:
    if op == "linear" and not uniform:
        return "torch"  # the CPU linear kernels take one float type throughout
    return "cpu"


def _numba_importable() -> bool:
    from .kernels import numba_status
    return numba_status().importable


def _linear_pays(dim: int, k: int) -> bool:
    from .kernels.linear import linear_pays
    return linear_pays(dim, k)


def _linear_kernel_takes(dtype: torch.dtype, dim: int, k: int, uniform: bool) -> bool:
    """Whether the Numba linear kernel (float32 throughout, a ``W^T`` tile in
    shared memory) takes this input."""
    from .kernels import geometry
    return uniform and dtype == torch.float32 and geometry.takes_linear(dim, k)


def _numba_cannot(op: str, device_type: str, dtype: torch.dtype, dim: int, k: int) -> str:
    """Why the ``"numba"`` backend cannot run ``op`` here ('' when it can)."""
    from .kernels import numba_status

    status = numba_status()
    if dtype not in NUMBA_DTYPES:
        return (f"its kernels compute in float32 and take float32, float16 or bfloat16 "
                f"tensors, got {dtype}. Use backend 'auto' or 'torch' for {dtype}.")
    if device_type == "cuda":
        if not status.cuda_available:
            return f"{status.reason}. Use backend 'auto' or 'torch'."
    elif not status.simulator:
        return (f"it needs CUDA tensors, got tensors on {device_type}. Move the model "
                f"and data to a GPU, use backend 'auto' or 'cpu' on the CPU, or set "
                f"NUMBA_ENABLE_CUDASIM=1 (before the first import of numba) to run the "
                f"kernels in Numba's simulator.")
    from .kernels import geometry

    if op == "select" and dim > MAX_SELECT_DIM:
        return (f"the select kernel takes rows up to {MAX_SELECT_DIM} wide, got {dim}. "
                f"Use backend 'auto' (torch.topk there) or 'torch'.")
    if op == "densify" and not geometry.takes_densify(dim):
        return (f"rows of width {dim} do not fit the densify kernel's shared memory. "
                f"Use backend 'auto' (a scatter there) or 'torch'.")
    if op == "aggregate" and not geometry.takes_aggregation(k, dim):
        return (f"rows of width {dim} (k={k}) do not fit the SpGEMM's shared memory. "
                f"Use backend 'auto' (torch.sparse there) or 'torch'.")
    return ""

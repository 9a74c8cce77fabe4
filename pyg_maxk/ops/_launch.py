"""Launching the Numba kernels on torch tensors with little host cost.

The first launch of a kernel specialisation goes through Numba (which
compiles it, and wraps every tensor through the CUDA Array Interface,
re-deriving its type for every array argument). Later launches skip Numba:
the kernel's arguments are packed into one parameter buffer (one per
kernel specialisation, reused by its launches), in the layout
Numba's kernels take them (an array is ``meminfo, parent, nitems, itemsize,
data, shape..., strides...``, an integer an int64: all 8-byte fields), and
handed to the driver's ``cuLaunchKernel`` on the caller's current torch
stream, through NVIDIA's ``cuda.bindings`` where installed (a compiled call)
or ctypes (which converts each argument on every call). A launch through
Numba's own dispatch builds one argument object per field through
``cuda.core``'s ``launch`` and looks the context up on every call; this
path derives the kernel's key and the fields in one pass and packs them in
place into the buffer of that specialisation, with no fresh ctypes array per
launch (``benchmarks/overhead.py`` measures the host time per op).

If any piece is missing (neither ``cuda.bindings`` nor ``libcuda``, another
numba-cuda internal API), every launch takes Numba's path, which gives the
same results.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import struct
import threading
import warnings
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ..kernels import cuda_module, simulator_enabled

#: Grid-stride blocks per multiprocessor (for 128-thread blocks).
BLOCKS_PER_SM = 16

_CU_LAUNCH_PARAM_END = 0
_CU_LAUNCH_PARAM_BUFFER_POINTER = 1
_CU_LAUNCH_PARAM_BUFFER_SIZE = 2
_CUDA_ERROR_INVALID_CONTEXT = 201


def kernel_params(args) -> list:
    """The 8-byte fields a Numba kernel takes for ``args`` (C-contiguous
    tensors and Python ints), in order."""
    return params_and_types(args)[0]


def params_and_types(args) -> Tuple[list, tuple]:
    """:func:`kernel_params` of ``args`` and the argument types that select a
    compiled kernel (a tensor's dtype and number of dimensions; ``int``), in
    one pass over ``args`` (1-D and 2-D tensors, what the kernels take,
    without generic loops)."""
    fields, types = [], []
    for a in args:
        if not isinstance(a, Tensor):
            fields.append(int(a))
            types.append(int)
            continue
        size = a.element_size()
        shape = a.shape
        ndim = len(shape)
        if ndim == 1:
            n = shape[0]
            fields.extend((0, 0, n, size, a.data_ptr(), n, a.stride(0) * size))
        elif ndim == 2:
            rows, cols = shape
            row_stride, col_stride = a.stride()
            fields.extend((0, 0, rows * cols, size, a.data_ptr(), rows, cols,
                           row_stride * size, col_stride * size))
        else:
            fields.extend((0, 0, a.numel(), size, a.data_ptr(), *shape,
                           *[s * size for s in a.stride()]))
        types.append((a.dtype, ndim))
    return fields, tuple(types)


class _PackedLaunch:
    """One compiled kernel's driver handle and a parameter buffer reused by
    every launch of it: the argument types in the launcher's key fix the
    number of fields, so only their values are packed per launch (building a
    fresh ctypes array of ~75 fields cost more than the rest of a launch).
    ``function`` is the handle as the driver binding takes it."""

    __slots__ = ("handle", "function", "packer", "buffer", "size", "extra", "extra_address")

    def __init__(self, handle: int, num_fields: int, function=None) -> None:
        self.handle = handle
        self.function = handle if function is None else function
        self.packer = struct.Struct(f"={num_fields}q")
        self.buffer = (ctypes.c_int64 * num_fields)()
        self.size = ctypes.c_size_t(ctypes.sizeof(self.buffer))
        self.extra = (ctypes.c_void_p * 5)(
            _CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(self.buffer),
            _CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(self.size), _CU_LAUNCH_PARAM_END)
        self.extra_address = ctypes.addressof(self.extra)


def ctypes_launch(cu_launch_kernel: Callable) -> Callable:
    """A launch through a ctypes-like ``cuLaunchKernel`` (the driver's C
    signature): ``launch(packed, blocks, threads, stream) -> CUresult``."""
    def launch(packed: _PackedLaunch, blocks: int, threads: int, stream: int) -> int:
        return cu_launch_kernel(packed.function, blocks, 1, 1, threads, 1, 1, 0, stream, None,
                                packed.extra)
    return launch


def _bindings_launch(driver) -> Callable:
    """A launch through NVIDIA's Python driver bindings (``cuda.bindings``):
    a compiled call with no per-argument ctypes conversions."""
    cu_launch_kernel, stream_of = driver.cuLaunchKernel, driver.CUstream
    streams: dict = {}  # raw stream -> its binding object, built once

    def launch(packed: _PackedLaunch, blocks: int, threads: int, stream: int) -> int:
        handle = streams.get(stream)
        if handle is None:
            handle = streams[stream] = stream_of(stream)
        (err,) = cu_launch_kernel(packed.function, blocks, 1, 1, threads, 1, 1, 0, handle, 0,
                                  packed.extra_address)
        return int(err)
    return launch


class _DriverLaunch:
    """``cuLaunchKernel`` with a packed parameter buffer: through
    ``cuda.bindings`` where it is installed, else ctypes."""

    def __init__(self, launch: Callable, raw_stream: Callable[[int], int],
                 function_of: Callable[[int], object] = int) -> None:
        self._launch = launch
        self._raw_stream = raw_stream
        self._function_of = function_of
        # The driver copies the buffer at launch; the lock keeps another
        # thread from repacking it in between.
        self._lock = threading.Lock()

    @classmethod
    def create(cls) -> Optional["_DriverLaunch"]:
        try:
            raw_stream = torch._C._cuda_getCurrentRawStream
        except AttributeError:  # pragma: no cover - a torch without CUDA
            return None
        try:
            from cuda.bindings import driver
            return cls(_bindings_launch(driver), raw_stream, driver.CUfunction)
        except (ImportError, AttributeError):
            pass
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        except (OSError, AttributeError):  # pragma: no cover - no driver library
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        return cls(ctypes_launch(fn), raw_stream)

    def prepare(self, compiled, num_fields: int) -> Optional[_PackedLaunch]:
        """The packed launch of a compiled Numba kernel taking ``num_fields``
        parameter fields, or None where its driver handle is not reachable."""
        try:
            handle = int(compiled._codelibrary.get_cufunc().handle)
        except (AttributeError, TypeError, ValueError):  # pragma: no cover
            return None
        return _PackedLaunch(handle, num_fields, self._function_of(handle))

    def __call__(self, packed: _PackedLaunch, blocks: int, threads: int, index: int,
                 fields: list) -> None:
        with self._lock:
            packed.packer.pack_into(packed.buffer, 0, *fields)
            err = self._launch_on(packed, blocks, threads, index)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {err}")

    def patched(self, packed: _PackedLaunch, pointers: Tuple[int, ...], tensors, blocks: int,
                threads: int, index: int) -> None:
        """Launch ``packed`` with the data pointers of ``tensors`` written
        at the fields ``pointers`` of its buffer (the rest as packed)."""
        with self._lock:
            buffer = packed.buffer
            for field, t in zip(pointers, tensors):
                buffer[field] = t.data_ptr()
            err = self._launch_on(packed, blocks, threads, index)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {err}")

    def _launch_on(self, packed: _PackedLaunch, blocks: int, threads: int, index: int) -> int:
        err = self._launch(packed, blocks, threads, self._raw_stream(index))
        if err == _CUDA_ERROR_INVALID_CONTEXT:
            torch.cuda.set_device(index)  # a thread without a current context
            err = self._launch(packed, blocks, threads, self._raw_stream(index))
        return err


class PreparedLaunch:
    """One kernel launch prepared for repeated calls: its grid and its
    parameter buffer are packed once, and a call writes only the data
    pointers of the tensors that change between calls (``variable`` when
    prepared) before the driver's launch. Each tensor passed must have the
    shape, strides and type of the one it replaces; the other tensors it
    was prepared with must outlive it (their pointers stay in the buffer).
    What an op on a small graph, bound by host time, launches with."""

    __slots__ = ("_launcher", "_packed", "_pointers", "_blocks", "_threads", "_index")

    def __init__(self, launcher: "Launcher", packed: _PackedLaunch, pointers: Tuple[int, ...],
                 blocks: int, threads: int, index: int) -> None:
        self._launcher, self._packed, self._pointers = launcher, packed, pointers
        self._blocks, self._threads, self._index = blocks, threads, index

    def __call__(self, *tensors: Tensor) -> None:
        run = self._launcher
        if run._multi_gpu:
            with run._on(self._index):
                run._driver.patched(self._packed, self._pointers, tensors, self._blocks,
                                    self._threads, self._index)
        else:
            run._driver.patched(self._packed, self._pointers, tensors, self._blocks,
                                self._threads, self._index)


def pointer_fields(args, variable) -> Tuple[int, ...]:
    """The positions, among the parameter fields of ``args``, of the data
    pointers of the tensors at ``variable`` (positions in ``args``)."""
    starts = []
    at = 0
    for a in args:
        starts.append(at)
        at += 5 + 2 * a.dim() if isinstance(a, Tensor) else 1
    return tuple(starts[i] + 4 for i in variable)


class Launcher:
    """Launches Numba kernels on torch tensors: grid sizes, the caller's
    stream, the fast path of the module docs."""

    def __init__(self) -> None:
        self.cuda = cuda_module()
        self.simulator = simulator_enabled()
        self._streams: dict = {}
        self._num_sms: dict = {}
        self._packed: dict = {}
        self._resident: dict = {}
        self._driver = None if self.simulator else _DriverLaunch.create()
        self._multi_gpu = not self.simulator and torch.cuda.device_count() > 1

    def max_blocks(self, device: torch.device, threads: int) -> int:
        """Blocks of a grid-stride launch: enough to fill every SM."""
        if self.simulator:
            return 2
        index = device_index(device)
        sms = self._num_sms.get(index)
        if sms is None:
            props = torch.cuda.get_device_properties(index)
            sms = self._num_sms[index] = props.multi_processor_count
        return sms * max(1, BLOCKS_PER_SM * 128 // threads)

    def resident_blocks(self, device: torch.device, threads: int, shared_bytes: int) -> int:
        """Blocks of ``threads`` threads and ``shared_bytes`` of shared memory
        that all SMs hold at once: a grid of exactly that many runs in one
        wave (blocks of equal work then finish together)."""
        if self.simulator:
            return 2
        key = (device_index(device), threads, shared_bytes)
        blocks = self._resident.get(key)
        if blocks is None:  # once per shape: the layers ask on every forward
            props = torch.cuda.get_device_properties(key[0])
            per_sm_shared = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
            by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
            # The driver reserves 1 KiB of shared memory per block.
            by_shared = per_sm_shared // (shared_bytes + 1024)
            blocks = props.multi_processor_count * max(1, min(by_threads, by_shared))
            self._resident[key] = blocks
        return blocks

    def __call__(self, kernel, blocks: int, threads: int, device: torch.device, *args) -> None:
        """``kernel[blocks, threads, current stream](*args)``; ``args`` are
        C-contiguous tensors and Python ints."""
        index = None if self.simulator else device_index(device)
        fields, types = params_and_types(args)
        key = (id(kernel), index, types)
        packed = self._packed.get(key)
        if packed is not None:
            if self._multi_gpu:
                with self._on(index):
                    self._driver(packed, blocks, threads, index, fields)
            else:
                self._driver(packed, blocks, threads, index, fields)
            return
        with self._on(index), self._numba_device(index), _no_occupancy_warnings():
            arrays = [self._array(a) if isinstance(a, Tensor) else a for a in args]
            kernel[blocks, threads, self._stream(device)](*arrays)
            if self._driver is not None:
                numba_types = tuple(kernel.typeof_pyval(a) for a in arrays)
                self._packed[key] = self._driver.prepare(kernel.overloads[numba_types],
                                                         len(fields))

    def prepare(self, kernel, blocks: int, threads: int, device: torch.device, args,
                variable) -> Optional[PreparedLaunch]:
        """A :class:`PreparedLaunch` of ``kernel[blocks, threads](*args)``
        whose tensors at the positions ``variable`` change per call; None
        where launches take Numba's path, or before a first launch of this
        specialisation (which compiles it)."""
        if self._driver is None:
            return None
        index = device_index(device)
        fields, types = params_and_types(args)
        shared = self._packed.get((id(kernel), index, types))
        if shared is None:
            return None
        packed = _PackedLaunch(shared.handle, len(fields), shared.function)
        packed.packer.pack_into(packed.buffer, 0, *fields)
        return PreparedLaunch(self, packed, pointer_fields(args, variable), blocks, threads,
                              index)

    # ----------------------------------------------------------- Numba's path
    def _array(self, t: Tensor):
        t = t.detach()
        if self.simulator:
            return t.numpy()
        return self.cuda.as_cuda_array(t, sync=False)

    def _stream(self, device: torch.device):
        if self.simulator:
            return 0
        ptr = torch.cuda.current_stream(device).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = self.cuda.external_stream(ptr)
        return stream

    def _on(self, index: Optional[int]):
        """The tensors' device as torch's current one (multi-GPU only)."""
        if not self._multi_gpu or index == torch.cuda.current_device():
            return contextlib.nullcontext()
        return torch.cuda.device(index)

    def _numba_device(self, index: Optional[int]):
        """Numba launches on its current device; make it the tensors'."""
        if not self._multi_gpu:
            return contextlib.nullcontext()
        return self.cuda.gpus[index]


@contextlib.contextmanager
def _no_occupancy_warnings():
    """Numba warns when a grid has fewer blocks than a large GPU has SMs; the
    kernels size their grids to the work, so on a small graph that warning
    would reach the user with nothing to act on. (Matched by its text: its
    class moved between numba and numba-cuda.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*will likely result in GPU under-utilization")
        yield


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current one when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def launcher() -> Launcher:
    return Launcher()

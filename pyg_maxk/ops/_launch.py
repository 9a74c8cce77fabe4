"""Launching the Numba kernels on torch tensors with little host cost.

The first launch of a kernel specialisation goes through Numba (which
compiles it, and wraps every tensor through the CUDA Array Interface,
re-deriving its type: ~0.1 ms per array argument). Later launches skip Numba:
the kernel's arguments are packed into one parameter buffer, in the layout
Numba's kernels take them (an array is ``meminfo, parent, nitems, itemsize,
data, shape..., strides...``, an integer an int64: all 8-byte fields), and
handed to the driver's ``cuLaunchKernel`` on the caller's current torch
stream. Measured on an H200 host, a launch through Numba's own dispatch
(``cuda.core``'s ``launch`` with one argument object per field, and a context
lookup per call) costs 40-65 us of Python; the packed buffer a few us.

If any piece is missing (no ``libcuda``, another numba-cuda internal API),
every launch takes Numba's path, which gives the same results.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Callable, Optional

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
    fields = []
    for a in args:
        if isinstance(a, Tensor):
            size = a.element_size()
            fields += (0, 0, a.numel(), size, a.data_ptr(), *a.shape,
                       *[s * size for s in a.stride()])
        else:
            fields.append(int(a))
    return fields


class _DriverLaunch:
    """``cuLaunchKernel`` through ctypes with a packed parameter buffer."""

    def __init__(self, cu_launch_kernel, raw_stream: Callable[[int], int]) -> None:
        self._launch = cu_launch_kernel
        self._raw_stream = raw_stream

    @classmethod
    def create(cls) -> Optional["_DriverLaunch"]:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
            raw_stream = torch._C._cuda_getCurrentRawStream
        except (OSError, AttributeError):  # pragma: no cover - no driver library
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        return cls(fn, raw_stream)

    @staticmethod
    def handle_of(compiled) -> Optional[int]:
        """The driver handle of a compiled Numba kernel, or None."""
        try:
            return int(compiled._codelibrary.get_cufunc().handle)
        except (AttributeError, TypeError, ValueError):  # pragma: no cover
            return None

    def __call__(self, handle: int, blocks: int, threads: int, index: int, args) -> None:
        fields = kernel_params(args)
        buf = (ctypes.c_int64 * len(fields))(*fields)
        size = ctypes.c_size_t(ctypes.sizeof(buf))
        extra = (ctypes.c_void_p * 5)(_CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buf),
                                      _CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size),
                                      _CU_LAUNCH_PARAM_END)
        for attempt in range(2):
            err = self._launch(handle, blocks, 1, 1, threads, 1, 1, 0,
                               self._raw_stream(index), None, extra)
            if err != _CUDA_ERROR_INVALID_CONTEXT or attempt:
                break
            torch.cuda.set_device(index)  # a thread without a current context
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {err}")


class Launcher:
    """Launches Numba kernels on torch tensors: grid sizes, the caller's
    stream, the fast path of the module docs."""

    def __init__(self) -> None:
        self.cuda = cuda_module()
        self.simulator = simulator_enabled()
        self._streams: dict = {}
        self._num_sms: dict = {}
        self._handles: dict = {}
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
            sms = self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
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
        key = (id(kernel), index) + tuple((a.dtype, a.dim()) if isinstance(a, Tensor) else int
                                          for a in args)
        handle = self._handles.get(key)
        if handle is not None:
            with self._on(index):
                self._driver(handle, blocks, threads, index, args)
            return
        with self._on(index), self._numba_device(index):
            arrays = [self._array(a) if isinstance(a, Tensor) else a for a in args]
            kernel[blocks, threads, self._stream(device)](*arrays)
            if self._driver is not None:
                types = tuple(kernel.typeof_pyval(a) for a in arrays)
                self._handles[key] = self._driver.handle_of(kernel.overloads[types])

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


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current one when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def launcher() -> Launcher:
    return Launcher()

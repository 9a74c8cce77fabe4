"""The on-disk cache of the compiled CUDA kernels.

A new process would otherwise compile every kernel it launches again (seconds
on the first training step). Numba-cuda can store a compiled kernel beside its
source (``cuda.jit(cache=True)``), but it checks only the modification time
of the file that defines the kernel: a kernel built from device functions and
intrinsics of other modules (``_half``, ``_vector``, ``_warp``) could be
loaded stale after one of those changed. This cache is therefore keyed by the
whole kernel package:

* **Directory:** ``<root>/kernels-<digest>``, where the digest hashes the
  bytes of every module of :mod:`pyg_maxk.kernels` and the Numba and
  numba-cuda versions. Changed kernel code never finds an old directory.
* **Entry:** numba-cuda's own index key, per kernel: the argument types, the
  CUDA runtime version and the GPU's compute capability (another GPU never
  loads a binary compiled for this one), and hashes of the kernel's bytecode
  and of its closure (the specialisation constants and the device functions,
  pickled by value).
* **Files:** one file per entry, named by a hash of its key and holding the
  key, written to a temporary name and renamed into place; a load checks the
  key it finds. Numba's own layout (an index per function mapping keys to
  numbered files) numbers a new entry from the index it read: two processes
  compiling two specialisations of one kernel at once (the ranks of a DDP
  job, test workers) both take the next number, and one of them later loads
  the other's kernel -- a wrong kernel, silently. The CPU kernels keep
  Numba's own cache (``njit(cache=True)``, stamped by their file) in this
  layout too (:func:`keyed_files`).
* **Root:** ``$PYG_MAXK_KERNEL_CACHE`` if set, else
  ``$XDG_CACHE_HOME/pyg_maxk`` (``~/.cache/pyg_maxk``). Set the variable to
  ``0`` to compile in every process. Deleting the directory is always safe.

An unwritable root, or a numba-cuda without the cache classes used here,
leaves the kernels uncached (compiled per process), never wrong.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import uuid
from pathlib import Path
from typing import Optional

#: Environment variable: the cache root, or ``0`` to disable the cache.
CACHE_ENV = "PYG_MAXK_KERNEL_CACHE"
_KERNEL_DIR = Path(__file__).resolve().parent


def cache_root() -> Optional[Path]:
    """The cache's root directory, or None where the cache is disabled."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip() in ("", "0") else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pyg_maxk"


def sources_digest(kernel_dir: Path = _KERNEL_DIR) -> str:
    """A hash of every module of the kernel package and of the Numba
    versions: the part of a cache entry's identity that a file stamp would
    miss."""
    import numba

    try:
        from numba_cuda import __version__ as numba_cuda_version
    except ImportError:  # pragma: no cover - numba's bundled CUDA target
        numba_cuda_version = "bundled"
    digest = hashlib.sha256(f"{numba.__version__}|{numba_cuda_version}".encode())
    for path in sorted(kernel_dir.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


@functools.lru_cache(maxsize=None)
def cache_dir() -> Optional[Path]:
    """``<root>/kernels-<digest>`` for this process (None: disabled)."""
    root = cache_root()
    return None if root is None else root / f"kernels-{sources_digest()}"


@functools.lru_cache(maxsize=None)
def _cache_class():
    """numba-cuda's kernel cache, located in :func:`cache_dir` and stamped
    with the package digest; None where this numba-cuda lacks its classes."""
    try:
        from numba.cuda.core.caching import _CacheLocator
        from numba.cuda.dispatcher import CUDACache, CUDACacheImpl
    except ImportError:  # pragma: no cover - another numba-cuda layout
        return None

    class PackageLocator(_CacheLocator):
        def __init__(self, py_func, py_file):
            self._lineno = py_func.__code__.co_firstlineno
            self._path = str(cache_dir())

        def get_cache_path(self):
            return self._path

        def get_source_stamp(self):
            return sources_digest()

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            locator = cls(py_func, py_file)
            try:
                locator.ensure_cache_path()
            except OSError:
                return None
            return locator

    class PackageCacheImpl(CUDACacheImpl):
        _locator_classes = [PackageLocator]

    class PackageCache(CUDACache):
        _impl_class = PackageCacheImpl

        def __init__(self, py_func):
            super().__init__(py_func)
            self._cache_file = _keyed(self._cache_file, keyed_cache_file_class())

    return PackageCache


def keyed_files(dispatcher):
    """Give a CPU kernel (``numba.njit(cache=True)``, Numba's own cache and
    locator) the same one-file-per-entry layout. Returns the dispatcher."""
    cache = getattr(dispatcher, "_cache", None)
    files = getattr(cache, "_cache_file", None)
    if files is not None and hasattr(files, "_index_name"):
        from numba.core.caching import IndexDataCacheFile
        cache._cache_file = _keyed(files, keyed_cache_file_class(IndexDataCacheFile))
    return dispatcher


def _keyed(files, keyed_class):
    """``files`` (Numba's ``IndexDataCacheFile`` of one function) in
    ``keyed_class``'s layout: the same directory, names and source stamp."""
    return keyed_class(files._cache_path, files._index_name[:-len(".nbi")],
                       files._source_stamp)


@functools.lru_cache(maxsize=None)
def keyed_cache_file_class(base=None):
    """The cache's file layout (see **Files** above): Numba's
    ``IndexDataCacheFile`` (numba-cuda's, or ``base``) with one
    self-describing file per key."""
    if base is None:
        from numba.cuda.core.caching import IndexDataCacheFile as base

    class KeyedCacheFile(base):
        def _identity(self, key) -> str:
            return f"{self._source_stamp}|{key!r}"

        def _entry_name(self, key) -> str:
            digest = hashlib.sha256(self._identity(key).encode()).hexdigest()[:32]
            return self._data_name_pattern.replace("{number:d}", digest)

        def save(self, key, data):
            self._save_data(self._entry_name(key), (self._identity(key), data))

        def load(self, key):
            try:
                identity, data = self._load_data(self._entry_name(key))
            except (OSError, EOFError, ValueError, TypeError, pickle.UnpicklingError):
                return None  # absent, or cut short: compile again
            return data if identity == self._identity(key) else None

    return KeyedCacheFile


def attach_cache(dispatcher):
    """Give a ``cuda.jit`` kernel dispatcher the package's on-disk cache
    (where it is enabled and can be written). Returns the dispatcher."""
    cls = _cache_class() if cache_dir() is not None else None
    if cls is not None:
        try:
            dispatcher._cache = cls(dispatcher.py_func)
        except RuntimeError:  # no writable cache directory: stay uncached
            pass
    return dispatcher


def stable_identity(intrinsic, *key):
    """Give a Numba intrinsic the same identity in every process. A kernel's
    cache entry hashes its closure, intrinsics included, and an intrinsic
    pickles with a UUID that is otherwise random per process (so a cached
    kernel would never be found again). ``key``: the factory arguments that
    tell this intrinsic apart from its siblings. Returns the intrinsic."""
    defn = intrinsic._defn
    name = f"pyg_maxk:{defn.__module__}.{defn.__qualname__}:{key!r}"
    try:
        intrinsic._set_uuid(str(uuid.uuid5(uuid.NAMESPACE_OID, name)))
    except (AttributeError, AssertionError):  # pragma: no cover - already set
        pass
    return intrinsic

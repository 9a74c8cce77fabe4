"""The on-disk cache of compiled CUDA kernels (:mod:`pyg_maxk.kernels._cache`).

Without a GPU nothing compiles, but everything that decides whether a new
process finds an entry can be checked: a kernel's closure (its part of the
entry's key) hashes the same in every process, the directory follows the
kernel sources, and the switches work. The GPU test that a second process
loads the kernels instead of compiling them is in ``test_gpu.py``.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyg_maxk.kernels import _cache

ROOT = Path(__file__).resolve().parents[1]

# Builds one kernel of every factory (not compiled: no GPU needed) and prints,
# per kernel, the cache it got and the hash numba-cuda gives its closure.
PROBE = r"""
import hashlib, json
from numba.cuda.serialize import dumps
from pyg_maxk.kernels import linear, maxk_select, spgemm

kernels = {
    "spgemm": spgemm.spgemm_kernel(256, 32, 256, True, width=4),
    "spgemm-pairs-bf16": spgemm.spgemm_kernel(256, 16, 256, True, pairs=True, half="bf16"),
    "spgemm-fp16": spgemm.spgemm_kernel(128, 8, 256, False, scaled=True, width=2, half="fp16"),
    "sspmm": spgemm.sspmm_kernel(256, 32, 256, True),
    "sddmm": spgemm.sddmm_kernel(256, 32, 256, width=2),
    "select": maxk_select.select_kernel(256, 32, 4, redux=True),
    "select-bf16": maxk_select.select_kernel(256, 32, 4, half="bf16"),
    "densify": maxk_select.densify_kernel(256, 32, 4, bits16=True),
    "linear": linear.linear_kernel(256, 32, 64, 4, True),
}
out = {}
for name, kernel in kernels.items():
    cells = tuple(c.cell_contents for c in kernel.py_func.__closure__ or ())
    out[name] = [type(kernel._cache).__name__, kernel._cache.cache_path,
                 hashlib.sha256(dumps(cells)).hexdigest(),
                 type(getattr(kernel._cache, "_cache_file", None)).__name__]
print(json.dumps(out))
"""


def probe(cache_env: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(PYG_MAXK_KERNEL_CACHE=cache_env, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kernel_keys_are_the_same_in_every_process(tmp_path):
    first, second = probe(str(tmp_path)), probe(str(tmp_path))
    assert first == second  # the closure hashes included: a new process finds the entries
    for cache_class, path, _, file_class in first.values():
        assert cache_class == "PackageCache" and file_class == "KeyedCacheFile"
        assert Path(path).parent == tmp_path and Path(path).name.startswith("kernels-")
    hashes = [h for _, _, h, _ in first.values()]
    assert len(set(hashes)) == len(hashes)  # each specialisation has its own key


# Saves 40 entries of one kernel (one cache file set) under keys of its own,
# in the files of the CUDA kernels or (argv[3] == "cpu") of the CPU ones.
WRITER = r"""
import sys
from pyg_maxk.kernels import _cache
base = ()
if sys.argv[3] == "cpu":
    from numba.core.caching import IndexDataCacheFile
    base = (IndexDataCacheFile,)
entries = _cache.keyed_cache_file_class(*base)(sys.argv[1], "kernel-7", "stamp")
worker = int(sys.argv[2])
for i in range(40):
    entries.save(("signature", worker, i), ("binary", worker, i))
"""


def _file_class(target):
    if target == "cpu":  # Numba's own cache classes, as the CPU kernels use
        from numba.core.caching import IndexDataCacheFile
        return _cache.keyed_cache_file_class(IndexDataCacheFile)
    return _cache.keyed_cache_file_class()


@pytest.mark.parametrize("target", ["cuda", "cpu"])
@pytest.mark.slow
def test_processes_saving_one_kernel_at_once_never_load_each_others_entries(tmp_path, target):
    # Numba's numbered files let two processes that compile specialisations
    # of one kernel at once take the same file: later, one loads the other's.
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(w), target],
                                env=env, cwd=ROOT) for w in range(4)]
    assert [w.wait(timeout=300) for w in writers] == [0] * 4
    entries = _file_class(target)(str(tmp_path), "kernel-7", "stamp")
    for w in range(4):
        for i in range(40):
            assert entries.load(("signature", w, i)) == ("binary", w, i)
    assert entries.load(("signature", 9, 0)) is None
    # A file that holds another key's entry (as under numba's layout) is not loaded.
    shutil.copy(Path(tmp_path) / entries._entry_name(("signature", 0, 0)),
                Path(tmp_path) / entries._entry_name(("signature", 9, 0)))
    assert entries.load(("signature", 9, 0)) is None
    # Another source stamp (changed kernels) finds nothing.
    stale = _file_class(target)(str(tmp_path), "kernel-7", "other")
    assert stale.load(("signature", 0, 0)) is None


# Runs the CPU backend's top-k selection and prints its kernel's cache
# statistics and file layout.
CPU_PROBE = r"""
import json, torch, pyg_maxk
from pyg_maxk.kernels import cpu
with pyg_maxk.use_backend("cpu"):
    h = pyg_maxk.maxk(torch.randn(50, 16), 4)
stats = cpu.select_rows.stats
print(json.dumps([type(cpu.select_rows._cache._cache_file).__name__,
                  sum(stats.cache_hits.values()), sum(stats.cache_misses.values())]))
"""


@pytest.mark.slow
def test_cpu_kernels_load_from_their_cache_in_a_new_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))

    def run():
        proc = subprocess.run([sys.executable, "-c", CPU_PROBE], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold[0] == warm[0] == "KeyedCacheFile"
    assert cold[1] == 0 and cold[2] >= 1  # compiled, then saved
    assert warm[1] >= 1 and warm[2] == 0  # loaded from its file


@pytest.mark.slow
def test_cache_can_be_switched_off(tmp_path):
    for _, path, _, _ in probe("0").values():
        assert path is None  # numba-cuda's NullCache: compiled in every process


@pytest.mark.slow
def test_unwritable_root_leaves_kernels_uncached(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for cache_class, path, _, _ in probe(str(blocker / "cache")).values():
        assert cache_class == "NullCache" and path is None


def test_directory_follows_every_kernel_module(tmp_path):
    copy = tmp_path / "kernels"
    shutil.copytree(Path(_cache.__file__).parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = _cache.sources_digest(copy)
    assert _cache.sources_digest(copy) == before
    helper = copy / "_vector.py"  # not a kernel's own file: a file stamp would miss it
    helper.write_text(helper.read_text() + "\n# changed\n")
    assert _cache.sources_digest(copy) != before


@pytest.mark.parametrize("value, expected", [("0", None), ("", None), ("/x/y", Path("/x/y"))])
def test_cache_root_from_environment(monkeypatch, value, expected):
    monkeypatch.setenv(_cache.CACHE_ENV, value)
    assert _cache.cache_root() == expected


def test_default_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv(_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _cache.cache_root() == tmp_path / "pyg_maxk"

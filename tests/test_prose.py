"""Prose for today's reader: measurements live in ``benchmarks/`` (its README
and JSON), not in docstrings, comments or the design doc, where they would
go stale with the next kernel change."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A number followed by a time unit: ``3.2 ms``, ``40-65 us``, ``19µs``.
TIMING = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:ms|us|µs)\b")
#: A test count as pytest prints it: ``522 passed``.
TEST_COUNT = re.compile(r"\b\d+ (?:passed|failed|skipped)\b")


def _prose_files():
    yield from sorted((ROOT / "pyg_maxk").rglob("*.py"))
    yield from sorted(p for p in (ROOT / "tests").glob("*.py")
                      if p.name != Path(__file__).name)  # its examples are timings
    yield from sorted((ROOT / "docs").rglob("*.md"))


def _matches(pattern, paths):
    return [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in paths
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if pattern.search(line)]


def test_the_timing_pattern():
    for text in ("3.2 ms", "takes 40-65 us of", "19µs", "(118 against 92 us)"):
        assert TIMING.search(text), text
    for text in ("f'{t:.2f} ms'", "items", "4 columns", "the bus", "1e-5 atol"):
        assert not TIMING.search(text), text


def test_no_timings_outside_benchmarks():
    assert _matches(TIMING, _prose_files()) == []


def test_readme_states_no_test_counts():
    assert _matches(TEST_COUNT, [ROOT / "README.md"]) == []

"""The README's commands are the ones CI runs, and the CLI works offline."""
import re
from pathlib import Path

from pyg_maxk.app.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _bash_blocks(text):
    return re.findall(r"```bash\n(.*?)\n```", text, re.S)


def test_ci_runs_the_readme_test_command():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    test_command = next(b for b in blocks if "pytest" in b)
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_main_job_is_the_cli():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert any(b.endswith("pyg-maxk train --compare") for b in blocks)


def test_cli_train_compare(capsys):
    assert main(["train", "--compare", "--epochs", "3", "--dataset", "cora-like",
                 "--scale", "0.2", "--hidden", "16"]) == 0
    out = capsys.readouterr().out
    assert "stock ReLU" in out and out.strip().splitlines()[-1].startswith("summary:")


def _table_rows(text, header_start):
    """The body rows of the markdown table whose header begins ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _ms(cell):
    return float(cell.split()[0])


def _paired(p):
    """A paired speedup as the README writes it: ``1.08x (1.05-1.10)``."""
    return f"{p['speedup']:.2f}x ({p['ci95'][0]:.2f}-{p['ci95'][1]:.2f})"


def test_readme_compile_results_are_the_committed_json():
    import json
    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks/results/train-compile.json").read_text())
    models = results["workloads"]["cora"]["models"]
    rows = _table_rows(readme, "| model | stock `reduce-overhead` | MaxK `reduce-overhead`")
    assert [r[0] for r in rows] == ["SAGE", "GCN", "GIN"]
    for row in rows:
        entry = models[row[0].lower()]
        side = {label: t["median_ms"] for label, t in entry["interleaved"].items()}
        stock = {label: ms for label, ms in side.items() if label.startswith("stock")}
        fastest = min(stock, key=stock.get)
        assert fastest == "stock captured step", fastest  # the column the table names
        compiled = entry["maxk"]["32 compiled reduce-overhead"]["paired_speedup_interleaved"]
        captured = entry["maxk"]["32 captured step"]["vs_fastest_stock_interleaved"]
        assert captured["form"] == "captured step"
        expected = [side["stock compiled reduce-overhead"],
                    side["maxk k=32 compiled reduce-overhead"]]
        assert [_ms(c) for c in row[1:3]] == [round(v, 2) for v in expected], row
        assert row[3] == _paired(compiled["compiled reduce-overhead"]), row
        expected = [stock[fastest], side["maxk k=32 captured step"]]
        assert [_ms(c) for c in row[4:6]] == [round(v, 2) for v in expected], row
        assert row[6] == _paired(captured["paired"]), row
    first = json.loads((ROOT / "benchmarks/results/first_step.json").read_text())["variants"]
    sentence = " ".join(readme.split())
    variants = ("eager", "default", "reduce-overhead")
    cold = [f"{first[v]['cold']['first_step_s']:.1f} s" for v in variants]
    assert f"{cold[0]} eager, {cold[1]} compiled and {cold[2]} with" in sentence, cold
    warm = " / ".join(f"{first[v]['warm']['first_step_s']:.1f}" for v in variants)
    assert f"and {warm} s in the next process" in sentence, warm
    epochs = {round(first[v]["warm"]["median_ms"]) for v in variants}
    assert len(epochs) == 1 and f"later epochs {epochs.pop()} ms" in sentence

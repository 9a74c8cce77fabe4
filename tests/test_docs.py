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


def test_readme_compile_results_are_the_committed_json():
    import json
    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks/results/train-compile.json").read_text())
    models = results["workloads"]["cora"]["models"]
    rows = _table_rows(readme, "| model | MaxK eager | stock eager `edge_index`")
    assert [r[0] for r in rows] == ["SAGE", "GCN", "GIN"]
    for row in rows:
        side = {label: t["median_ms"] for label, t in models[row[0].lower()]["interleaved"].items()}
        stock = {label: ms for label, ms in side.items() if label.startswith("stock")}
        fastest = min(stock, key=stock.get)
        assert fastest == "stock compiled reduce-overhead", fastest  # the column the table names
        maxk = side["maxk k=32 compiled reduce-overhead"]
        expected = [side["maxk k=32"], side["stock edge_index"], stock[fastest], maxk]
        assert [_ms(c) for c in row[1:5]] == [round(v, 2) for v in expected], row
        assert _ms(row[5].rstrip("x")) == round(stock[fastest] / maxk, 2), row
    first = json.loads((ROOT / "benchmarks/results/first_step.json").read_text())["variants"]
    sentence = " ".join(readme.split())
    variants = ("eager", "default", "reduce-overhead")
    cold = [f"{first[v]['cold']['first_step_s']:.1f} s" for v in variants]
    assert f"{cold[0]} eager, {cold[1]} compiled and {cold[2]} with" in sentence, cold
    warm = " / ".join(f"{first[v]['warm']['first_step_s']:.1f}" for v in variants)
    assert f"and {warm} s in the next process" in sentence, warm
    epochs = {round(first[v]["warm"]["median_ms"]) for v in variants}
    assert len(epochs) == 1 and f"later epochs {epochs.pop()} ms" in sentence

"""The README's commands are the ones CI runs, and the CLI works offline."""
import re
from pathlib import Path

from pyg_maxk.cli import main

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

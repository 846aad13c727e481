"""Issue 21: ``qcore eval --tasks`` run outside a git checkout prints no "fatal: not a git repository" (lm-eval
runs ``git describe`` with the terminal's stderr to record a commit hash; qcore runs it quietly). Marker
``lm_eval``; skipped without lm_eval or git."""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported; conftest sets HF_HUB_OFFLINE

import shutil  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from qcore.cli import main  # noqa: E402

from test_lm_eval import TASK_YAML, char_tokenizer  # noqa: E402

pytestmark = pytest.mark.lm_eval


def test_eval_tasks_outside_git_prints_no_git_error(zoo, tmp_path, monkeypatch, capfd):
    if shutil.which("git") is None:
        pytest.skip("git is not installed: nothing to silence")
    model = zoo.tiny_llama()
    model.config.max_position_embeddings = 256
    model.save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git looks no higher: surely outside a checkout
    raw = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True)
    assert raw.returncode != 0 and "fatal:" in raw.stderr  # what lm-eval's own call prints here
    capfd.readouterr()
    assert main(["eval", "--model", str(tmp_path / "m"), "--tasks", str(TASK_YAML), "--limit", "2",
                 "--no-progress"]) == 0
    out, err = capfd.readouterr()
    assert "acc" in out
    assert "fatal:" not in err and "not a git repository" not in err, err
    import lm_eval.evaluator as ev
    assert ev.get_git_commit_hash.__module__ == "lm_eval.loggers.utils"  # lm-eval's own function is restored

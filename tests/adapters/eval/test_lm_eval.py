"""``qcore eval --tasks``: lm-evaluation-harness tasks on a tiny random Llama with a character tokenizer, offline.

The task is tests/data/lm_eval_tasks/python_basics.yaml (12 multiple-choice questions, documents in the JSONL
file beside it). Skipped when lm_eval is not installed (pip install lm-eval); marker ``lm_eval``.
"""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported; conftest sets HF_HUB_OFFLINE

import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from qcore.adapters.eval import lm_eval_tasks as LT  # noqa: E402
from qcore.cli import main  # noqa: E402

pytestmark = pytest.mark.lm_eval

TASK_DIR = pathlib.Path(__file__).resolve().parents[2] / "data" / "lm_eval_tasks"
TASK_YAML = TASK_DIR / "python_basics.yaml"
DOCS = [json.loads(line) for line in (TASK_DIR / "python_basics.jsonl").read_text().splitlines()]


def char_tokenizer():
    """One token per printable ASCII character (and newline): 99 ids, within the tiny models' 128."""
    from tokenizers import Tokenizer, decoders, models
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\n": 3}
    vocab.update({chr(i): len(vocab) for i in range(32, 127)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, zoo):
    """The seed-0 tiny Llama (positions up to 256, so that no prompt is truncated) with its tokenizer."""
    model = zoo.tiny_llama()
    model.config.max_position_embeddings = 256  # rotary positions: the weights do not depend on it
    d = tmp_path_factory.mktemp("tiny_llama_tok")
    model.save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return d


def _metrics(out: str) -> dict:
    """{metric: value} of the table's rows (``    acc   0.2500 +- 0.1306 ...``)."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s+(acc\w*)\s+([0-9.]+)", out, re.M)}


def _reference_accuracy(model, tok, docs) -> tuple[float, float]:
    """acc and acc_norm computed here, without lm-evaluation-harness: the choice with the highest sum of log
    probabilities of its tokens after ``Question: ...\\nAnswer:`` (acc_norm: divided by its length in characters)."""
    acc = acc_norm = 0
    for d in docs:
        ctx = f"Question: {d['question']}\nAnswer:"
        n_ctx = len(tok(ctx)["input_ids"])
        lls = []
        for choice in d["choices"]:
            ids = torch.tensor(tok(ctx + " " + choice)["input_ids"])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)
            lls.append(sum(logp[i - 1, ids[i]].item() for i in range(n_ctx, len(ids))))
        acc += max(range(len(lls)), key=lambda i: lls[i]) == d["answer"]
        acc_norm += max(range(len(lls)), key=lambda i: lls[i] / len(d["choices"][i])) == d["answer"]
    return acc / len(docs), acc_norm / len(docs)


def test_tasks_from_a_local_yaml_give_the_accuracy_of_the_model(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # data_files is relative to the YAML's folder, not to the working directory
    argv = ["eval", "--model", str(model_dir), "--tasks", str(TASK_YAML), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "task qcore_python_basics  (12 documents, 0-shot)" in out and "perplexity" not in out
    got = _metrics(out)
    assert set(got) == {"acc", "acc_norm"} and all(0.0 <= v <= 1.0 for v in got.values())
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ref_acc, ref_norm = _reference_accuracy(model, tok, DOCS)
    assert got["acc"] == pytest.approx(ref_acc, abs=5e-5) and got["acc_norm"] == pytest.approx(ref_norm, abs=5e-5)
    # the same numbers again (lm-evaluation-harness seeds its own randomness)
    assert main(argv) == 0
    assert _metrics(capsys.readouterr().out) == got


def test_run_tasks_api_folder_limit_fewshot_and_a_taskset_reused(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tasks = LT.load_tasks([str(TASK_DIR)], num_fewshot=2, progress=False)  # a folder: every task defined in it
    assert tasks.names == ("qcore_python_basics",)
    first = LT.run_tasks(model, tok, tasks, limit=5, batch_size=4, progress=False)
    assert {m.metric for m in first} == {"acc", "acc_norm"}
    for m in first:
        assert m.task == "qcore_python_basics" and m.samples == 5 and m.num_fewshot == 2 and m.filter == "none"
        assert m.value in {k / 5 for k in range(6)} and m.higher_is_better is True and m.stderr is not None
    assert LT.run_tasks(model, tok, tasks, limit=5, batch_size=1, progress=False) == first
    # without few-shot examples the prompts differ: the reference computation of the other test applies
    zero = LT.run_tasks(model, tok, [str(TASK_YAML)], progress=False)
    ref_acc, _ = _reference_accuracy(model, tok, DOCS)
    assert next(m.value for m in zero if m.metric == "acc") == pytest.approx(ref_acc, abs=5e-5)
    with pytest.raises(ValueError, match="limit must be None or an int >= 1, got 0"):
        LT.run_tasks(model, tok, tasks, limit=0)
    with pytest.raises(ValueError, match="tokenizer must be"):
        LT.run_tasks(model, None, tasks)


def test_tasks_and_perplexity_together(model_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert main(["eval", "--model", str(model_dir), "--tasks", str(TASK_YAML), "--eval-text", str(text),
                 "--seq-len", "64", "--limit", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "(3 documents, 0-shot)" in out and "--limit 3" in out


def test_a_local_task_makes_no_network_connection(model_dir, tmp_path, monkeypatch):
    """Even with the network allowed (HF offline switched off), loading a task from local files connects nowhere:
    ``datasets`` would otherwise send a download-count request for the 'json' loader."""
    import socket

    import datasets.config
    import huggingface_hub.constants
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("network access in a test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    local = tmp_path / "task"
    shutil.copytree(TASK_DIR, local)
    tasks = LT.load_tasks([str(local / "python_basics.yaml")], progress=False)
    assert tasks.names == ("qcore_python_basics",) and attempts == []


def test_lm_eval_missing_is_one_line_with_the_pip_command(monkeypatch, capsys):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert main(["eval", "--tasks", str(TASK_YAML)]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install lm-eval" in err and "--tasks" in err and len(err.splitlines()) == 1
    with pytest.raises(ModuleNotFoundError, match="pip install lm-eval"):
        LT.load_tasks([str(TASK_YAML)])


def test_task_errors_are_one_line_before_the_model_loads(tmp_path, capsys):
    """No --model: an error after the tasks would load the embedded SmolLM2 (or fail on it)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    cases = [
        ([str(tmp_path / "missing.yaml")], "no such file or folder"),
        ([str(tmp_path / "empty")], "defines no lm-evaluation-harness task"),
        ([str(tmp_path / "notes.txt")], "a local task is a .yaml"),
        # a misspelled name: the built-in index and the given folder's tasks are searched, with suggestions
        ([str(TASK_DIR), "qcore_python_basic"], "is not a task lm-evaluation-harness knows (did you mean "
                                                "qcore_python_basics?); a local task is a path: a task YAML file"),
        # a hub task without a network: its documents cannot be read
        (["arc_easy"], "could not load the task or its documents"),
    ]
    for tasks, message in cases:
        assert main(["eval", "--tasks", ",".join(tasks), "--no-progress"]) == 2, tasks
        err = capsys.readouterr().err.strip()
        assert message in err and err.startswith("qcore eval: error: --tasks: ") and len(err.splitlines()) == 1, err

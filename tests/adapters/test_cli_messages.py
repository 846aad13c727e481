"""The command line speaks to command-line users (issue 33): ``--model`` specs that are not models are named for
what they are (a missing path, a safetensors file, a config.json, a hub id without a network); an empty value is
refused naming the flag; an algorithm that fails, or Ctrl-C, mid-run is one line without the advice meant for
Python callers ("reload the model", "pass resume=True"). The flag-in-context table: test_cli_flags.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qcore.adapters.jobs.common import PYTHON, CommandError, load_model, looks_like_path  # noqa: E402
from qcore.cli import main  # noqa: E402


def _one_line(capsys, command: str = "quantize") -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if not x.startswith("qcore quantize: no --output DIR given")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"qcore {command}: "), err
    return lines[0]


@pytest.mark.parametrize("spec", ["./nowhere", "~/no/such/model", "/no/such/dir", "a/b/c", "missing.gguf",
                                  "weights.safetensors", "config.json", "model.bin", "C:\\models\\m"])
def test_a_missing_path_is_no_such_file(spec, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert looks_like_path(spec)
    assert main(["quantize", "--model", spec, "--eval", "none", "--no-progress"]) == 2
    line = _one_line(capsys)
    assert f"--model {spec}: no such" in line, line
    assert "hub" not in line, line  # not reported as a bad hub id


@pytest.mark.parametrize("spec, why", [
    ("HuggingFaceTB/SmolLM2-no-such-model", "could not be loaded (it needs a network, or the HF cache holding it)"),
    ("smollm", "not a hub id (a hub id has the form owner/name"),
    ("two words", "not a hub id"),
])
def test_a_hub_id_needs_owner_name_and_a_network(spec, why, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: the hub is never asked
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert not looks_like_path(spec)
    assert main(["eval", "--model", spec, "--no-progress"]) == 2
    line = _one_line(capsys, "eval")
    assert f"--model {spec}: no such file or directory" in line and why in line, line


def test_a_safetensors_file_or_config_names_the_directory_to_give(lm_dir, tmp_path, capsys):
    st = next(lm_dir.glob("*.safetensors"))
    for f, what in ((st, "a safetensors file, not a model; give the directory that holds it and its config.json"),
                    (lm_dir / "config.json", "a model's config.json; give the directory that holds it and the "
                                              "*.safetensors weights")):
        assert main(["quantize", "--model", str(f), "--eval", "none", "--no-progress"]) == 2
        line = _one_line(capsys)
        assert f"--model {f}: {what}: {str(lm_dir)!r}" in line, line
        assert "is a directory" not in line and "not a directory" not in line
    lone = tmp_path / "lone.safetensors"
    lone.write_bytes(st.read_bytes())
    assert main(["eval", "--model", str(lone), "--no-progress"]) == 2
    line = _one_line(capsys, "eval")
    assert line.endswith("give the directory that holds it and its config.json"), line  # none here to name
    other = tmp_path / "notes.txt"
    other.write_text("x")
    with pytest.raises(CommandError, match=r"model='.*notes.txt': a file, not a model; give an HF model directory"):
        load_model(str(other), dtype=torch.float32, device="cpu", names=PYTHON)  # the Python names


def test_an_empty_value_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv, flag in ((["quantize", "--output", ""], "--output"), (["quantize", "--report="], "--report"),
                       (["quantize", "--eval-text", ""], "--eval-text"), (["eval", "--model", ""], "--model"),
                       (["convert", "src", "", "--to", "hf"], "dst"),
                       (["convert", "src", "out", "--to", "gguf", "--tokenizer-pre", ""], "--tokenizer-pre"),
                       (["imatrix", "--output", "m.gguf", "--eval-text", ""], "--eval-text")):
        assert main(argv) == 2, argv
        line = _one_line(capsys, argv[0])
        assert f"{flag} '': expected a non-empty " in line, line
    assert list(tmp_path.iterdir()) == []


def _gptq_run(lm_dir, tmp_path):
    return ["quantize", "--model", str(lm_dir), "--scheme", "w_uint4_per_group_asym", "--algo", "gptq", "--eval",
            "none", "--calib-samples", "2", "--seq-len", "32", "--eval-text", str(lm_dir.parent / "text.txt"),
            "--no-progress", "--output", str(tmp_path / "out")]


@pytest.mark.parametrize("failure", [RuntimeError("singular matrix"), KeyboardInterrupt()])
def test_a_failure_mid_algorithm_speaks_cli(failure, lm_dir, tmp_path, monkeypatch, capsys):
    from qcore.adapters.passes import sequential
    real = sequential.run_layer

    def fail_on_layer_1(layer, plans, inputs, algos, name, *a, **k):
        if name.endswith(".1"):
            raise failure
        return real(layer, plans, inputs, algos, name, *a, **k)

    monkeypatch.setattr(sequential, "run_layer", fail_on_layer_1)
    code = main(_gptq_run(lm_dir, tmp_path))
    line = _one_line(capsys)
    for python in ("reload the model", "quantizing it again", "resume=True", "=True"):
        assert python not in line, line
    if isinstance(failure, KeyboardInterrupt):
        assert code == 130 and line == "qcore quantize: interrupted", line
    else:
        assert code == 2 and line == ("qcore quantize: error: gptq failed on decoder layer 1: RuntimeError: "
                                      "singular matrix (--debug shows the traceback)"), line
    assert not (tmp_path / "out").exists()
    # Python callers keep the advice (the message, or a note on the interrupt)
    with pytest.raises(BaseException) as e:
        main([*_gptq_run(lm_dir, tmp_path), "--debug"])
    capsys.readouterr()
    said = str(e.value) + " ".join(getattr(e.value, "__notes__", []))
    assert "reload the model before quantizing it again" in said

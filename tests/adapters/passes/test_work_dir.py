"""Long runs survive interruption (``qcore.adapters.passes.checkpointing``): a layer-by-layer run given a work
directory saves its progress after each decoder layer, and a resumed run ends with the same bytes as an
uninterrupted one: killed with SIGKILL in a subprocess (GPTQ + AWQ in memory, the streamed checkpoint), or
interrupted in process (SmoothQuant, AutoSmoothQuant, AMP's sensitivities); runs that differ are refused, a
damaged last entry is detected, and ``qcore quantize`` without ``--output`` says nothing will be saved."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import stream_worker  # noqa: E402  (tests/adapters)
import work_worker  # noqa: E402

import qcore.adapters as A  # noqa: E402
from qcore.adapters.passes import checkpointing as K  # noqa: E402
from qcore.adapters.passes.amp import layer_sensitivity  # noqa: E402
from qcore.adapters.jobs.checkpoint import quantize_checkpoint  # noqa: E402
from qcore.cli import main  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def _spawn(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(HERE / "work_worker.py"), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _killed(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    return out


def _entries(work) -> int:
    return len(json.loads((pathlib.Path(work) / "manifest.json").read_text())["entries"])


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _same_files(a: pathlib.Path, b: pathlib.Path):
    fa, fb = sorted(p.name for p in a.iterdir()), sorted(p.name for p in b.iterdir())
    assert fa == fb
    for f in fa:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f"{f} differs"


def _interrupt_after(monkeypatch, k: int, cls=K.WorkDir, method="save_layer"):
    real = getattr(cls, method)
    count = {"n": 0}

    def patched(self, *a, **kw):
        real(self, *a, **kw)
        count["n"] += 1
        if count["n"] == k + 1:
            raise KeyboardInterrupt
    monkeypatch.setattr(cls, method, patched)
    return lambda: monkeypatch.setattr(cls, method, real)


def _data(n=3):
    return work_worker.batches(work_worker.conftest.VOCAB, n)


# ---------------------------------------------------------------------------------------------------------------
# killed with SIGKILL, then resumed: the same bytes
# ---------------------------------------------------------------------------------------------------------------


def test_killed_runs_resume_to_the_same_bytes(zoo, tmp_path, caplog):
    """AWQ then GPTQ in memory (killed after layer 0 of 2) and the streamed checkpoint (GPTQ with static scales
    and an fp8 KV cache, killed after layer 1 of 3), in one subprocess (the first in a forked child)."""
    src = tmp_path / "src"
    stream_worker.write_llama(src, hidden=64, intermediate=128, layers=3)
    proc = _spawn("both", tmp_path / "w_model", 0, src, tmp_path / "out", tmp_path / "w_stream", 1)
    # meanwhile, the uninterrupted runs
    ref = A.quantize_model(zoo.tiny_llama(0), work_worker.model_config(), _data(), progress=False)
    quantize_checkpoint(src, tmp_path / "ref", work_worker.stream_config(), work_worker.batches(256),
                        max_shard_size="60KB", progress=False)
    out = _killed(proc)
    assert "child: killed by signal 9" in out
    assert _entries(tmp_path / "w_model") == 1 and _entries(tmp_path / "w_stream") == 2
    assert not (tmp_path / "out").exists()  # the staging directory never became the output

    with caplog.at_level("WARNING", logger="qcore.adapters"):
        got = A.quantize_model(zoo.tiny_llama(0), work_worker.model_config(), _data(), progress=False,
                               work_dir=tmp_path / "w_model", resume=True)
        _same_state(ref, got)
        assert "resuming at layer 1 of 2" in caplog.text
        info = quantize_checkpoint(src, tmp_path / "out", work_worker.stream_config(), work_worker.batches(256),
                                   max_shard_size="60KB", progress=False, work_dir=tmp_path / "w_stream",
                                   resume=True)
        assert "resuming at layer 2 of 3" in caplog.text
    _same_files(tmp_path / "ref", tmp_path / "out")
    assert info.directory and _entries(tmp_path / "w_stream") == 3
    # bounded disk: every layer's state, the two latest carries
    assert sorted(p.name for p in (tmp_path / "w_stream").iterdir()) == [
        "carry-00001.pt", "carry-00002.pt", "layer-00000.pt", "layer-00001.pt", "layer-00002.pt", "manifest.json"]


# ---------------------------------------------------------------------------------------------------------------
# interrupted in process: the other passes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo,scheme", [("smoothquant", "w_int8_a_int8_per_tensor_sym"),
                                         ("autosmoothquant", "w_int8_a_int8_per_tensor_sym"),
                                         ("gptq", "w_mxfp4_a_mxfp4")])
def test_interrupted_scaling_passes_resume_to_the_same_weights(zoo, tmp_path, monkeypatch, caplog, algo, scheme):
    cfg = A.preset(scheme).replace(algorithms=({"name": algo},))
    ref_w: dict = {}
    ref = A.quantize_model(zoo.tiny_llama(0), cfg, _data(), progress=False, reference=ref_w)
    restore = _interrupt_after(monkeypatch, 0)
    model = zoo.tiny_llama(0)
    with pytest.raises(KeyboardInterrupt):
        A.quantize_model(model, cfg, _data(), progress=False, work_dir=tmp_path / "w", reference={})
    assert getattr(model, "_qcore_partial", False)
    restore()
    got_w: dict = {}
    with caplog.at_level("WARNING", logger="qcore.adapters"):
        got = A.quantize_model(zoo.tiny_llama(0), cfg, _data(), progress=False, reference=got_w,
                               work_dir=tmp_path / "w", resume=True)
    assert "resuming at layer 1 of 2" in caplog.text
    _same_state(ref, got)
    assert set(ref_w) == set(got_w)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)


def test_interrupted_amp_sensitivities_resume_to_the_same_values(zoo, tmp_path, monkeypatch):
    model = zoo.tiny_llama(0)
    schemes = ["w_mxfp4_a_mxfp4", "w_fp8_a_fp8"]
    ref = layer_sensitivity(model, schemes, _data(2), progress=False)
    restore = _interrupt_after(monkeypatch, 4, K._AmpWork, "add")
    with pytest.raises(KeyboardInterrupt):
        layer_sensitivity(model, schemes, _data(2), progress=False, work_dir=tmp_path / "w")
    restore()
    measured = []
    real = K._AmpWork.add
    monkeypatch.setattr(K._AmpWork, "add", lambda self, *a: (measured.append(a[:2]), real(self, *a)))
    got = layer_sensitivity(model, schemes, _data(2), progress=False, work_dir=tmp_path / "w", resume=True)
    assert got == ref  # floats compared exactly
    assert len(measured) == len(ref.units) * 2 - 5  # only what the first run had not measured


# ---------------------------------------------------------------------------------------------------------------
# refusals, damaged entries
# ---------------------------------------------------------------------------------------------------------------


def _gptq():
    return A.preset("uint4_wo_32").replace(algorithms=({"name": "gptq"},))


def test_a_different_run_is_refused_naming_the_difference(zoo, tmp_path, monkeypatch):
    restore = _interrupt_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        A.quantize_model(zoo.tiny_llama(0), _gptq(), _data(), progress=False, work_dir=tmp_path / "w")
    restore()
    before = (tmp_path / "w" / "manifest.json").read_bytes()
    cases = [(zoo.tiny_llama(1), _gptq(), _data(), "model weights"),
             (zoo.tiny_llama(0), A.preset("uint4_wo_64").replace(algorithms=({"name": "gptq"},)), _data(), "config"),
             (zoo.tiny_llama(0), _gptq(), _data(2), "calibration data")]
    for model, cfg, data, what in cases:
        w0 = model.model.layers[0].self_attn.q_proj.weight.clone()
        with pytest.raises(ValueError, match=f"holds a different run \\({what} differ"):
            A.quantize_model(model, cfg, data, progress=False, work_dir=tmp_path / "w", resume=True)
        assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, w0)  # refused before any work
    with pytest.raises(ValueError, match="holds a run .*resume it"):  # without resume: not overwritten
        A.quantize_model(zoo.tiny_llama(0), _gptq(), _data(), progress=False, work_dir=tmp_path / "w")
    assert (tmp_path / "w" / "manifest.json").read_bytes() == before
    with pytest.raises(ValueError, match="nothing to resume without work_dir"):
        A.quantize_model(zoo.tiny_llama(0), _gptq(), _data(), progress=False, resume=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no qcore run"):
        A.quantize_model(zoo.tiny_llama(0), _gptq(), _data(), progress=False, work_dir=tmp_path / "other")
    with pytest.raises(ValueError, match="no layer-by-layer algorithm"):
        A.quantize_model(zoo.tiny_llama(0), "uint4_wo_32", _data(), progress=False, work_dir=tmp_path / "x")
    src = tmp_path / "src"
    stream_worker.write_llama(src, hidden=64, intermediate=128, layers=1)
    for inside in (src / "work", tmp_path / "dst" / "work"):
        with pytest.raises(ValueError, match="work_dir=.* lies inside the source src_dir=|dst_dir=.* contains the source work_dir="):
            quantize_checkpoint(src, tmp_path / "dst", "uint4_wo_32", progress=False, work_dir=inside)
    assert not (tmp_path / "dst").exists() and not (src / "work").exists()


def test_resume_of_an_empty_or_missing_work_dir_starts_afresh(zoo, tmp_path, caplog):
    ref = A.quantize_model(zoo.tiny_llama(0), _gptq(), _data(), progress=False)
    (tmp_path / "empty").mkdir()
    for w in (tmp_path / "missing", tmp_path / "empty"):
        with caplog.at_level("WARNING", logger="qcore.adapters"):
            got = A.quantize_model(zoo.tiny_llama(0), _gptq(), _data(), progress=False, work_dir=w, resume=True)
        assert "holds no saved run: starting afresh" in caplog.text
        _same_state(ref, got)
        assert _entries(w) == 2


@pytest.mark.parametrize("damage", ["carry", "layer", "manifest_tmp"])
def test_a_damaged_last_entry_resumes_from_the_last_complete_layer(zoo, tmp_path, monkeypatch, caplog, damage):
    ref = A.quantize_model(zoo.tiny_llama(0), _gptq(), _data(), progress=False)
    restore = _interrupt_after(monkeypatch, 1)  # both layers saved
    with pytest.raises(KeyboardInterrupt):
        A.quantize_model(zoo.tiny_llama(0), _gptq(), _data(), progress=False, work_dir=tmp_path / "w")
    restore()
    w = tmp_path / "w"
    if damage == "manifest_tmp":  # a write cut short: a stray temporary file, the manifest intact
        (w / ".manifest.json.tmp-1").write_bytes(b"{\"format\": 1, \"entr")
        expect = "resuming at layer 2 of 2"
    else:
        f = w / f"{damage}-00001.pt"
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0xFF  # one flipped byte
        f.write_bytes(bytes(b))
        expect = "resuming at layer 1 of 2"
    with caplog.at_level("WARNING", logger="qcore.adapters"):
        got = A.quantize_model(zoo.tiny_llama(0), _gptq(), _data(), progress=False, work_dir=w, resume=True)
    assert expect in caplog.text
    _same_state(ref, got)


# ---------------------------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------------------------


def test_cli_work_dir_resume_and_the_nothing_saved_line(lm_dir, tmp_path, capsys):
    text = lm_dir.parent / "text.txt"
    base = ["quantize", "--model", str(lm_dir), "--scheme", "uint4_wo_32", "--eval-text", str(text), "--seq-len",
            "64", "--calib-samples", "2", "--eval", "none", "--no-progress"]
    assert main(base + ["--algo", "gptq", "--work-dir", str(tmp_path / "w"), "--output", str(tmp_path / "a")]) == 0
    assert "will not be saved" not in capsys.readouterr().err
    assert _entries(tmp_path / "w" / "algorithms") == 2
    # a finished run resumed: nothing recomputed, the same checkpoint
    assert main(base + ["--algo", "gptq", "--work-dir", str(tmp_path / "w"), "--resume", "--output",
                        str(tmp_path / "b")]) == 0
    _same_files(tmp_path / "a", tmp_path / "b")
    amp = ["--amp", "w_mxfp4_a_mxfp4,w_fp8_a_fp8", "--target-bits", "6", "--amp-samples", "1", "--algo", "gptq",
           "--work-dir", str(tmp_path / "wa")]
    no_scheme = [a for a in base if a not in ("--scheme", "uint4_wo_32")] + amp
    assert main(no_scheme + ["--output", str(tmp_path / "c")]) == 0  # AMP, then GPTQ on its mixed config
    assert (tmp_path / "wa" / "amp" / "manifest.json").is_file() and _entries(tmp_path / "wa" / "algorithms") == 2
    assert main(no_scheme + ["--resume", "--output", str(tmp_path / "d")]) == 0
    _same_files(tmp_path / "c", tmp_path / "d")
    assert main(base) == 0  # no --output: one line says so, before the run
    err = capsys.readouterr().err
    assert "qcore quantize: no --output DIR given: the quantized model will not be saved" in err
    for extra, msg in ((["--resume"], "--resume needs --work-dir DIR: there is nothing to resume without"),
                       (["--work-dir", str(tmp_path / "x")], "--work-dir .* has no layer-by-layer pass"),
                       (["--algo", "gptq", "--work-dir", str(lm_dir / "w")], "--work-dir .* the source")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("qcore quantize: error:"), err
        import re
        assert re.search(msg, err[-1]), err[-1]
    assert not (tmp_path / "x").exists() and not (lm_dir / "w").exists()


def test_fused_moe_experts_gptq_resumes_to_the_same_weights(family_model, zoo, tmp_path, monkeypatch):
    """GPTQ's QTensors of fused experts (per projection, per expert) are saved and restored with the layer."""
    import copy
    float_model = family_model("qwen3_moe")
    data = zoo.token_batches(3, seed=1, seq=12)
    ref = A.quantize_model(copy.deepcopy(float_model), _gptq(), data, progress=False)
    restore = _interrupt_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        A.quantize_model(copy.deepcopy(float_model), _gptq(), data, progress=False, work_dir=tmp_path / "w")
    restore()
    got = A.quantize_model(copy.deepcopy(float_model), _gptq(), data, progress=False, work_dir=tmp_path / "w",
                           resume=True)
    _same_state(ref, got)
    a, b = ref.get_submodule("model.layers.0.mlp.experts"), got.get_submodule("model.layers.0.mlp.experts")
    for p in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(a, p), getattr(b, p))


# ---------------------------------------------------------------------------------------------------------------
# the source changed under a saved run (issue 33)
# ---------------------------------------------------------------------------------------------------------------


def _rewrite_values(f: pathlib.Path, *, keep_times: bool = False, same: bool = False):
    """Change a safetensors file's tensor bytes in place (the header, so every name, shape and the file size,
    unchanged): the last bytes negated as float32 values; ``same``: rewritten with the same bytes (touched);
    ``keep_times``: the access and modification times put back afterwards."""
    st = f.stat()
    b = bytearray(f.read_bytes())
    if not same:
        tail = torch.frombuffer(b[-256:], dtype=torch.float32).clone()
        b[-256:] = (-tail - 0.01).numpy().tobytes()
    with open(f, "r+b") as fh:  # in place: the same inode
        fh.write(bytes(b))
    if keep_times:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("change, refused", [
    ("layer0", "layer-00000.safetensors"),            # a saved layer's shard rewritten in place
    ("layer0_keep_times", "layer-00000.safetensors"),  # ... with its mtime put back: still rehashed (ctime)
    ("outer", "outer.safetensors"),                   # the embedding / head shard, read again at every resume
    ("layer0_touched", None),                         # rewritten with the same bytes: rehashed, the same: resumed
    ("layer2", None),                                 # a layer not yet processed: read fresh, resumed
])
def test_a_resume_whose_source_changed_is_refused_naming_the_shard(tmp_path, monkeypatch, caplog, change, refused):
    """Issue 33: the streamed checkpoint fingerprinted only the source's headers and sizes, so a resume after
    the weights changed in place mixed stale layers into the output. Each saved layer now records the SHA-256
    of what it read (hashed while streaming), per shard, and a resume checks it (shards whose stat changed are
    hashed again; the outer weights are hashed as they are read again): refused naming the shard, before any
    layer runs; an unchanged or not yet processed shard resumes to the bytes of an uninterrupted run on the
    source as it is now."""
    src = tmp_path / "src"
    stream_worker.write_llama(src, hidden=64, intermediate=128, layers=3)
    cfg, data = work_worker.stream_config(), work_worker.batches(256)
    restore = _interrupt_after(monkeypatch, 1)  # layers 0 and 1 saved
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, tmp_path / "out", cfg, data, progress=False, work_dir=tmp_path / "w")
    restore()
    assert _entries(tmp_path / "w") == 2
    shard = {"outer": "outer.safetensors", "layer2": "layer-00002.safetensors"}.get(change, "layer-00000.safetensors")
    _rewrite_values(src / shard, keep_times="keep_times" in change, same="touched" in change)
    if refused:
        with pytest.raises(ValueError, match=f"the source's shard '{refused}' changed since the saved run"):
            quantize_checkpoint(src, tmp_path / "out", cfg, data, progress=False, work_dir=tmp_path / "w",
                                resume=True)
        assert not (tmp_path / "out").exists() and _entries(tmp_path / "w") == 2
        return
    quantize_checkpoint(src, tmp_path / "ref", cfg, data, progress=False)
    with caplog.at_level("WARNING", logger="qcore.adapters"):
        quantize_checkpoint(src, tmp_path / "out", cfg, data, progress=False, work_dir=tmp_path / "w", resume=True)
    assert "resuming at layer 2 of 3" in caplog.text
    _same_files(tmp_path / "ref", tmp_path / "out")


def test_the_main_job_fingerprints_the_loaded_weights(zoo, tmp_path, monkeypatch):
    """quantize_model's work directory (qcore quantize --work-dir/--resume) hashes every tensor of the model it
    was given (``digest_model``: the bytes, as loaded from the checkpoint), so a source whose weights changed in
    place loads into a model whose fingerprint differs: refused before any work."""
    m = zoo.tiny_llama(0)
    restore = _interrupt_after(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        A.quantize_model(m, _gptq(), _data(), progress=False, work_dir=tmp_path / "w")
    restore()
    changed = zoo.tiny_llama(0)
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # one value, same shapes and dtypes
    with pytest.raises(ValueError, match="holds a different run \\(model weights differ"):
        A.quantize_model(changed, _gptq(), _data(), progress=False, work_dir=tmp_path / "w", resume=True)

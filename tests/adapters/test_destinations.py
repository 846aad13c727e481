"""Never lose or corrupt data (issue 21): every writer refuses a destination that is, contains or lies inside its
source (resolved through symlinks and ``..``; with overwrite or not; before any work, nothing written, no stray
siblings); overwriting a file or a symlink replaces the target and leaves nothing behind; errors that can be known
before the work (an export the model/config cannot take, unwritable --report, missing --device, --seq-len past
the context) come before any evaluation or quantization; exports carry no local paths."""

import hashlib
import os
import pathlib
import shutil
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import qcore  # noqa: E402
import qcore.adapters as A  # noqa: E402
from qcore import _fsutil, conformance  # noqa: E402
from qcore.adapters import cli as C  # noqa: E402
from qcore.adapters.jobs import quantize as J  # noqa: E402
from qcore.adapters.jobs.convert import convert  # noqa: E402
from qcore.adapters.io.compressed_tensors import export_compressed_tensors  # noqa: E402
from qcore.adapters.io.gguf import export_gguf, export_gguf_dir  # noqa: E402
from qcore.adapters.io.gguf import from_gguf  # noqa: E402
from qcore.adapters.jobs.checkpoint import quantize_checkpoint  # noqa: E402
from qcore.cli import main  # noqa: E402

from gguf_kit import tiny_tokenizer  # noqa: E402


def _tiny(cls_name, cfg_name, seed=0, **kw):  # as conftest's factories (which another conftest.py may shadow)
    cfg = getattr(transformers, cfg_name)(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          max_position_embeddings=64, **kw)
    torch.manual_seed(seed)
    return getattr(transformers, cls_name)(cfg).eval()


def tiny_llama(seed=0):
    return _tiny("LlamaForCausalLM", "LlamaConfig", seed, intermediate_size=128, num_key_value_heads=2)


def tiny_opt(seed=0):
    return _tiny("OPTForCausalLM", "OPTConfig", seed, ffn_dim=128, word_embed_proj_dim=64, dropout=0.0,
                 attention_dropout=0.0)


def tiny_qwen2(seed=0):
    return _tiny("Qwen2ForCausalLM", "Qwen2Config", seed, intermediate_size=128, num_key_value_heads=2)

IDS = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))


def _q4_0():  # a grid GGUF holds exactly (Q4_0): GGUF conversions are lossless
    return qcore.make_spec("int4", granularity=qcore.PerGroup(32, axis=-1), scale_dtype="float16", symmetric=True)


def _quantized(seed=0):
    m = tiny_llama(seed)
    A.quantize_model(m, A.ModelConfig(A.LayerConfig(weight=_q4_0())), [IDS], progress=False)
    A.freeze(m)
    return m


def _tree(root: pathlib.Path) -> dict:
    """Every entry under root (hidden ones included, symlinks as links) -> a digest of what it is."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = pathlib.Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link->" + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """root/P/src: a quantized HF checkpoint; root/F/float: a float checkpoint; root/G/model.gguf; root/link -> P/src;
    models loaded from each (their source recorded by the loaders)."""
    root = tmp_path_factory.mktemp("dest")
    src = root / "P" / "src"
    A.export_hf(_quantized(), src, tokenizer=tiny_tokenizer())
    flt = root / "F" / "float"
    tiny_llama().save_pretrained(flt)
    tiny_tokenizer().save_pretrained(flt)
    gg = root / "G" / "model.gguf"
    export_gguf(_quantized(), gg)
    (root / "link").symlink_to(src, target_is_directory=True)
    (root / "flink").symlink_to(flt, target_is_directory=True)
    (root / "glink").symlink_to(gg.parent, target_is_directory=True)
    hf_model = A.from_pretrained(src)
    g_model = from_gguf(gg)
    return types.SimpleNamespace(root=root, src=src, flt=flt, gg=gg, hf_model=hf_model, g_model=g_model,
                                 links={src: "link", flt: "flink"})


def test_loaders_record_their_source(world):
    assert _fsutil.model_sources(world.hf_model) == [str(world.src)]
    assert _fsutil.model_sources(world.g_model) == [str(world.gg)]


# each writer: (source kind, what it writes, call(world, dst, overwrite)); the source kinds: "src" (a quantized HF
# checkpoint directory), "flt" (a float checkpoint directory), "gg" (a GGUF file)
WRITERS = {
    "convert_hf_to_gguf_dir": ("src", "dir", lambda w, d, o: convert(w.src, d, to="gguf", overwrite=o)),
    "convert_hf_to_ct": ("src", "dir", lambda w, d, o: convert(w.src, d, to="compressed-tensors", overwrite=o)),
    "convert_gguf_to_hf": ("gg", "dir", lambda w, d, o: convert(w.gg, d, to="hf", overwrite=o)),
    "quantize_checkpoint": ("flt", "dir", lambda w, d, o: quantize_checkpoint(w.flt, d, "uint4_wo_64", overwrite=o,
                                                                              progress=False)),
    "export_hf": ("src", "dir", lambda w, d, o: A.export_hf(w.hf_model, d, overwrite=o)),
    "export_hf_from_gguf": ("gg", "dir", lambda w, d, o: A.export_hf(w.g_model, d, overwrite=o)),
    "export_compressed_tensors": ("src", "dir", lambda w, d, o: export_compressed_tensors(w.hf_model, d,
                                                                                          overwrite=o)),
    "export_gguf_dir": ("src", "dir", lambda w, d, o: export_gguf_dir(w.hf_model, d, overwrite=o)),
    "export_gguf_file": ("gg", "file", lambda w, d, o: export_gguf(w.g_model, d, overwrite=o)),
    "export_onnx_dir": ("src", "dir", lambda w, d, o: _onnx().export_onnx_dir(w.hf_model, d, overwrite=o)),
    "export_onnx_file": ("src", "file", lambda w, d, o: _onnx().export_onnx(w.hf_model, d, overwrite=o)),
    "cli_quantize_output": ("flt", "dir", lambda w, d, o: _cli(
        ["quantize", "--model", str(w.flt), "--output", str(d), "--scheme", "uint4_wo_64", "--eval", "none",
         "--no-progress"] + (["--overwrite"] if o else []))),
}

# destinations overlapping each kind of source: label -> dst(world)
DIR_DSTS = {  # a directory source s
    "is": lambda w, s: s, "contains": lambda w, s: s.parent, "contains_grandparent": lambda w, s: s.parent.parent,
    "inside": lambda w, s: s / "out", "via_symlink": lambda w, s: w.root / w.links[s],
    "inside_via_symlink": lambda w, s: w.root / w.links[s] / "out", "via_dotdot": lambda w, s: s / "sub" / "..",
}
FILE_SRC_DIR_DSTS = {  # a GGUF file source s, a directory written
    "is": lambda w, s: s, "contains": lambda w, s: s.parent, "contains_grandparent": lambda w, s: s.parent.parent,
    "via_symlink": lambda w, s: w.root / "glink", "via_dotdot": lambda w, s: s.parent / "sub" / ".." / s.name,
}
DIR_SRC_FILE_DSTS = {  # a directory source s, a file written (.onnx)
    "inside": lambda w, s: s / "x.onnx", "inside_via_symlink": lambda w, s: w.root / w.links[s] / "x.onnx",
    "via_dotdot": lambda w, s: s / "sub" / ".." / "x.onnx",
}
FILE_SRC_FILE_DSTS = {  # a GGUF file source s, a file written (.gguf)
    "is": lambda w, s: s, "via_symlink": lambda w, s: w.root / "glink" / s.name,
    "via_dotdot": lambda w, s: s.parent / "sub" / ".." / s.name,
}


def _dsts(kind, writes):
    if kind == "gg":
        return FILE_SRC_DIR_DSTS if writes == "dir" else FILE_SRC_FILE_DSTS
    return DIR_DSTS if writes == "dir" else DIR_SRC_FILE_DSTS


CASES = [(name, label, o) for name, (kind, writes, _) in WRITERS.items() for label in _dsts(kind, writes)
         for o in (False, True)]


def _onnx():
    pytest.importorskip("onnx")
    from qcore.adapters.io import onnx as export_onnx
    return export_onnx


def _cli(argv):
    """The command line in-process: a refusal is one line on stderr and exit 2 (raised here as ValueError)."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    msg = err.getvalue()
    if code == 2:
        assert msg.count("\n") == 1 and "Traceback" not in msg, msg
        raise ValueError(msg)
    raise AssertionError(f"exit {code}: {msg}")


@pytest.mark.parametrize("name,label,overwrite", CASES)
def test_destination_overlapping_the_source_is_refused_before_any_work(world, name, label, overwrite, monkeypatch):
    kind, writes, call = WRITERS[name]
    src = getattr(world, kind)
    dst = _dsts(kind, writes)[label](world, src)
    before = _tree(world.root)
    # nothing expensive may run before the refusal
    _no_loading(monkeypatch)
    with pytest.raises(ValueError, match=r"(is|contains|lies inside) the source") as e:
        call(world, dst, overwrite)
    msg = str(e.value)
    assert str(src) in msg  # names the source ...
    assert os.fspath(dst) in msg  # ... and the destination as given
    assert _tree(world.root) == before  # the source intact, nothing written, no stray sibling


def test_the_issue_reproductions(tmp_path):
    """convert(SRC_DIR/model.gguf, SRC_DIR, overwrite=True) and quantize_checkpoint(P/float, P, overwrite=True)
    deleted their source."""
    src_dir = tmp_path / "SRC"
    export_gguf(_quantized(), src_dir / "model.gguf")
    p = tmp_path / "P"
    tiny_llama().save_pretrained(p / "float")
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="contains the source"):
        convert(src_dir / "model.gguf", src_dir, to="hf", overwrite=True)
    with pytest.raises(ValueError, match="contains the source"):
        quantize_checkpoint(p / "float", p, "uint4_wo_64", overwrite=True, progress=False)
    assert _tree(tmp_path) == before


def test_the_current_directory_is_never_replaced(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mine.txt").write_text("keep")
    monkeypatch.chdir(tmp_path / "work")
    before = _tree(tmp_path)
    for dst in (".", "..", str(tmp_path / "work")):
        with pytest.raises(ValueError, match="current directory"):
            conformance.export(dst, "int8", overwrite=True)
        with pytest.raises(ValueError, match="current directory"):
            A.export_hf(_quantized(), dst, overwrite=True)
    assert _tree(tmp_path) == before


# ------------------------------------------------------------------------------------------------------------
# overwriting files and symlinks: the target is replaced, the link stays, nothing is left beside
# ------------------------------------------------------------------------------------------------------------

def _siblings(*dirs):
    return sorted(n for d in dirs for n in os.listdir(d) if ".tmp-" in n or ".old-" in n)


def test_overwriting_a_symlinked_directory_replaces_its_target(tmp_path):
    real = tmp_path / "real" / "ckpt"
    real.mkdir(parents=True)
    (real / "stale.txt").write_text("old")
    link = tmp_path / "links" / "ckpt"
    link.parent.mkdir()
    link.symlink_to(real, target_is_directory=True)
    A.export_hf(_quantized(), link, overwrite=True)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real / "config.json").is_file() and not (real / "stale.txt").exists()
    assert _siblings(real.parent, link.parent) == []


@pytest.mark.parametrize("writer", ["gguf", "onnx"])
def test_overwriting_a_symlinked_file_replaces_its_target(tmp_path, writer):
    real = tmp_path / "real" / f"m.{writer}"
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / f"m.{writer}"
    link.symlink_to(real)
    m = _quantized()
    if writer == "gguf":
        export_gguf(m, link, overwrite=True)
        assert real.read_bytes()[:4] == b"GGUF"
    else:
        _onnx().export_onnx(m, link, overwrite=True)
        assert real.stat().st_size > 1000
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert _siblings(real.parent, tmp_path) == []


def test_convert_overwrites_a_file_and_leaves_nothing_behind(tmp_path, world):
    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"an old file")
    convert(world.src, dst, to="gguf", overwrite=True)
    assert dst.read_bytes()[:4] == b"GGUF"
    assert _siblings(tmp_path) == []
    # a directory where a file was: replaced too, nothing left
    d2 = tmp_path / "was_a_file"
    d2.write_text("x")
    convert(world.src, d2, to="compressed-tensors", overwrite=True)
    assert (d2 / "config.json").is_file() and _siblings(tmp_path) == []


def test_a_failed_write_leaves_the_destination_and_no_sibling(tmp_path, monkeypatch):
    dst = tmp_path / "ckpt"
    dst.mkdir()
    (dst / "keep.txt").write_text("keep")
    import qcore.adapters.io.common as E  # the writers' shared write_checkpoint looks write_shards up here

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(E, "write_shards", boom)
    with pytest.raises(KeyboardInterrupt):
        A.export_hf(_quantized(), dst, overwrite=True)
    assert sorted(os.listdir(dst)) == ["keep.txt"] and _siblings(tmp_path) == []


def test_fsutil_replace_handles_files_links_and_failures(tmp_path):
    """The one staged writer, without torch: every kind of existing target, and a failure inside the block."""
    target = tmp_path / "t"
    for make in (lambda: target.write_text("file"), lambda: target.mkdir(),
                 lambda: target.symlink_to(tmp_path / "elsewhere")):
        make()
        with _fsutil.staged_dir(target, recheck=lambda: None) as tmp:
            (tmp / "new.txt").write_text("new")
        real = _fsutil.real_path(target)
        assert (real / "new.txt").read_text() == "new" and _siblings(tmp_path) == []
        if target.is_symlink():
            assert os.readlink(target) == str(tmp_path / "elsewhere")
        _fsutil.remove(real)
        _fsutil.remove(target)
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with _fsutil.staged_file(target, recheck=lambda: None) as tmp:
            tmp.write_text("half")
            raise RuntimeError("stop")
    assert target.read_text() == "old" and _siblings(tmp_path) == []
    def refuse():
        raise FileExistsError("appeared meanwhile")
    with pytest.raises(FileExistsError):  # the recheck refuses: the old file stays, the new one is gone
        with _fsutil.staged_file(target, recheck=refuse) as tmp:
            tmp.write_text("new")
    assert target.read_text() == "old" and _siblings(tmp_path) == []


def test_the_writers_share_one_staged_writer():
    """No writer hand-rolls its own staging: only src/qcore/_fsutil.py builds '.tmp-' / '.old-' names."""
    root = pathlib.Path(qcore.__file__).resolve().parent
    hits = [str(p.relative_to(root)) for p in root.rglob("*.py")
            if p.name != "_fsutil.py" and (".tmp-" in p.read_text() or ".old-" in p.read_text()
                                           or "mkdtemp" in p.read_text())]
    assert hits == []


# ------------------------------------------------------------------------------------------------------------
# errors known before the work come before it (the command line)
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, make in (("llama", tiny_llama), ("opt", tiny_opt), ("qwen2", tiny_qwen2)):
        make().save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    return root


def _no_loading(monkeypatch):
    """Loading a model fails the test (qcore quantize loads through qcore.adapters.jobs.quantize, the others here)."""
    for where in (C, J):
        monkeypatch.setattr(where, "load_model", lambda *a, **k: pytest.fail("the model was loaded before refusing"))


@pytest.fixture
def no_work(monkeypatch):
    """Evaluation and quantization fail the test if they run."""
    def fail(*a, **k):
        pytest.fail("evaluation or quantization ran before the refusal")
    monkeypatch.setattr(C.E, "perplexity", fail)
    monkeypatch.setattr(J.quantizer, "quantize_model", fail)  # what qcore quantize calls (qcore.adapters.jobs.quantize)
    from qcore.adapters.eval import layer_report
    monkeypatch.setattr(layer_report, "measure", fail)


def _refused(argv, capsys, *needles):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.split("\n") if ln.strip() and "it/s]" not in ln]  # not transformers' load bar
    assert len(lines) == 1 and lines[0].startswith("qcore quantize: error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


PREWORK = [
    ("gguf_unknown_architecture", "opt", ["--export", "gguf", "--scheme", "uint4_wo_64"], ["--export gguf",
                                                                                            "model_type 'opt'"]),
    ("onnx_unknown_architecture", "opt", ["--export", "onnx", "--scheme", "uint4_wo_64"], ["--export onnx",
                                                                                            "model_type 'opt'"]),
    ("onnx_float16", "llama", ["--export", "onnx", "--dtype", "float16"], ["float32"]),
    ("mx_e8m0_in_float16_hf", "llama", ["--scheme", "w_mxfp4_a_mxfp4", "--dtype", "float16"], ["--export hf",
                                                                                               "E8M0"]),
]


@pytest.mark.parametrize("label,model,extra,needles", PREWORK, ids=[p[0] for p in PREWORK])
def test_an_export_the_model_cannot_take_is_refused_before_evaluation(label, model, extra, needles, model_dirs,
                                                                      tmp_path, capsys, no_work):
    if "onnx" in " ".join(extra):
        pytest.importorskip("onnx")
    out = tmp_path / "out"
    _refused(["quantize", "--model", str(model_dirs / model), "--output", str(out), "--no-progress",
              "--seq-len", "32"] + extra,
             capsys, *needles)
    assert not out.exists() and os.listdir(tmp_path) == []


def test_check_functions_agree_with_the_exporters(model_dirs):
    """The up-front check and the exporter refuse the same models (one source of truth)."""
    from qcore.adapters.io.quark_hf import check_hf
    from qcore.adapters.io.gguf import check_gguf
    from qcore.adapters.io.compressed_tensors import check_ct
    opt = transformers.AutoModelForCausalLM.from_pretrained(model_dirs / "opt")
    cfg = A.preset("uint4_wo_64")
    with pytest.raises(ValueError, match="model_type 'opt'") as pre:
        check_gguf(opt, cfg)
    check_hf(opt, cfg)
    check_ct(opt, cfg)
    A.quantize_model(opt, cfg, progress=False)
    with pytest.raises(ValueError, match="model_type 'opt'") as post:
        export_gguf(opt, model_dirs / "never.gguf")
    assert str(pre.value) == str(post.value)
    assert not (model_dirs / "never.gguf").exists()
    half = transformers.AutoModelForCausalLM.from_pretrained(model_dirs / "llama", dtype=torch.float16)
    mx = A.preset("w_mxfp4_a_mxfp4")
    with pytest.raises(ValueError, match="E8M0") as pre:
        check_hf(half, mx)
    A.quantize_model(half, mx, [IDS], progress=False)
    with pytest.raises(ValueError, match="E8M0") as post:
        A.export_hf(half, model_dirs / "never")
    assert str(pre.value) == str(post.value) and not (model_dirs / "never").exists()


@pytest.mark.parametrize("flag,value,needle", [
    ("--report", "{tmp}/no/such/dir/r.json", "does not exist"),
    ("--report", "{tmp}", "contains --output"),  # the folder the checkpoint goes into (jobs/files.py)
    ("--report", "{tmp}/out/../", "contains --output"),
    ("--plot", "{tmp}/missing/p.png", "does not exist"),
    ("--device", "foo", "not a torch device"),
    ("--device", "xla", "cpu, cuda or mps"),
    ("--device", "cuda:7", "CUDA"),
    ("--seq-len", "100", "max_position_embeddings 64"),
])
def test_bad_paths_devices_and_lengths_are_refused_before_any_work(flag, value, needle, model_dirs, tmp_path,
                                                                   capsys, no_work, monkeypatch):
    if flag == "--device" and value.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    if flag != "--seq-len":  # the model is not even loaded
        _no_loading(monkeypatch)
    out = tmp_path / "out"
    _refused(["quantize", "--model", str(model_dirs / "llama"), "--output", str(out), "--no-progress",
              flag, value.format(tmp=tmp_path)], capsys, flag, needle)
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--report", "--plot"])
def test_report_and_plot_never_write_into_the_model(flag, model_dirs, capsys, no_work, monkeypatch):
    _no_loading(monkeypatch)
    before = _tree(model_dirs)
    for target in (model_dirs / "llama" / "config.json", model_dirs / "llama" / "r.out"):
        _refused(["quantize", "--model", str(model_dirs / "llama"), flag, str(target)], capsys, flag,
                 "lies inside the source")
    assert _tree(model_dirs) == before


def test_eval_and_convert_refuse_before_any_work(model_dirs, world, tmp_path, capsys, no_work, monkeypatch):
    code = main(["eval", "--model", str(model_dirs / "llama"), "--seq-len", "100", "--no-progress"])
    assert code == 2 and "max_position_embeddings 64" in capsys.readouterr().err
    _no_loading(monkeypatch)
    code = main(["eval", "--model", str(model_dirs / "llama"), "--device", "nope"])
    assert code == 2 and "--device nope" in capsys.readouterr().err
    import qcore.adapters.jobs.convert as CV
    monkeypatch.setattr(CV, "load_quantized", lambda *a, **k: pytest.fail("the source was loaded before refusing"))
    before = _tree(world.root)
    for report, needle in ((tmp_path / "no" / "r.json", "does not exist"),
                           (world.src / "r.json", "lies inside the source")):
        code = main(["convert", str(world.src), str(tmp_path / "out"), "--to", "gguf", "--report", str(report)])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and err.count("\n") == 1, err
    assert _tree(world.root) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("device,needle", [("foo", "not a torch device"), ("xla", "cpu, cuda or mps"),
                                           ("cuda:9", "CUDA")])
def test_quantize_checkpoint_refuses_a_missing_device_before_reading(world, tmp_path, device, needle, monkeypatch):
    import qcore.adapters.jobs.checkpoint as S
    monkeypatch.setattr(S, "Source", lambda *a, **k: pytest.fail("the source was read before refusing"))
    with pytest.raises(ValueError, match=needle):
        quantize_checkpoint(world.flt, tmp_path / "out", "uint4_wo_64", device=device, progress=False)
    assert os.listdir(tmp_path) == []


def test_unwritable_report_is_refused(model_dirs, tmp_path, capsys, no_work):
    if os.geteuid() == 0:
        pytest.skip("root writes everywhere")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _refused(["quantize", "--model", str(model_dirs / "llama"), "--report", str(ro / "r.json")], capsys,
                 "not writable")
    finally:
        ro.chmod(0o700)


# ------------------------------------------------------------------------------------------------------------
# publishable output
# ------------------------------------------------------------------------------------------------------------

def test_the_same_model_exports_the_same_bytes_wherever_it_was_loaded_from(tmp_path):
    a = tmp_path / "a"
    tiny_llama().save_pretrained(a)
    tiny_tokenizer().save_pretrained(a)
    b = tmp_path / "elsewhere" / "deeper" / "b"
    shutil.copytree(a, b)
    outs = []
    for i, d in enumerate((a, b)):
        m = transformers.AutoModelForCausalLM.from_pretrained(d)
        tok = transformers.AutoTokenizer.from_pretrained(d)
        assert m.config._name_or_path == str(d)
        A.quantize_model(m, A.ModelConfig(A.LayerConfig(weight=_q4_0())), [IDS], progress=False)
        A.freeze(m)
        o = tmp_path / f"out{i}"
        A.export_hf(m, o / "hf", tokenizer=tok)
        export_compressed_tensors(m, o / "ct", tokenizer=tok)
        export_gguf(m, o / "m.gguf", tokenizer=tok)
        outs.append(o)
    files = sorted(str(p.relative_to(outs[0])) for p in outs[0].rglob("*") if p.is_file())
    assert len(files) > 6
    for f in files:
        x, y = (outs[0] / f).read_bytes(), (outs[1] / f).read_bytes()
        assert x == y, f
        assert str(tmp_path).encode() not in x and b"_name_or_path" not in x, f

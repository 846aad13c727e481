"""Every input is a source (issue 33): each job knows the files it reads and writes (``JobFiles``,
src/qcore/adapters/jobs/files.py) and refuses, before any work, a write onto one of its inputs or onto another of
its writes.

The cases come from the jobs' own ``JobFiles``: each job is set up with every input and every output given (each in
a folder of its own), its ``JobFiles`` says which arguments it reads and writes, and every write is pointed at
every read (the same path, a symlink to it, a ``..`` spelling, a hard link of a file, a path inside a directory,
the folder holding it) and at every other write (the same path, a path inside it, the folder holding it). Each
case is refused in one line naming both options and both paths, before the job reads its model or source, and
every file under the test's folder keeps its bytes and mtime. A new input or output of a job is a new row of its
``JobFiles``, so it is covered here without a new case. Then the work directory's rules and Ctrl-C's words.
"""

import hashlib
import json
import os
import pathlib
import re
import tempfile

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qcore  # noqa: E402
from qcore.adapters import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.jobs import checkpoint as CK  # noqa: E402
from qcore.adapters.jobs import convert as CV  # noqa: E402
from qcore.adapters.jobs import imatrix as IM  # noqa: E402
from qcore.adapters.jobs import quantize as J  # noqa: E402
from qcore.adapters.jobs.common import CLI, PYTHON, CommandError  # noqa: E402
from qcore.adapters.jobs.files import JobFiles, check_files  # noqa: E402
from qcore.adapters.passes import checkpointing as K  # noqa: E402
from qcore.cli import main  # noqa: E402


class Reached(Exception):
    """The job got past its checks to the first read of its model or source."""


# ---------------------------------------------------------------------------------------------------------------
# the jobs: every input and output given, each in a folder of its own (in_<arg>/..., o_<arg>/...)
# ---------------------------------------------------------------------------------------------------------------


def _put(root: pathlib.Path, rel: str, content=None) -> str:
    """``root/rel``: a file holding ``content`` (str or bytes), a new directory (``content`` "dir"), or only its
    folder (None: a path to be written)."""
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if content == "dir":
        p.mkdir()
    elif isinstance(content, bytes):
        p.write_bytes(content)
    elif content is not None:
        p.write_text(content)
    return str(p)


def _quantize_base(root):
    model = _put(root, "in_model/model", "dir")
    _put(root, "in_model/model/config.json", "{}")
    gguf = ModelConfig(LayerConfig(weight=qcore.make_spec("q4_0")))  # GGUF weights: the imatrix has an effect
    return dict(model=model, scheme=_put(root, "in_scheme/scheme.json", json.dumps(gguf.to_dict())),
                eval_text=_put(root, "in_eval_text/text.txt", "some text to evaluate and calibrate on. " * 20),
                imatrix=_put(root, "in_imatrix/imatrix.dat", b"\0" * 16),
                work_dir=_put(root, "in_work_dir/work", "dir"), output=_put(root, "o_output/out"),
                report=_put(root, "o_report/report.json"), plot=_put(root, "o_plot/plot.png"),
                algorithms=["gptq"], seq_len=32, calib_samples=2, eval="none", progress=False)


def _quantize_argv(kw):
    argv = ["quantize", "--algo", ",".join(kw["algorithms"]), "--seq-len", str(kw["seq_len"]), "--calib-samples",
            str(kw["calib_samples"]), "--eval", kw["eval"], "--no-progress"]
    for a in ("model", "scheme", "eval_text", "imatrix", "work_dir", "output", "report", "plot"):
        argv += [CLI(a), kw[a]]
    return argv + (["--resume"] if kw.get("resume") else [])


def _imatrix_base(root):
    return dict(model=_put(root, "in_model/model.gguf", b"GGUF" + b"\0" * 60),
                eval_text=_put(root, "in_eval_text/text.txt", "some text to calibrate on. " * 20),
                output=_put(root, "o_output/imatrix.gguf"))


def _convert_base(root):
    src = _put(root, "in_src/src", "dir")
    _put(root, "in_src/src/config.json", "{}")
    return dict(src=src, dst=_put(root, "o_dst/dst"), report=_put(root, "o_report/report.json"))


def _checkpoint_base(root):
    src = _put(root, "in_src_dir/src", "dir")
    _put(root, "in_src_dir/src/config.json", "{}")
    return dict(src_dir=src, dst_dir=_put(root, "o_dst_dir/dst"), work_dir=_put(root, "in_work_dir/work", "dir"))


def _call(job, mode, kw):
    """Run ``job`` (``mode``: python or cli) on ``kw``; ``(exit code, stderr)`` on the command line, the error
    message raised in Python (Reached propagates)."""
    if job == "quantize":
        if mode == "cli":
            return main(_quantize_argv(kw))
        J.quantize_and_report(**kw)
    elif job == "imatrix":
        if mode == "cli":
            return main(["imatrix", "--model", kw["model"], "--eval-text", kw["eval_text"], "--output", kw["output"],
                         "--no-progress"])
        IM.imatrix_file(kw["model"], kw["output"], eval_text=kw["eval_text"], progress=False)
    elif job == "convert":
        if mode == "cli":
            return main(["convert", kw["src"], kw["dst"], "--to", "hf", "--report", kw["report"], "--no-progress"])
        CV.convert(kw["src"], kw["dst"], to="hf")
    else:
        CK.quantize_checkpoint(kw["src_dir"], kw["dst_dir"], "uint4_wo_32", progress=False, work_dir=kw["work_dir"],
                               resume=kw.get("resume", False))
    raise AssertionError("the job returned")


def _files(job, mode, kw) -> JobFiles:
    """The job's own JobFiles for ``kw``."""
    names = CLI if mode == "cli" else PYTHON
    if job == "quantize":
        return J.job_files(J.QuantizeJob.from_arguments(names=names, **kw))
    if job == "imatrix":
        return IM.job_files(kw["model"], kw["output"], eval_text=kw["eval_text"], names=names)
    if job == "convert":
        return CV.job_files(kw["src"], kw["dst"], report=kw["report"] if mode == "cli" else None, cli=mode == "cli")
    return CK.job_files(kw["src_dir"], kw["dst_dir"], work_dir=kw["work_dir"])


BASES = {"quantize": _quantize_base, "imatrix": _imatrix_base, "convert": _convert_base,
         "checkpoint": _checkpoint_base}
MODES = {"quantize": ("python", "cli"), "imatrix": ("python", "cli"), "convert": ("python", "cli"),
         "checkpoint": ("python",)}


def _roles(job, mode):
    """``({read arg: "dir" or "file"}, [write args])`` from the job's JobFiles, on a scratch world."""
    with tempfile.TemporaryDirectory() as d:
        files = _files(job, mode, BASES[job](pathlib.Path(d)))
        assert files.reads and files.writes, (job, mode)
        return ({r.arg: "dir" if os.path.isdir(r.path) else "file" for r in files.reads},
                [w.arg for w in files.writes])


READ_SPELLINGS = {  # how a write is pointed at a read p (in its own folder): its path, from the world
    "same": lambda root, p: p,
    "symlink": lambda root, p: _link(root, p),
    "dotdot": lambda root, p: _dotdot(p),
    "hardlink": lambda root, p: _hardlink(root, p),  # files
    "inside": lambda root, p: p / "sub" / "x.json",  # directories
    "folder": lambda root, p: p.parent,
}
WRITE_SPELLINGS = {"same": lambda p: p, "inside": lambda p: p / "x.json", "folder": lambda p: p.parent}


def _link(root, p):
    link = root / "links" / f"to_{p.name}"
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(p)
    return link


def _dotdot(p):
    (p.parent / "x").mkdir(exist_ok=True)
    return p.parent / "x" / ".." / p.name


def _hardlink(root, p):
    link = root / "links" / f"hard_{p.name}"
    link.parent.mkdir(exist_ok=True)
    os.link(p, link)
    return link


READ_CASES, WRITE_CASES = [], []
for _job, _modes in MODES.items():
    for _mode in _modes:
        _reads, _writes = _roles(_job, _mode)
        for _w in _writes:
            for _r, _kind in _reads.items():
                if _r == _w:  # the work directory: read and written by the same run
                    continue
                for _s in READ_SPELLINGS:
                    if (_s, _kind) not in (("hardlink", "dir"), ("inside", "file")):
                        READ_CASES.append((_job, _mode, _w, _r, _s))
        for _i, _a in enumerate(_writes):
            for _b in _writes[_i + 1:]:
                WRITE_CASES += [(_job, _mode, _a, _b, _s) for _s in WRITE_SPELLINGS]


def _snapshot(root: pathlib.Path) -> dict:
    """Every entry under ``root``: its kind and, for a file, its bytes' digest, size and mtime (a symlink: where
    it points)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = pathlib.Path(d) / n
            st = p.lstat()
            if p.is_symlink():
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            elif p.is_dir():
                out[str(p.relative_to(root))] = ("dir",)
            else:
                out[str(p.relative_to(root))] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size,
                                                 st.st_mtime_ns)
    return out


@pytest.fixture
def reach(monkeypatch):
    """The first read of a job's model or source raises Reached: a refusal must come before it."""
    def reached(*a, **k):
        raise Reached
    monkeypatch.setattr(J, "load_model", reached)
    monkeypatch.setattr(IM, "load_model", reached)
    monkeypatch.setattr(CV, "detect_format", reached)
    monkeypatch.setattr(CK, "_plan", reached)


def _refused(job, mode, kw, capsys) -> str:
    """The one-line refusal of ``job`` on ``kw`` (before Reached)."""
    if mode == "cli":
        code = _call(job, mode, kw)
        err = capsys.readouterr().err
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"qcore {job}: error: ") and "Traceback" not in err, err
        return lines[0]
    with pytest.raises(ValueError) as e:
        _call(job, mode, kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("job,mode", [(j, m) for j, ms in MODES.items() for m in ms])
def test_every_job_passes_its_file_checks_when_nothing_overlaps(job, mode, tmp_path, reach, capsys):
    kw = BASES[job](tmp_path)
    check_files(_files(job, mode, kw))
    before = _snapshot(tmp_path)
    with pytest.raises(Reached):
        _call(job, mode, kw)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("job,mode,write,read,spelling", READ_CASES, ids=["-".join(c) for c in READ_CASES])
def test_no_write_touches_an_input(job, mode, write, read, spelling, tmp_path, reach, capsys):
    kw = BASES[job](tmp_path)
    target = pathlib.Path(kw[read])
    kw[write] = str(READ_SPELLINGS[spelling](tmp_path, target))
    files = _files(job, mode, kw)
    w = next(f for f in files.writes if f.arg == write)
    r = next(f for f in files.reads if f.arg == read)
    before = _snapshot(tmp_path)
    msg = _refused(job, mode, kw, capsys)
    assert files.named(w) in msg and f"the source {files.named(r)}" in msg, msg  # both options, both paths
    assert repr(kw[write]) in msg and repr(kw[read]) in msg
    assert _snapshot(tmp_path) == before  # nothing written, nothing deleted, no staging left


@pytest.mark.parametrize("job,mode,first,second,spelling", WRITE_CASES, ids=["-".join(c) for c in WRITE_CASES])
def test_no_write_touches_another(job, mode, first, second, spelling, tmp_path, reach, capsys):
    kw = BASES[job](tmp_path)
    kw[second] = str(WRITE_SPELLINGS[spelling](pathlib.Path(kw[first])))
    files = _files(job, mode, kw)
    a = next(f for f in files.writes if f.arg == first)
    b = next(f for f in files.writes if f.arg == second)
    before = _snapshot(tmp_path)
    msg = _refused(job, mode, kw, capsys)
    assert files.named(a) in msg and files.named(b) in msg, msg
    assert any(f" {how} " in msg for how in ("is", "lies inside", "contains")), msg
    assert _snapshot(tmp_path) == before


def test_the_findings(tmp_path, reach, capsys):
    """The reported cases, word for word: imatrix over its model, --imatrix deleted with --output, --report over
    the imatrix, convert's report over the converted weights; Python names the arguments."""
    kw = _imatrix_base(tmp_path)
    assert main(["imatrix", "--model", kw["model"], "--output", kw["model"], "--overwrite"]) == 2
    assert f"--output {kw['model']!r} is the source --model {kw['model']!r}" in capsys.readouterr().err
    q = _quantize_base(tmp_path / "q")
    inside = str(pathlib.Path(q["output"]) / "imatrix.dat")
    _put(tmp_path / "q", "o_output/out/imatrix.dat", b"\0" * 16)
    with pytest.raises(ValueError, match=r"^output=.* contains the source imatrix=.*the export would delete it"):
        J.quantize_and_report(**{**q, "imatrix": inside, "overwrite": True})
    with pytest.raises(ValueError, match=r"^report=.* is the source imatrix=.*the report would replace it"):
        J.quantize_and_report(**{**q, "report": q["imatrix"]})
    c = _convert_base(tmp_path / "c")
    assert main(["convert", c["src"], c["dst"], "--to", "hf", "--report", c["dst"] + "/model.safetensors"]) == 2
    assert (f"--report '{c['dst']}/model.safetensors' lies inside dst {c['dst']!r}, which the conversion replaces"
            in capsys.readouterr().err)


def test_links_and_relative_spellings(tmp_path, monkeypatch, reach):
    """A hard link of the model file and a relative spelling through '..' are the model."""
    kw = _imatrix_base(tmp_path)
    os.link(kw["model"], tmp_path / "same.gguf")
    monkeypatch.chdir(tmp_path / "o_output")
    for out in (str(tmp_path / "same.gguf"), "../in_model/model.gguf", "../o_output/../in_model/./model.gguf"):
        with pytest.raises(CommandError, match=re.escape(f"output={out!r}") + ".* is the source model="):
            IM.imatrix_file(kw["model"], out, eval_text=kw["eval_text"], overwrite=True)
    q = _quantize_base(tmp_path / "q")  # a symlink inside the output counts where it lies: replacing deletes it
    link = pathlib.Path(q["output"]) / "imatrix.dat"
    link.parent.mkdir()
    link.symlink_to(q["imatrix"])
    with pytest.raises(CommandError, match=r"output=.* contains the source imatrix=.*imatrix.dat' \(resolved: "):
        J.quantize_and_report(**{**q, "imatrix": str(link), "overwrite": True})
    assert link.is_symlink() and pathlib.Path(q["imatrix"]).read_bytes() == b"\0" * 16
    with pytest.raises(CommandError, match="current directory"):  # the writes never replace the current folder
        CK.quantize_checkpoint(_checkpoint_base(tmp_path / "k")["src_dir"], ".", "uint4_wo_32", overwrite=True)


def test_a_module_model_counts_where_it_was_loaded_from(tmp_path, zoo, reach):
    m = zoo.tiny_llama()
    m.save_pretrained(tmp_path / "m")
    m.qcore_source = str(tmp_path / "m")
    files = J.job_files(J.QuantizeJob.from_arguments(model=m, output=str(tmp_path / "m" / "q"), eval="none"))
    assert [(r.arg, r.path) for r in files.reads] == [("model", str(tmp_path / "m"))]
    with pytest.raises(ValueError, match=r"output=.* lies inside the source model="):
        J.quantize_and_report(m, "uint4_wo_32", output=tmp_path / "m" / "q", eval="none", progress=False)


# ---------------------------------------------------------------------------------------------------------------
# the work directory: new, empty or a qcore work directory; a saved run needs --resume, refused before loading
# ---------------------------------------------------------------------------------------------------------------


def _saved_run(path: pathlib.Path) -> None:
    """A work directory's manifest with one layer saved (what an interrupted run leaves)."""
    path.mkdir(parents=True)
    (path / K.MANIFEST).write_text(json.dumps({"format": K.FORMAT, "fingerprint": {}, "entries": [
        {"layer": {"file": "layer-00000.pt", "bytes": 1, "sha256": "0" * 64}, "carry": None}], "extra": {}}))


def test_work_dir_rules_before_any_loading(tmp_path, reach, capsys):
    kw = _quantize_base(tmp_path)
    work = pathlib.Path(kw["work_dir"])
    (work / "notes.txt").write_text("mine")  # someone's folder
    with pytest.raises(ValueError, match=r"work_dir=.* not empty and not a qcore work directory .*'notes.txt'"):
        J.quantize_and_report(**kw)
    assert main(_quantize_argv(kw)) == 2
    assert "--work-dir" in capsys.readouterr().err
    (work / "notes.txt").unlink()
    (work / "algorithms").mkdir()
    (work / "algorithms" / "notes.txt").write_text("mine")  # a pass's folder that is not a work directory
    with pytest.raises(ValueError, match="not empty and holds no qcore run"):
        J.quantize_and_report(**kw)
    (work / "algorithms" / "notes.txt").unlink()
    (work / "algorithms").rmdir()
    _saved_run(work / "algorithms")  # a forgotten --resume: refused before the model loads
    with pytest.raises(ValueError, match=r"work_dir=.* holds a run \(1 layers saved .*pass resume=True to continue"):
        J.quantize_and_report(**kw)
    assert main(_quantize_argv(kw)) == 2
    err = capsys.readouterr().err
    assert "--work-dir" in err and "rerun the same command with --resume" in err and "=True" not in err, err
    with pytest.raises(Reached):  # resumed: on to loading
        J.quantize_and_report(**kw, resume=True)
    with pytest.raises(Reached):
        main(_quantize_argv({**kw, "resume": True}))
    c = _checkpoint_base(tmp_path / "k")
    (pathlib.Path(c["work_dir"]) / "x").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no qcore run"):
        _call("checkpoint", "python", c)
    (pathlib.Path(c["work_dir"]) / "x").unlink()
    pathlib.Path(c["work_dir"]).rmdir()
    _saved_run(pathlib.Path(c["work_dir"]))
    with pytest.raises(ValueError, match=r"work_dir .* holds a run \(1 layers saved\); pass resume=True"):
        _call("checkpoint", "python", c)
    with pytest.raises(Reached):
        _call("checkpoint", "python", {**c, "resume": True})


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C with a work directory: how to continue, in the caller's words
# ---------------------------------------------------------------------------------------------------------------


def _interrupt_after_first_layer(monkeypatch):
    real = K.WorkDir.save_layer

    def save_then_interrupt(self, i, *a, **k):
        real(self, i, *a, **k)
        raise KeyboardInterrupt
    monkeypatch.setattr(K.WorkDir, "save_layer", save_then_interrupt)
    return lambda: monkeypatch.setattr(K.WorkDir, "save_layer", real)


def test_ctrl_c_says_how_to_resume(lm_dir, tmp_path, monkeypatch, capsys, caplog):
    text = str(lm_dir.parent / "text.txt")
    argv = ["quantize", "--model", str(lm_dir), "--scheme", "uint4_wo_32", "--algo", "gptq", "--eval-text", text,
            "--seq-len", "32", "--calib-samples", "2", "--eval", "none", "--no-progress", "--work-dir",
            str(tmp_path / "w")]
    restore = _interrupt_after_first_layer(monkeypatch)
    with caplog.at_level("WARNING", logger="qcore.adapters"):
        assert main(argv) == 130
    err = capsys.readouterr().err
    assert (f"qcore quantize: interrupted; the layers done are saved in --work-dir {str(tmp_path / 'w')!r}: rerun "
            f"the same command with --resume to continue from there") in err, err
    assert "reload the model" not in err + caplog.text and "resume=True" not in err
    assert "saved in the work directory" in caplog.text  # the runner's fact, without advice
    with pytest.raises(KeyboardInterrupt, match=r"work_dir=.*: call quantize_and_report again with the same "
                                                r"arguments and resume=True to continue"):
        J.quantize_and_report(lm_dir, "uint4_wo_32", algorithms=["gptq"], eval_text=text, seq_len=32,
                              calib_samples=2, eval="none", progress=False, work_dir=tmp_path / "p")
    restore()
    assert main(argv) == 2  # the forgotten --resume, before the model loads
    assert "rerun the same command with --resume" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0

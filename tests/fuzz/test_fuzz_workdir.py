"""Fuzzing the resume of a layer-by-layer run (``quantize_model(..., work_dir=, resume=True)``: the manifest
reader ``qcore.adapters.passes.checkpointing.read_work_dir`` / ``WorkDir``, and the saved layer and carry files)
with mutations of a real finished GPTQ run's work directory (tiny 2-layer Llama): manifest.json JSON edits (the
fingerprint, every entry's file / bytes / sha256, extra; wrong types, missing, extra and duplicate keys, NaN
tokens, truncation), byte edits of the saved layer-*.pt / carry-*.pt files, and their removal.

The independent result is the uninterrupted run's (the fixture's final state dict): a resume qcore accepts must
end with the same model, bit for bit (a damaged entry is recomputed, as the module docstring says); a refusal is
a one-line ValueError naming the work directory's manifest (and the field), made before any work: the work
directory is left exactly as it was. No resume may write outside its work directory."""

import json
import pathlib
import shutil
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fuzz_kit import attempt, byte_edit, check_refusal, counts, fuzz, json_edit, record, snapshot  # noqa: E402

import qcore.adapters as A  # noqa: E402

class Case:
    def __init__(self, what: str, apply, fields: tuple = ()):
        self.what, self.apply, self.fields = what, apply, fields

    def __repr__(self) -> str:
        return f"Case({self.what})"

class Source:
    """The fixture's work directory with a short repr (hypothesis prints strategy arguments)."""

    def __init__(self, d: pathlib.Path):
        self.d = d

    def __repr__(self) -> str:
        return "Source(work)"

@st.composite
def work_edit(draw, src: Source):
    d = src.d
    kind = draw(st.sampled_from(["manifest", "manifest", "manifest", "file", "remove"]))
    if kind == "manifest":
        m = json.loads((d / "manifest.json").read_text())
        e = draw(json_edit(m, vocabulary=["layer-00000.pt", "carry-00001.pt", "../manifest.json", "/etc/passwd",
                                          "0" * 64, "sensitivities"]))

        def apply(w):
            (w / "manifest.json").write_text(e.text)
        return Case(f"manifest {e!r}", apply, e.fields if e.strict and e.op != "truncate" else ())
    files = sorted(p.name for p in d.iterdir() if p.suffix == ".pt")
    f = draw(st.sampled_from(files))
    if kind == "remove":
        return Case(f"{f} removed", lambda w: (w / f).unlink())
    b = draw(byte_edit((d / f).read_bytes()))

    def apply(w):
        (w / f).write_bytes(b.data)
    return Case(f"{f}: {b.what}", apply)

def check_case(src: pathlib.Path, want: dict, case: Case, job) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        w = pathlib.Path(tmp) / "work"
        shutil.copytree(src, w)
        case.apply(w)
        before = snapshot([w])
        model, batches, config = job()
        size = sum(p.stat().st_size for p in w.iterdir())
        out = attempt(lambda: A.quantize_model(model, config, batches, progress=False, work_dir=w, resume=True),
                      watch=[pathlib.Path(tmp) / "outside"], size=size)
        assert sorted(p.name for p in pathlib.Path(tmp).iterdir()) == ["work"], "the resume wrote beside its work dir"
        record("work dir resume", out)
        if out.ok:
            got = out.value.state_dict()
            assert sorted(got) == sorted(want)
            diff = [k for k in want if not torch.equal(got[k], want[k])]
            assert not diff, f"the resumed run differs from the uninterrupted one: {diff[:3]}"
            return "accepted"
        assert snapshot([w]) == before, "a refused resume changed the work directory"
        check_refusal(out.error, files=["manifest.json", str(w)], fields=case.fields)
        return "refused"

def test_the_unchanged_work_dir_resumes_to_the_same_model(work_run, work_job):
    d, want = work_run
    assert check_case(d, want, Case("unchanged", lambda w: None), work_job) == "accepted"

@pytest.mark.parametrize("n", counts(20, 300))
def test_fuzz_work_dir_resume(work_run, work_job, n):
    d, want = work_run

    @fuzz(n)
    @given(work_edit(Source(d)))
    def run(case):
        check_case(d, want, case, work_job)

    run()

"""The minimal failing inputs tests/fuzz/test_fuzz_workdir.py found in the work-directory manifest reader
(``checkpointing.read_work_dir``): manifests whose fields have the wrong type or name other files reached the
resume as an AttributeError inside the algorithm (AlgorithmError), a TypeError without the file, or a read of
a file outside the work directory; each is now a ValueError naming the work directory, its manifest.json and
the field, raised before any work."""

import json

import pytest

pytest.importorskip("torch")

from qcore.adapters.passes import checkpointing as K  # noqa: E402

SHA = "ab" * 32


def _rec(kind, i):
    return {"file": f"{kind}-{i:05d}.pt", "bytes": 10, "sha256": SHA}


def _manifest(**over):
    m = {"format": K.FORMAT, "fingerprint": {"pass": "x"}, "extra": {},
         "entries": [{"layer": _rec("layer", 0), "carry": None}, {"layer": _rec("layer", 1), "carry": _rec("carry", 1)}]}
    m.update(over)
    return m


def _entry(i, **over):
    def edit(m):
        m["entries"][i].update(over)
    return edit


CASES = [
    ("entries-bool", dict(entries=True), r"entries is True; expected a list"),
    ("entry-null", dict(entries=[None]), r"entries\[0\] is None; expected a JSON object"),
    ("fingerprint-list", dict(fingerprint=[1]), r"fingerprint is \[1\]; expected a JSON object"),
    ("extra-string", dict(extra="x"), r"extra is 'x'; expected a JSON object"),
    ("layer-missing", _entry(0, layer=None), r"entries\[0\]\.layer is None; expected a JSON object"),
    ("file-outside", _entry(1, layer=dict(_rec("layer", 1), file="../../secret.pt")),
     r"entries\[1\]\.layer\.file is '\.\./\.\./secret\.pt'; expected 'layer-00001\.pt'"),
    ("file-of-another-entry", _entry(1, carry=_rec("carry", 0)),
     r"entries\[1\]\.carry\.file is 'carry-00000\.pt'; expected 'carry-00001\.pt'"),
    ("bytes-string", _entry(0, layer=dict(_rec("layer", 0), bytes="10")),
     r"entries\[0\]\.layer\.bytes is '10'; expected a size in bytes"),
    ("bytes-negative", _entry(0, layer=dict(_rec("layer", 0), bytes=-1)), r"entries\[0\]\.layer\.bytes is -1"),
    ("sha-short", _entry(0, layer=dict(_rec("layer", 0), sha256="ab")), r"entries\[0\]\.layer\.sha256 is 'ab'"),
    ("sensitivities-key", dict(extra={"sensitivities": {"x": 1.0}}), r"extra\.sensitivities\['x'\] is 1\.0"),
    ("sensitivities-value", dict(extra={"sensitivities": {"0": "1"}}), r"extra\.sensitivities\['0'\] is '1'"),
]


@pytest.mark.parametrize("name, edit, match", CASES, ids=[c[0] for c in CASES])
def test_a_manifest_with_bad_fields_is_refused_naming_the_field(tmp_path, name, edit, match):
    m = _manifest()
    edit(m) if callable(edit) else m.update(edit)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"^work_dir '.*': its manifest\.json is unreadable \(" + match):
        K.read_work_dir(tmp_path)


def test_a_deeply_nested_manifest_is_refused_not_a_recursion_error(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": 1, "extra": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"its manifest\.json is unreadable"):
        K.read_work_dir(tmp_path)


def test_a_sound_manifest_reads(tmp_path):
    m = _manifest(extra={"sensitivities": {"0": 0.5, "12": 1e-3}})
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert K.read_work_dir(tmp_path) == m

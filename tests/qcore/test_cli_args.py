"""The numpy command line (``qcore inspect``, ``qcore conformance``): an empty path is refused naming its argument,
never taken for the working directory (issue 33)."""

from qcore.cli import main


def test_an_empty_path_is_not_the_working_directory(tmp_path, monkeypatch, capsys):
    """The numpy commands: '' would be the working directory (export --overwrite would replace it)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    for argv, name in ((["conformance", "export", "", "--formats", "mxfp4", "--overwrite"], "directory"),
                       (["conformance", "check", "", "--outputs", "o"], "vectors"),
                       (["conformance", "check", "v", "--outputs", ""], "--outputs"),
                       (["inspect", ""], "PATH")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        line = lines[0]
        assert f"argument {name}: expected a non-empty value, got ''" in line, line
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]

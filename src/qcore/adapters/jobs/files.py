"""What a job reads and what it writes, as a value, and the one check that keeps the writes off the reads.

Every job (``qcore quantize`` / ``quantize_and_report``, ``qcore imatrix``, ``qcore convert``,
``quantize_checkpoint``) builds its ``JobFiles`` from its arguments in its checks: ``reads`` (the model file or
directory, the evaluation or calibration text, the scheme file, the importance matrix, the work directory, the
source checkpoint) and ``writes`` (the output directory or file, the report, the plot, the imatrix file, the
work directory). ``JobFiles.check()`` (``check_files``) then refuses, before any work and with or without
``overwrite``, in one line naming both options and both paths (``--report 'm/r.json' lies inside the source
--model 'm', which the job reads: the report would change it; choose a path outside it``, ``--report
'out/model.safetensors' lies inside --output 'out', which the export replaces; choose a path outside it``):

- a write that is a read (the same path, a symlink to it, another spelling with ``..``, a hard link of the same
  file), that lies inside a read directory (it would change it), or that contains a read (replacing or filling
  the write would delete or change it; a read that is a symlink inside it counts by where the link lies too);
- two writes that overlap: the same path (the one would overwrite the other) or one inside the other (a report
  inside the output directory the export replaces);
- a write that is or contains the current directory, or below a file (``qcore._fsutil.check_not_source``).

Paths are compared after resolving symlinks and ``..`` (``qcore._fsutil.relation``); case-insensitive file
systems are not special-cased. The writers keep their own checks (``check_destination``, ``check_not_source``
against the loaded model's sources), which this one runs before.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Iterable, Optional

from qcore._fsutil import check_not_source, real_path, relation

from .common import CommandError

__all__ = ["JobFile", "JobFiles", "check_files"]


@dataclass(frozen=True)
class JobFile:
    """One path a job reads or writes: ``arg`` (the Python argument it comes from, e.g. ``"report"``), ``label``
    (how errors name it: the flag ``--report``, the argument ``report``, the positional ``dst``), the ``path`` as
    given; for a write, ``by`` (what writes it: ``"the export"``) and whether it ``replaces`` the path as a whole
    (an output directory, a report file) or only writes into it (a work directory)."""

    arg: str
    label: str
    path: str
    by: str = ""
    replaces: bool = True


@dataclass(frozen=True)
class JobFiles:
    """Every file a job reads and every file it writes (``JobFile`` s), and how it names them (``cli``:
    ``--report 'r.json'``; else ``report='r.json'``). Built by each job's checks; ``check()`` refuses, before any
    work, a write that would touch a read or another write (module docstring)."""

    reads: tuple = ()
    writes: tuple = ()
    cli: bool = False

    @classmethod
    def of(cls, names, *, reads: Iterable = (), writes: Iterable = ()) -> "JobFiles":
        """From ``(arg, path)`` reads and ``(arg, path, by[, replaces])`` writes, each named by ``names`` (a
        ``jobs.common.Names``, or a callable for positional arguments); a None or empty path is left out."""
        cli = bool(getattr(names, "cli", False))
        rs = tuple(JobFile(a, names(a), os.fspath(p)) for a, p in reads if p is not None and os.fspath(p))
        ws = tuple(JobFile(w[0], names(w[0]), os.fspath(w[1]), w[2], w[3] if len(w) > 3 else True)
                   for w in writes if w[1] is not None and os.fspath(w[1]))
        return cls(rs, ws, cli)

    def named(self, f: JobFile) -> str:
        """``--report 'r.json'`` / ``report='r.json'``, with what it resolves to when that differs."""
        r = str(real_path(f.path))
        shown = f"{f.label} {f.path!r}" if self.cli or not f.label.isidentifier() else f"{f.label}={f.path!r}"
        return shown + ("" if r == os.path.abspath(f.path) else f" (resolved: {r!r})")

    def check(self) -> None:
        check_files(self)


def _spellings(p: str) -> tuple:
    """Where ``p`` lies: resolved, and (for a symlink) where the link itself lies (its folder resolved)."""
    real = real_path(p)
    a = pathlib.Path(os.path.abspath(p))
    if a.name in ("", ".", ".."):
        return (real,)
    here = real_path(a.parent) / a.name
    return (real,) if here == real else (real, here)


def _relation(a: str, b: str) -> Optional[str]:
    """How ``a`` overlaps ``b`` (``relation``: is, contains, lies inside), any spelling of either."""
    for x in _spellings(a):
        for y in _spellings(b):
            how = relation(x, y)
            if how is not None:
                return how
    return None


def check_files(files: JobFiles) -> None:
    """``CommandError`` (a ``ValueError``), one line naming both options and paths, for a write that is, contains
    or lies inside a read, for two writes that overlap, and for a write that is or contains the current
    directory or lies below a file (module docstring). Call it before any work."""
    for w in files.writes:
        for r in files.reads:
            if r.arg == w.arg:  # a work directory: read and written by the same run
                continue
            how = _relation(w.path, r.path)
            if how is not None:
                what = {"is": "replace", "contains": "delete" if w.replaces else "change"}.get(how, "change")
                raise CommandError(f"{files.named(w)} {how} the source {files.named(r)}, which the job reads: "
                                   f"{w.by} would {what} it; choose " + (
                                       "a path outside it" if how == "lies inside" else "another path"))
    ws = files.writes
    for i, a in enumerate(ws):
        for b in ws[i + 1:]:
            how = _relation(b.path, a.path)
            if how == "is":
                raise CommandError(f"{files.named(b)} is {files.named(a)}: the one would overwrite the other; "
                                   f"choose another path")
            if how == "lies inside":
                raise CommandError(f"{files.named(b)} lies inside {files.named(a)}, which {a.by} "
                                   f"{'replaces' if a.replaces else 'writes into'}; choose a path outside it")
            if how == "contains":
                raise CommandError(f"{files.named(b)} contains {files.named(a)}: {b.by} would "
                                   f"{'replace' if b.replaces else 'change'} what {a.by} writes; choose another "
                                   f"path")
    for w in ws:  # the current directory, and a file where a folder would have to be
        try:
            check_not_source(w.path, (), what=w.label)
        except ValueError as e:
            raise CommandError(str(e)) from None

"""Safe writes of a directory or a file, shared by every writer (``qcore conformance export``, ``export_hf``,
``export_compressed_tensors``, ``export_gguf(_dir)``, ``export_onnx(_dir)``, ``convert``, ``quantize_checkpoint``,
``qcore quantize --output``). numpy-free and torch-free.

What every writer guarantees (docs/export.md, "What writers guarantee"):

- ``check_not_source``: a destination that is a source, contains one, or lies inside one (paths compared after
  resolving symlinks and ``..``) is refused with a ``ValueError`` naming both paths, before any work and whether
  or not ``overwrite`` is given. A destination that is or contains the current working directory is refused
  the same way.
- ``staged_dir`` / ``staged_file``: the result is built in a hidden staging sibling (``.NAME.tmp-XXXXXXXX``, on
  the same file system) and renamed into place only when complete; on any error (Ctrl-C included) the staging
  sibling is deleted and the destination is left as it was. An existing destination is moved aside
  (``.NAME.old-XXXXXXXX``) and deleted once the new one is in place, so no hidden sibling is left behind, on
  success or failure.
- A destination that is a symlink keeps being that symlink: what it points to is replaced (the staging and the
  final rename happen beside the link's target), so the link points at the new content afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


def real_path(p: PathLike) -> Path:
    """``p`` absolute, with every symlink and ``..`` resolved (also for a path that does not exist yet)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(p))))


def overlap(dst: PathLike, src: PathLike) -> Optional[str]:
    """How ``dst`` overlaps ``src`` once both are resolved: ``"is"`` (also two hard links of one file),
    ``"contains"``, ``"lies inside"``, or None."""
    return relation(real_path(dst), real_path(src))


def relation(d: Path, s: Path) -> Optional[str]:
    """``overlap`` of two absolute paths as given (resolved or not): ``"is"`` (the same path, or two existing
    names of one file: a hard link), ``"contains"``, ``"lies inside"``, or None."""
    if d == s:
        return "is"
    try:
        if os.path.exists(d) and os.path.exists(s) and os.path.samefile(d, s):
            return "is"
    except OSError:
        pass
    if d in s.parents:
        return "contains"
    if s in d.parents:
        return "lies inside"
    return None


def check_not_source(dst: PathLike, sources: Iterable[Optional[PathLike]], *, what: str = "dst") -> None:
    """``ValueError`` (naming ``what`` and both paths) when ``dst`` is, contains or lies inside one of ``sources``
    (None entries are skipped), or is or contains the current working directory: writing there would replace or
    delete the source; also when an existing folder above ``dst`` is a file. Call it before any work, with
    overwrite or not."""
    for src in sources:
        if src is None or not os.fspath(src):
            continue
        how = overlap(dst, src)
        if how is not None:
            raise ValueError(f"{what} {_shown(dst)} {how} the source {_shown(src)}; writing there would "
                             f"{'change' if how == 'lies inside' else 'replace'} the source: choose a destination "
                             f"outside it")
    for parent in real_path(dst).parents:  # a file where a folder would have to be created: refused up front
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise ValueError(f"{what} {_shown(dst)}: {str(parent)!r} is a file, not a directory")
            break
    try:
        cwd = real_path(os.getcwd())
    except OSError:  # the current directory was deleted
        return
    d = real_path(dst)
    if d == cwd or d in cwd.parents:
        raise ValueError(f"{what} {_shown(dst)} {'is' if d == cwd else 'contains'} the current directory "
                         f"{str(cwd)!r}; writing there would replace it: choose another destination")


def _shown(p: PathLike) -> str:
    """``'p'``, with what it resolves to when that differs (a symlink, ``..``)."""
    r = str(real_path(p))
    return repr(os.fspath(p)) + ("" if r == os.path.abspath(os.fspath(p)) else f" (resolved: {r!r})")


def model_sources(model: object) -> list[str]:
    """The local paths a loaded model came from, as its loaders record them: qcore's ``qcore_source``,
    ``from_gguf``'s file (``qcore_gguf_report.path``), else transformers' ``name_or_path`` /
    ``config._name_or_path`` when it is a model directory here (one holding ``config.json``: transformers records
    a GGUF file's folder there, which is not the source). What an in-memory export must not write over."""
    out: list[str] = []
    cfg = getattr(model, "config", None)
    rep = getattr(model, "qcore_gguf_report", None)
    cands = [getattr(model, "qcore_source", None), getattr(rep, "path", None)]
    if rep is None:
        cands += [getattr(model, "name_or_path", None), getattr(cfg, "_name_or_path", None)]
    for p in cands:
        if not isinstance(p, (str, os.PathLike)) or not os.fspath(p) or os.fspath(p) in out:
            continue
        p = os.fspath(p)
        if os.path.isfile(p) or os.path.isfile(os.path.join(p, "config.json")):
            out.append(p)
    return out


def staging_dir(target: Path) -> Path:
    """A new empty hidden sibling of ``target`` (same file system, so the final rename is atomic), created with the
    usual permissions (``mkdir`` under the umask, not ``mkdtemp``'s 0o700: the renamed result is what users get)."""
    for _ in range(100):
        p = target.parent / f".{target.name}.tmp-{secrets.token_hex(4)}"
        try:
            p.mkdir()
            return p
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a staging directory beside {str(target)!r}")


def _aside(target: Path) -> Path:
    for _ in range(100):
        p = target.parent / f".{target.name}.old-{secrets.token_hex(4)}"
        if not os.path.lexists(p):
            return p
    raise FileExistsError(f"could not find a free name beside {str(target)!r}")


def remove(p: Path) -> None:
    """Delete ``p`` whatever it is (a directory tree, a file, a symlink: the link, never what it points to)."""
    if p.is_symlink() or (os.path.lexists(p) and not p.is_dir()):
        p.unlink(missing_ok=True)
    elif p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
        if os.path.lexists(p):  # a read-only tree: try once more, loudly
            shutil.rmtree(p)


def replace_dir(new: Path, target: Path, *, recheck: Callable[[], None]) -> None:
    """Move ``new`` (a directory or a file) to ``target``: a rename (atomic on one file system). A symlink
    ``target`` is followed: what it points to is replaced, the link stays. An existing target is first checked
    again with ``recheck()`` (it may have changed while the caller computed), moved aside, and deleted (a
    directory tree or a file alike) once the new one is in place; if that rename fails, the old target is put
    back. Nothing is left beside the target."""
    target = real_path(target)
    if not os.path.lexists(target):
        os.rename(new, target)
        return
    recheck()
    old = _aside(target)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    remove(old)


@contextlib.contextmanager
def staged_dir(target: PathLike, *, recheck: Callable[[], None]) -> Iterator[Path]:
    """``with staged_dir(target, recheck=...) as tmp:`` write into ``tmp`` (a ``staging_dir`` sibling of the
    resolved ``target``); on a normal exit it replaces ``target`` (``replace_dir``), on any error (Ctrl-C
    included) it is deleted and ``target`` is left as it was."""
    target = real_path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(target)
    try:
        yield tmp
        replace_dir(tmp, target, recheck=recheck)
    except BaseException:
        remove(tmp)
        raise


@contextlib.contextmanager
def staged_path(target: PathLike, *, recheck: Callable[[], None]) -> Iterator[Path]:
    """``with staged_path(target, recheck=...) as new:`` create a file or a directory at ``new`` (a path that does
    not exist yet, inside a ``staging_dir`` sibling of the resolved ``target``); on a normal exit it replaces
    ``target`` (``replace_dir``: a symlink stays a link, now to the new content); on any error, or when nothing
    was created, the staging is deleted and ``target`` is left as it was."""
    target = real_path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = staging_dir(target)
    try:
        yield stage / target.name
        if not os.path.lexists(stage / target.name):
            raise FileNotFoundError(f"nothing was written for {str(target)!r}")
        replace_dir(stage / target.name, target, recheck=recheck)
    finally:
        remove(stage)


@contextlib.contextmanager
def staged_file(target: PathLike, *, recheck: Callable[[], None]) -> Iterator[Path]:
    """``staged_path`` for a file: ``with staged_file(target, recheck=...) as tmp:`` write the file ``tmp``."""
    with staged_path(target, recheck=recheck) as tmp:
        yield tmp
        if os.path.lexists(tmp) and not tmp.is_file():
            raise IsADirectoryError(f"staged_file: {str(tmp)!r} is not a file")


def check_file_destination(path: PathLike, overwrite: bool, sources) -> None:
    """Before any work, for a writer of one file: ``path`` is not a source (``check_not_source``), not a
    directory, and new unless ``overwrite``."""
    path = Path(path)
    check_not_source(path, sources, what="path")
    if path.exists() and (path.is_dir() or not overwrite):
        raise FileExistsError(f"{str(path)!r} exists; pass overwrite=True to replace it" if not path.is_dir()
                              else f"{str(path)!r} is a directory")

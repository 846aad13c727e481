"""Atomic directory writes, shared by every writer of a directory (``qcore conformance export``,
``qcore.adapters.export_hf``): build the result in a staging sibling, then rename it into place."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator


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


def replace_dir(new: Path, target: Path, *, recheck: Callable[[], None]) -> None:
    """Move ``new`` to ``target``: a rename (atomic on one file system). An existing target is first checked
    again with ``recheck()`` (it may have changed while the caller computed), moved aside, and deleted only once
    the new one is in place; if that rename fails, the old target is put back."""
    if not target.exists():
        os.rename(new, target)
        return
    recheck()
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(target: Path, *, recheck: Callable[[], None]) -> Iterator[Path]:
    """``with staged_dir(target, recheck=...) as tmp:`` write into ``tmp`` (a ``staging_dir`` sibling); on a normal
    exit it replaces ``target`` (``replace_dir``), on any error (Ctrl-C included) it is deleted and ``target`` is
    left as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(target)
    try:
        yield tmp
        replace_dir(tmp, target, recheck=recheck)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

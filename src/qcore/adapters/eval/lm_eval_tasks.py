"""lm-evaluation-harness tasks on an in-memory model (``qcore eval --tasks``).

    tasks = load_tasks(["tests/data/lm_eval_tasks/python_basics.yaml"])   # documents read now, before any model
    for m in run_tasks(model, tokenizer, tasks, limit=100):
        print(m.task, m.metric, m.value, m.stderr)

A task is given as

* a name lm-evaluation-harness knows (``hellaswag``, ``arc_easy``: their documents come from the HF hub, so they
  need a network or a filled ``datasets`` cache), or the name of a task defined in a folder given in the same list;
* a task YAML file (``.yaml`` / ``.yml``): the task or group it defines;
* a folder: every task defined by the YAML files under it (and their names become usable in the same list).

A local YAML reads its documents from local files with ``dataset_path: json`` (or csv, parquet, text) and
``dataset_kwargs: {data_files: ...}``; a relative ``data_files`` path is read relative to the folder of the YAML
that defines the task (qcore loads each task with that folder as the working directory; lm-evaluation-harness
alone reads it relative to the working directory). Such a task needs no network: loading its documents makes no
connection (``datasets``' download-count request is switched off while the tasks load), and it works with
``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``.

The model is wrapped in ``lm_eval.models.huggingface.HFLM(pretrained=model, tokenizer=tokenizer)``: any
transformers causal LM, quantized by qcore or not, on its own device. lm-evaluation-harness seeds python, numpy
and torch itself (its defaults), so two runs of the same model give the same numbers. Needs ``pip install lm-eval``
(the ``lmeval`` extra); this module imports it only when a function runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import logging
import os
import pathlib
from typing import Any, Iterator, Optional, Sequence

__all__ = ["TaskMetric", "TaskSet", "load_tasks", "require_lm_eval", "run_tasks"]

INSTALL_HINT = "pip install lm-eval (or the qcore-numerics[lmeval] extra)"
_YAML_SUFFIXES = (".yaml", ".yml")
_BOOTSTRAP_ITERS = 1000  # stderr of mean metrics is closed-form; other metrics (f1, bleu, ...) are bootstrapped


def require_lm_eval() -> None:
    """Raise ``ModuleNotFoundError`` (with the pip command) when lm-evaluation-harness is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ModuleNotFoundError(f"lm-evaluation-harness tasks need the lm_eval package: {INSTALL_HINT}")


@dataclasses.dataclass(frozen=True)
class TaskMetric:
    """One metric of one task (or group) of a run.

    ``filter`` is lm-evaluation-harness's filter name (``none`` unless the task post-processes answers);
    ``stderr`` is None where lm-evaluation-harness gives none; ``samples`` (documents evaluated) and
    ``num_fewshot`` are None for a group."""

    task: str
    metric: str
    value: float
    stderr: Optional[float] = None
    filter: str = "none"
    samples: Optional[int] = None
    num_fewshot: Optional[int] = None
    higher_is_better: Optional[bool] = None

    def __post_init__(self):
        for name in ("task", "metric", "filter"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise TypeError(f"TaskMetric: {name} must be a non-empty str, got {getattr(self, name)!r}")
        if not isinstance(self.value, float):
            raise TypeError(f"TaskMetric: value must be a float, got {self.value!r}")


@dataclasses.dataclass(frozen=True)
class TaskSet:
    """Tasks loaded by :func:`load_tasks` (documents read), ready for :func:`run_tasks` (reusable: a run changes
    nothing a later run sees). ``names``: the top-level task and group names, in the order given."""

    specs: tuple[str, ...]
    names: tuple[str, ...]
    num_fewshot: Optional[int]
    task_manager: Any = dataclasses.field(repr=False, compare=False)
    objects: tuple = dataclasses.field(repr=False, compare=False)


def _is_path(spec: str) -> bool:
    """A task spec names a file or folder (rather than a registered task) when it ends in .yaml / .yml, holds a
    path separator, or exists on disk."""
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    return spec.lower().endswith(_YAML_SUFFIXES) or any(s in spec for s in seps) or pathlib.Path(spec).exists()


@contextlib.contextmanager
def _working_directory(path: Optional[pathlib.Path]) -> Iterator[None]:
    if path is None:
        yield
        return
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _no_download_count() -> Iterator[None]:
    """``datasets.load_dataset`` sends a HEAD request (a download count) for every dataset, local files included,
    unless offline: switched off while qcore loads tasks (it never changes what is loaded)."""
    import datasets.config as dc
    had = hasattr(dc, "HF_UPDATE_DOWNLOAD_COUNTS")
    before = getattr(dc, "HF_UPDATE_DOWNLOAD_COUNTS", None)
    dc.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        if had:
            dc.HF_UPDATE_DOWNLOAD_COUNTS = before
        else:
            del dc.HF_UPDATE_DOWNLOAD_COUNTS


@contextlib.contextmanager
def _logger_level(name: str, level: int) -> Iterator[None]:
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(max(level, before) if before else level)
    try:
        yield
    finally:
        logger.setLevel(before)


@contextlib.contextmanager
def _quiet_git_hash() -> Iterator[None]:
    """``simple_evaluate`` records ``git describe --always`` of the working directory, run with the terminal's
    stderr: outside a git checkout git prints "fatal: not a git repository". The same lookup (and lm-eval's own
    fallback) with git's stderr discarded; the value is lm-eval's bookkeeping, which qcore does not report."""
    import subprocess
    import lm_eval.evaluator as ev
    if not hasattr(ev, "get_git_commit_hash"):
        yield
        return
    before = ev.get_git_commit_hash

    def quiet() -> Optional[str]:
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL,
                                           stdin=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, OSError):
            from lm_eval.loggers.utils import get_commit_from_path
            return get_commit_from_path(os.getcwd())

    ev.get_git_commit_hash = quiet
    try:
        yield
    finally:
        ev.get_git_commit_hash = before


_TQDM_MODULES = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface")


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """With ``enabled`` False: datasets' bars off, and lm-evaluation-harness's (its modules' ``tqdm``, created with
    ``disable=False``) replaced by silent ones; everything restored afterwards."""
    if enabled:
        yield
        return
    import sys

    import datasets
    from tqdm import tqdm

    class _Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    patched = []
    for name in _TQDM_MODULES:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "tqdm", None) is tqdm:
            mod.tqdm = _Silent
            patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            mod.tqdm = tqdm
        if was:
            datasets.enable_progress_bars()


def _unknown(name: str, known: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(name, known, n=3)
    return ValueError(f"tasks: {name!r} is not a task lm-evaluation-harness knows"
                      + (f" (did you mean {', '.join(close)}?)" if close else "")
                      + "; a local task is a path: a task YAML file or a folder of them (see docs/adapters.md)")


def load_tasks(tasks: Sequence[str], *, num_fewshot: Optional[int] = None, progress: bool = True) -> TaskSet:
    """Resolve ``tasks`` (names, task YAML files, folders: see the module docstring) and read their documents.

    ``num_fewshot``: few-shot examples per prompt for every task (None: each task's own default, 0 when it has
    none; a task whose YAML sets 0 keeps 0). Errors (ValueError) name the task before any model work."""
    if isinstance(tasks, str) or not isinstance(tasks, Sequence):
        raise TypeError(f"tasks must be a sequence of task names or paths, got {tasks!r}")
    if not tasks or not all(isinstance(t, str) and t.strip() for t in tasks):
        raise ValueError(f"tasks must be a non-empty sequence of non-empty str, got {list(tasks)!r}")
    if num_fewshot is not None and (isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int)
                                    or num_fewshot < 0):
        raise ValueError(f"num_fewshot must be None or an int >= 0, got {num_fewshot!r}")
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    # (spec handed to TaskManager.load, folder its YAML lives in) in the order given; folders expand to their tasks
    folders: list[pathlib.Path] = []
    items: list[tuple[str, Optional[pathlib.Path], str]] = []  # (spec, yaml folder or None, as given)
    names: list[str] = []
    for spec in tasks:
        spec = spec.strip()
        if not _is_path(spec):
            names.append(spec)
            items.append((spec, None, spec))
            continue
        p = pathlib.Path(spec).expanduser().resolve()
        if p.is_dir():
            folders.append(p)
            local = TaskManager(include_path=str(p), include_defaults=False)
            if not local.all_subtasks:
                raise ValueError(f"tasks: {spec!r}: the folder defines no lm-evaluation-harness task (no YAML "
                                 f"file with a 'task:' key under it)")
            for name in local.all_subtasks:
                items.append((name, None, spec))
        elif p.is_file():
            if p.suffix.lower() not in _YAML_SUFFIXES:
                raise ValueError(f"tasks: {spec!r}: a local task is a .yaml / .yml file (or a folder of them)")
            items.append((str(p), p.parent, spec))
        else:
            raise ValueError(f"tasks: {spec!r}: no such file or folder")

    include = [str(f) for f in folders] or None

    def full_index():  # lm-evaluation-harness's own tasks too: some seconds (thousands of YAML files to read)
        with _logger_level("lm_eval", logging.ERROR):
            return TaskManager(include_path=include, include_defaults=True)

    # only the given folders' index when that resolves every name (a YAML file needs no index)
    tm = TaskManager(include_path=include, include_defaults=False)
    full = False
    if not all(n in tm.all_tasks for n in names):
        tm, full = full_index(), True
    for n in names:
        if n not in tm.all_tasks:
            raise _unknown(n, tm.all_tasks)

    seen: dict[str, None] = {}
    objects: list = []
    top: list[str] = []
    with _no_download_count(), _progress_bars(progress):
        for spec, folder, given in items:
            if spec in seen:
                continue
            seen[spec] = None
            if folder is None:
                entry = tm.task_index.get(spec)
                yaml_path = getattr(entry, "yaml_path", None)
                folder = pathlib.Path(yaml_path).parent if yaml_path else None
            while True:
                try:
                    with _working_directory(folder):
                        loaded = tm.load([spec])
                    break
                except KeyError as e:
                    if full:  # (else: perhaps a local group naming one of lm-evaluation-harness's tasks)
                        raise ValueError(f"tasks: {given!r}: could not load the task (KeyError: {e})") from e
                    tm, full = full_index(), True
                except Exception as e:  # noqa: BLE001 - lm-evaluation-harness / datasets raise many kinds
                    first = str(e).splitlines()[0] if str(e) else ""
                    raise ValueError(f"tasks: {given!r}: could not load the task or its documents "
                                     f"({type(e).__name__}: {first})") from e
            groups, leaf = loaded["groups"], loaded["tasks"]
            children = {c for g in groups.values() for c in g.child_names}
            for g in groups.values():
                if g.name not in children:
                    objects.append(g)
                    top.append(g.name)
            in_groups = {t.task_name for g in groups.values() for t in g.get_all_tasks()}
            for name, t in leaf.items():
                if name not in in_groups:
                    objects.append(t)
                    top.append(name)
    dup = sorted({n for n in top if top.count(n) > 1})
    if dup:
        raise ValueError(f"tasks: {', '.join(dup)} given twice (by name and through a file or folder)")
    return TaskSet(specs=tuple(t.strip() for t in tasks), names=tuple(top), num_fewshot=num_fewshot,
                   task_manager=tm, objects=tuple(objects))


def run_tasks(model, tokenizer, tasks, *, limit: Optional[int] = None, batch_size: int = 1,
              progress: bool = True) -> tuple[TaskMetric, ...]:
    """Evaluate a transformers causal LM on lm-evaluation-harness tasks; one :class:`TaskMetric` per metric.

    ``tasks``: a :class:`TaskSet` from :func:`load_tasks`, or what it takes (names and paths). ``limit``: at most
    this many documents per task (None: all). ``batch_size``: requests per forward pass."""
    if tokenizer is None:
        raise ValueError("tokenizer must be the model's tokenizer, got None (lm-evaluation-harness tasks need one)")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or an int >= 1, got {limit!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not isinstance(tasks, TaskSet):
        tasks = load_tasks(tasks, progress=progress)
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    with _progress_bars(progress), _quiet_git_hash():
        # HFLM warns that a model object (not a hub id) ignores its loading arguments: expected here
        with _logger_level("lm_eval.models.huggingface", logging.ERROR):
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        r = simple_evaluate(lm, tasks=list(tasks.objects), task_manager=tasks.task_manager,
                            num_fewshot=tasks.num_fewshot, limit=limit, bootstrap_iters=_BOOTSTRAP_ITERS,
                            log_samples=False)
    return _metrics(r)


def _number(v) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _metrics(r: dict) -> tuple[TaskMetric, ...]:
    out = []
    n_shot = r.get("n-shot", {})
    n_samples = r.get("n-samples", {})
    better = r.get("higher_is_better", {})
    for task, res in r["results"].items():
        for key, v in res.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            value = _number(v)
            if value is None:
                continue
            samples = n_samples.get(task, {}).get("effective")
            out.append(TaskMetric(task=task, metric=metric, value=value,
                                  stderr=_number(res.get(f"{metric}_stderr,{filt}")), filter=filt,
                                  samples=int(samples) if samples is not None else None,
                                  num_fewshot=n_shot.get(task) if task in n_samples else None,
                                  higher_is_better=better.get(task, {}).get(metric)))
    return tuple(out)

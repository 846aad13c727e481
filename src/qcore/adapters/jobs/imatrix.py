"""``qcore imatrix`` as a function: ``imatrix_file`` loads a model, collects its importance matrix on the windows
``qcore quantize`` calibrates on and writes llama.cpp's file (``qcore.adapters.imatrix`` collects and reads the
statistic; this job only chooses the model, the text and the file)."""

from __future__ import annotations

import os

from ..eval import evaluate as E
from ..eval import models as M
from ..imatrix import collect_imatrix, imatrix_format, save_imatrix
from .common import (PYTHON, CommandError, Names, calibration_windows, check_device, check_seq_len,
                     check_writable_file, load_model, protocol_windows, read_eval_text, torch_dtype)
from .files import JobFiles

__all__ = ["imatrix_file", "job_files"]


def job_files(model, output, *, eval_text=None, names: Names = PYTHON) -> JobFiles:
    """What ``imatrix_file`` reads (the model: its file or directory, or the embedded SmolLM2's file; the text)
    and writes (``output``), named as ``names`` names them."""
    if model is None:
        try:
            models = [str(M.smollm2_path())]
        except (ImportError, FileNotFoundError):
            models = []  # loading the model says what is missing
    else:
        models = [model] if os.path.exists(model) else []  # else a hub id
    return JobFiles.of(names, reads=[*(("model", p) for p in models), ("eval_text", eval_text)],
                       writes=[("output", output, "the imatrix file")])


def imatrix_file(model=None, output=None, *, calib_samples: int = 32, seq_len: int = 512, eval_text=None,
                 process_output: bool = False, device: str = "cpu", dtype: str = "float32", overwrite: bool = False,
                 progress: bool = True, names: Names = PYTHON) -> dict:
    """``qcore imatrix``: load ``model`` (an HF directory, a ``.gguf`` file, a hub id; None: the embedded
    SmolLM2), collect its importance matrix on the calibration windows ``qcore quantize`` calibrates on
    (``calib_samples`` windows of ``seq_len`` tokens of the protocol text, after its evaluation windows; or of
    ``eval_text``), and write llama.cpp's file ``output`` (``.gguf`` or ``.dat``) with ``chunk_size =
    seq_len``. Everything is checked before the model is loaded (the context ``seq_len`` must fit in, once it is):
    ``output`` is none of the files read (the model, ``eval_text``; ``job_files``). ``names``: how errors name the
    options (``CLI``: the flags). Returns a summary (entries, tokens, path)."""

    if output is None:
        raise ValueError("output must be given: the imatrix file to write (.gguf or .dat)")
    for name, v in (("model", model), ("output", output), ("eval_text", eval_text)):
        if v is not None and (not isinstance(v, (str, os.PathLike)) or not os.fspath(v)):
            raise TypeError(f"{names(name)} must be a path (str or os.PathLike), got {v!r}")
    model, output = (None if model is None else os.fspath(model)), os.fspath(output)
    eval_text = None if eval_text is None else os.fspath(eval_text)
    job_files(model, output, eval_text=eval_text, names=names).check()  # never over the model or the text
    try:
        fmt = imatrix_format(output, None)
    except ValueError:
        raise CommandError(f"{names.arg('output', output)}: an imatrix file is named .gguf (llama.cpp's default "
                           f"format) or .dat (legacy)") from None
    for name, v, lo in (("calib_samples", calib_samples, 1), ("seq_len", seq_len, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{names.arg(name, v)}: expected an int >= {lo}")
    if os.path.exists(output) and not overwrite:
        raise FileExistsError(f"{names.arg('output', output)}: exists; pass {names('overwrite')}"
                              f"{'' if names.cli else '=True'} to replace it")
    check_writable_file(names("output"), output)
    check_device(device, names=names)
    text = read_eval_text(eval_text, names=names)
    m, tok, desc = load_model(model, dtype=torch_dtype(dtype, names=names), device=device, names=names)
    if tok is None:
        raise CommandError(f"{names.arg('model', desc)}: no tokenizer found next to the model; the calibration "
                           f"windows need one")
    check_seq_len(seq_len, m, names=names)
    ids = E.protocol_token_ids(tok, text=text)
    _, start = protocol_windows(ids, seq_len, text=text)  # the windows qcore quantize calibrates on
    n = min(calib_samples, ids.numel() // seq_len - start)
    if n <= 0:
        raise CommandError(f"the text ({ids.numel()} tokens) has no calibration window of "
                           f"{names.arg('seq_len', seq_len)} tokens left after its {start} evaluation windows")
    calib = calibration_windows(ids, seq_len, start, n)
    stats = collect_imatrix(m, calib, process_output=process_output, progress=progress)
    save_imatrix(stats, output, format=fmt, datasets=(os.fspath(eval_text) if eval_text else "pydoc_data.topics"),
                 chunk_size=seq_len, overwrite=overwrite)
    return {"path": os.fspath(output), "format": fmt, "entries": len(stats), "windows": n, "tokens": n * seq_len,
            "model": desc}

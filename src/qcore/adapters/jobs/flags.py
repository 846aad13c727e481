"""Which options of the main job (``qcore quantize``, ``quantize_and_report``) have an effect in which context, as
data (``QUANTIZE_NEEDS``, ``qcore._argtypes.Needs`` entries), and the checks that refuse an option given where it
changes nothing: ``check_flags`` (the options alone, before anything is read), ``check_scheme_flags`` (the scheme
resolved, before the model loads). The other commands' tables are beside their flags in ``qcore.adapters.cli``.

An option is *given* when the command line names it (``qcore quantize`` passes only the flags the user typed) or,
in Python, when its value differs from ``quantize_and_report``'s default; a default is never refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from qcore._argtypes import Needs, check_needs

from ..imatrix import check_importance_algorithms
from ..io.formats import FORMATS
from ..presets import mix_of_preset
from .common import CommandError, Names
from .report import LAYER_ERROR_WINDOWS
from .scheme import needs_calibration, quantizes_activations

__all__ = ["QUANTIZE_NEEDS", "shown", "check_flags", "check_scheme_flags", "calibration_readers"]


def shown(names: Names, option: str, value: Any) -> str:
    """An option as the user gave it: ``--overwrite`` / ``--no-cache`` (a switch), ``--seq-len 64`` on the command
    line; ``seq_len=64`` in Python."""
    if names.cli and isinstance(value, bool):
        return names(option)
    return names.arg(option, value)


def _windows(o: Mapping) -> bool:
    """Whether the run reads text windows: perplexity, or calibration windows (the scales, the algorithms, AMP,
    ``imatrix="calib"`` and the per-layer output SQNR of the report all read them); AMP and ``imatrix="calib"``
    always want them (with ``calib_samples=0`` the job then refuses that, naming it)."""
    return o["eval"] == "ppl" or o["calib_samples"] > 0 or o["amp"] is not None or o["imatrix"] == "calib"


def _no_windows(what: str):
    return lambda n, o: (f"{what}; with {n.arg('eval', 'none')} and {n.arg('calib_samples', 0)} no window is read "
                         f"(neither perplexity nor calibration)")


def _export_option(fmt) -> tuple:
    """The entries of ``fmt``'s own export options (``Format.options``): each applies to ``export=fmt`` only."""
    return tuple(Needs(name, lambda o, f=fmt.name: o["export"] == f,
                       lambda n, o, f=fmt.name: f"applies to {n.arg('export', f)}" + (
                           "" if o["export"] is None else f", not {n.arg('export', o['export'])}"))
                 for name, _ in fmt.options)


def _sharded(o: Mapping) -> bool:
    return o["output"] is not None and FORMATS[o["export"] or "hf"].shards


def _shard_why(n: Names, o: Mapping) -> str:
    if o["output"] is None:
        return f"applies to the checkpoint written to {n.meta('output', 'DIR')}; this run writes none"
    return (f"applies to the formats written as safetensors shards ("
            f"{', '.join(n.arg('export', f.name) for f in FORMATS.values() if f.shards)}), not "
            f"{n.arg('export', o['export'])}")


#: the main job's options that have an effect only in some contexts (the others always have one: the model, the
#: scheme and its adjustments, the algorithms, --calib-samples (the report's per-layer output SQNR is measured on
#: calibration windows whatever the scheme), device, dtype, --eval, --output, --report, --plot (the weight SQNR
#: needs no evaluation), progress); an option's scheme- and model-dependent contexts are checked later
#: (``check_scheme_flags``; --group-size and --work-dir by the scheme's own checks)
QUANTIZE_NEEDS: tuple = (
    Needs("eval_text", _windows, _no_windows("is read for perplexity and the calibration windows")),
    Needs("seq_len", _windows, _no_windows("is the length of the perplexity and calibration windows")),
    Needs("cache", lambda o: o["eval"] == "ppl",
          lambda n, o: f"applies to the float model's perplexity, which {n.arg('eval', 'none')} does not measure"),
    Needs("kl", lambda o: o["eval"] == "ppl",
          lambda n, o: f"applies to the KL divergence measured beside perplexity, which {n.arg('eval', 'none')} "
                       f"does not measure"),
    Needs("target_bits", lambda o: o["amp"] is not None,
          lambda n, o: f"applies to {n('amp')} (layerwise mixed precision): give {n('amp')} SCHEMES too"),
    Needs("max_loss", lambda o: o["amp"] is not None,
          lambda n, o: f"applies to {n('amp')} (layerwise mixed precision): give {n('amp')} SCHEMES too"),
    Needs("amp_samples", lambda o: o["amp"] is not None,
          lambda n, o: f"applies to {n('amp')} (the calibration windows it measures layer sensitivities on)"),
    Needs("amp_samples", lambda o: o["amp"] is None or o["amp_samples"] <= o["calib_samples"],
          lambda n, o: f"is more than {n.arg('calib_samples', o['calib_samples'])}: {n('amp')} measures layer "
                       f"sensitivities on the first calibration windows; give {n('calib_samples')} "
                       f"{o['amp_samples']} or more"),
    Needs("export", lambda o: o["output"] is not None,
          lambda n, o: f"needs {n.meta('output', 'DIR')} (where to write the checkpoint)"),
    *(e for f in FORMATS.values() for e in _export_option(f)),
    Needs("overwrite", lambda o: o["output"] is not None,
          lambda n, o: f"applies to {n.meta('output', 'DIR')} (an existing checkpoint there is replaced); this run "
                       f"writes none"),
    Needs("max_shard_size", _sharded, _shard_why),
    Needs("resume", lambda o: o["work_dir"] is not None,
          lambda n, o: f"needs {n.meta('work_dir', 'DIR')}: there is nothing to resume without the directory an "
                       f"earlier run saved its progress in"),
)


def check_flags(options: Mapping[str, Any], given: Any, names: Names) -> None:
    """Refuse (``CommandError``, one line naming the option and why) an option of ``given`` that has no effect
    with the other ``options`` (``quantize_and_report``'s arguments, defaults filled in)."""
    check_needs(QUANTIZE_NEEDS, options, given=given, show=lambda k, v: shown(names, k, v), names=names,
                error=CommandError)


def _gguf_weights(config) -> bool:
    """Whether any layer config of ``config`` gives a weight a GGUF type."""
    layers = [config.layer, *config.by_type.values(), *config.by_name.values()]
    return any(lc is not None and lc.weight is not None and lc.weight.spec.gguf for lc in layers)


def calibration_readers(job, config, amp_schemes) -> list:
    """What in the run calibrates on the calibration windows (``needs_calibration``: static scales, the KV cache,
    the algorithms; AMP; ``imatrix="calib"``), named as the caller gave it; empty when nothing does."""
    names = job.names
    return needs_calibration(config, names) + ([f"{names('amp')}'s layer sensitivities"]
                                                if amp_schemes is not None else []) + (
        [names.arg("imatrix", "calib")] if job.scheme.imatrix == "calib" else [])


def check_scheme_flags(job, config, amp_schemes) -> None:
    """What the resolved scheme decides about the options, before the model loads: ``imatrix`` needs GGUF weight
    types (a llama.cpp mix, or a config giving them), no AMP, and no algorithm that changes the layers' inputs;
    ``drop_activations`` needs a scheme quantizing activations; ``calib_samples`` above the report's
    ``LAYER_ERROR_WINDOWS`` needs something that calibrates (a weight-only scheme rounded without data reads only
    those first windows: more would change nothing; the default is never refused)."""
    names, s, ex = job.names, job.scheme, job.export
    n = job.calibration.samples
    if n > LAYER_ERROR_WINDOWS and n != type(job.calibration)().samples and not calibration_readers(
            job, config, amp_schemes):
        raise CommandError(f"{names.arg('calib_samples', n)} has no effect: nothing in this run calibrates (no "
                           f"static scales, KV cache, algorithm reading data, {names('amp')} or "
                           f"{names.arg('imatrix', 'calib')}); only the summary's per-layer output SQNR reads "
                           f"calibration windows, the first {LAYER_ERROR_WINDOWS}")
    if ex.drop_activations and amp_schemes is None and not quantizes_activations(config):
        raise CommandError(f"{shown(names, 'drop_activations', True)} has no effect: the scheme quantizes no "
                           f"activations (nothing to drop)")
    if s.imatrix is None:
        return
    im = names.arg("imatrix", s.imatrix)
    if amp_schemes is not None:
        raise CommandError(f"{im} with {names('amp')}: the AMP schemes have no GGUF types, which is what an "
                           f"importance matrix weights")
    if mix_of_preset(s.scheme) is None and not _gguf_weights(config):
        raise CommandError(f"{im} applies to GGUF weight types (q2_k ... q6_k, q4_0 ... q8_0, iq4_nl: llama.cpp's "
                           f"mixes, e.g. {names.arg('scheme', 'gguf_q4_k_m')}); the scheme gives none")
    try:
        check_importance_algorithms(config.algorithms)
    except ValueError:
        changers = [a.name for a in config.algorithms]
        raise CommandError(f"{im} with {names.arg('algorithms', ','.join(changers))}: rotations and smoothing change "
                           f"the layers' inputs, so an importance matrix of the float model no longer describes "
                           f"them") from None


def given_options(arguments: Mapping[str, Any], options: Mapping[str, Any], defaults: Mapping[str, Any],
                  names: Names) -> set:
    """The options of ``QUANTIZE_NEEDS`` the caller gave among ``arguments``: on the command line every one passed
    (``qcore quantize`` passes only the flags typed), in Python those whose value (``options``: checked and
    normalised) is not the default."""
    keys = {n.option for n in QUANTIZE_NEEDS} & set(arguments)
    return {k for k in keys if options[k] is not None and (names.cli or options[k] != defaults[k])}

"""The main job's scheme: a preset name (``presets.preset``; llama.cpp's mixes resolved on the loaded model by
``gguf_mix``), a JSON file (a qcore config, a Quark ``quantization_config`` or an HF ``config.json`` holding one) or
a ``ModelConfig``, with ``group_size``, the KV cache and ``exclude`` applied (``build_config``); AMP's presets
(``check_amp_schemes``); what in a config reads calibration windows (``needs_calibration``). Errors are
``CommandError``s naming the option as the job's ``Names`` spell it."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Optional

from qcore.algorithms.config import QuaRotConfig

from ..config import KVCacheConfig, LayerConfig, ModelConfig, check_pattern
from ..io.formats import format_of_method
from ..presets import PRESETS, mix_of_preset, preset, similar_schemes, takes_group_size
from .common import CLI, CommandError, Names

__all__ = ["DEFAULT_SCHEME", "build_config", "read_scheme_file", "check_amp_schemes", "needs_calibration",
           "quantizes_activations"]

DEFAULT_SCHEME = "ptpc_fp8"  # fp8 weights per channel, fp8 activations per token: ppl 14.49 vs 14.01 on SmolLM2


def quantizes_activations(config) -> bool:
    layers = [config.layer, *config.by_type.values(), *config.by_name.values()]
    return config.kv_cache is not None or any(lc is not None and (lc.input is not None or lc.output is not None)
                                              for lc in layers)


def _did_you_mean(name: str) -> str:
    close = similar_schemes(name)
    return f"; did you mean {', '.join(close)}?" if close else ""


def check_amp_schemes(amp, scheme, group_size, target_bits, max_loss, names: Names) -> Optional[list]:
    """The ``amp`` schemes (checked before any work), or None without ``amp``."""
    if amp is None:
        if target_bits is not None or max_loss is not None:
            raise CommandError(f"{names('target_bits')} / {names('max_loss')} apply to {names('amp')} (layerwise "
                               f"mixed precision)")
        return None
    if scheme is not None or group_size is not None:
        raise CommandError(f"{names('amp')} chooses the scheme of every layer: give {names('amp')} or "
                           f"{names('scheme')} / {names('group_size')}, not both")
    if (target_bits is None) == (max_loss is None):
        raise CommandError(f"{names('amp')} needs exactly one of {names('target_bits')} and {names('max_loss')}")
    names_ = [n.strip() for n in amp.split(",") if n.strip()] if isinstance(amp, str) else list(amp)
    for n in names_:
        if n != "float" and n not in PRESETS:
            raise CommandError(f"{names('amp')}: {n!r} is not a preset" + _did_you_mean(n)
                               + " (qcore schemes lists them; 'float' leaves a layer as it is)")
    if len(set(names_)) != len(names_) or not any(n != "float" for n in names_):
        raise CommandError(f"{names.arg('amp', amp)}: expected distinct preset names, at least one of them "
                           f"quantizing")
    if target_bits is not None:  # a lower bound: per-tensor / per-channel scales add a little on top
        fewest = min((preset(n).layer.weight.spec.bits_per_element(), n) for n in names_ if n != "float")
        if target_bits < fewest[0]:
            raise CommandError(f"{names.arg('target_bits', target_bits)}: below the fewest bits per weight any "
                               f"{names('amp')} scheme stores ({fewest[0]:.2f}, {fewest[1]}); no choice of schemes "
                               f"reaches it")
    return names_


def read_scheme_file(scheme: str, *, names: Names = CLI) -> ModelConfig:
    """The ``ModelConfig`` of a ``--scheme`` JSON file (a qcore config, a Quark ``quantization_config`` or an HF
    ``config.json`` holding one); every problem is a ``CommandError`` naming the file."""
    path = pathlib.Path(scheme)
    where = names.arg("scheme", scheme)
    if not path.is_file():
        raise CommandError(f"{where}: no such file")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CommandError(f"{where}: not JSON ({e})") from None
    except RecursionError:
        raise CommandError(f"{where}: the JSON is nested too deeply to be a config") from None
    if not isinstance(d, dict):
        raise CommandError(f"{where}: expected a JSON object (a qcore ModelConfig or a Quark "
                           f"quantization_config), got a JSON {type(d).__name__}")
    d = d.get("quantization_config", d)
    if not isinstance(d, dict):
        raise CommandError(f"{where}: quantization_config must be a JSON object, got a JSON "
                           f"{type(d).__name__}")
    try:
        fmt = format_of_method(d.get("quant_method"))  # a checkpoint's quantization_config: as its format reads it
        config = fmt.config_of(d) if fmt is not None else ModelConfig.from_dict(d)
    except (ValueError, TypeError) as e:
        raise CommandError(f"{where}: {e}") from None
    return config


def build_config(scheme, *, group_size=None, kv_cache_dtype=None, exclude=None,
                 names: Names = CLI) -> tuple[ModelConfig, str]:
    """``(ModelConfig, label)`` of ``scheme`` (a preset name, a JSON file: a qcore config or a Quark
    ``quantization_config``, or a ``ModelConfig``; None: ``DEFAULT_SCHEME``) with ``group_size``,
    ``kv_cache_dtype`` and ``exclude`` applied."""
    if isinstance(scheme, ModelConfig):
        config, label = scheme, "config"
    else:
        label = scheme = os.fspath(scheme) if scheme is not None else DEFAULT_SCHEME
        config = read_scheme_file(scheme, names=names) if scheme.endswith(".json") or os.path.sep in scheme \
            else None
    if config is not None:
        if group_size is not None:
            raise CommandError(f"{names('group_size')} applies to a preset {names('scheme')}, not to a "
                               f"{'JSON ' if not isinstance(scheme, ModelConfig) else ''}config (set it there)")
        if kv_cache_dtype:
            config = config.replace(kv_cache=KVCacheConfig())
    elif mix_of_preset(scheme) is not None:  # llama.cpp's mix: resolved on the model once it is loaded (the check)
        if group_size is not None:
            raise CommandError(f"{names('group_size')} does not apply to {names.arg('scheme', scheme)}: llama.cpp's "
                               f"mixes fix each type's blocks")
        config = ModelConfig(LayerConfig())
        if kv_cache_dtype:
            config = config.replace(kv_cache=KVCacheConfig())
    else:
        if scheme not in PRESETS:
            raise CommandError(f"{names.arg('scheme', scheme, quote=True)} is not a preset" + _did_you_mean(scheme)
                               + " (qcore schemes lists them; a .json file is read as a config)")
        if group_size is not None and not takes_group_size(scheme):
            raise CommandError(f"{names.arg('group_size', group_size)} does not apply to {names.arg('scheme', scheme)}"
                               f": the preset has no per-group or block role")
        try:
            config = preset(scheme, group_size=group_size, kv_cache=kv_cache_dtype)
        except (ValueError, TypeError) as e:
            if group_size is None:
                raise
            raise CommandError(f"{names.arg('group_size', group_size)}: {e}") from None
    if exclude is not None:
        for p in exclude:  # a bad pattern named as given (--exclude 're:[a'), not as the config field it becomes
            check_pattern(p, names.arg("exclude", p, quote=True))
        try:
            config = config.replace(exclude=tuple(exclude))
        except (ValueError, TypeError) as e:
            raise CommandError(f"{names('exclude')}: {e}") from None
    return config, label


def needs_calibration(config: ModelConfig, names: Names = CLI) -> list[str]:
    """What in ``config`` reads calibration windows: static activation scales, the KV cache, the algorithms
    (all but QuaRot and the data-free HQQ); empty when nothing does."""
    need = []
    layers = [(names("scheme"), config.layer), *((f"by_type {k}", v) for k, v in config.by_type.items()),
              *((f"by_name {k!r}", v) for k, v in config.by_name.items())]
    for where, lc in layers:
        for role in ("input", "output"):
            tc = None if lc is None else getattr(lc, role)
            if tc is not None and tc.calibrated:
                need.append(f"static {role} scales ({where})")
    if config.kv_cache is not None:
        need.append("KV-cache scales")
    if config.algorithms:
        need += [f"algorithm {a.name}" for a in config.algorithms
                 if not isinstance(a, QuaRotConfig) and not getattr(a, "data_free", False)]  # HQQ: data-free
    return need

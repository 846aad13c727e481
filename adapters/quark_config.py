"""``ModelConfig`` <-> AMD Quark's ``quantization_config`` (the schema of ``qcore.formats.quark_hf``).

- ``config_from_quark(d)``: Quark's dict (as written in an HF ``config.json``) -> ``ModelConfig``.
- ``config_to_quark(config)``: ``ModelConfig`` -> Quark's dict, every field Quark writes derived the way Quark 0.13
  writes it (observer classes, ``ch_axis`` spellings, ``"export"`` block).

A Quark config read and written back is equal (tested on configs written by Quark 0.13 itself). What does not
map is refused with a ``ValueError`` naming the field, in both directions: Quark's softmax quantization, KV
scales after RoPE, progressive two-stage weights (``int4_fp8``), ``Percentile``/``MSE`` observers,
non-default export settings.

Mapping: ``global_quant_config`` <-> ``layer``; ``layer_quant_config`` <-> ``by_name``;
``layer_type_quant_config`` <-> ``by_type``; ``exclude`` <-> ``exclude`` (qcore's default, the model's output
head, is written as Quark's ``["lm_head"]``, and Quark's ``["lm_head"]`` is read as that default, so the config also
applies to models without an ``lm_head``); ``kv_cache_quant_config`` (one entry per target: the global layer config with
``output_tensors`` replaced) <-> ``kv_cache``; ``algo_config`` <-> ``algorithms``. Two-level NVFP4: Quark's
static scale-of-scales spec is ``TensorScale.GIVEN``; on weights qcore computes it from the weight
(``TensorScale.AMAX``), which is what Quark's static weight observer does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

from qcore import TensorScale
from qcore.formats.quark_hf import QuarkConfig, QuarkExport, QuarkLayerSpec, qcore_to_quark, quark_to_qcore

from .config import MODULE_TYPES, KVCacheConfig, LayerConfig, MinMax, ModelConfig, TensorConfig

__all__ = ["config_from_quark", "config_to_quark"]

_ROLES = {"weight": "weight", "input": "input_tensors", "output": "output_tensors", "bias": "bias"}
_QUARK_VERSION = "0.13"


def _tc_from_quark(value, role: str, where: str, model_dtype: str) -> Optional[TensorConfig]:
    if value is None:
        return None
    try:
        spec, dynamic = quark_to_qcore(value, role=role, model_dtype=model_dtype)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    if role in ("weight", "bias") and spec.tensor_scale_mode is TensorScale.GIVEN:
        spec = dataclasses.replace(spec, tensor_scale_mode=TensorScale.AMAX)
    if role in ("weight", "bias"):
        dynamic = False  # Quark writes is_dynamic false for weights; qcore's weights are always from the weight
    return TensorConfig(spec, dynamic=dynamic)


def _layer_from_quark(ls: QuarkLayerSpec, where: str, model_dtype: str) -> LayerConfig:
    return LayerConfig(**{r: _tc_from_quark(getattr(ls, q), r, f"{where}.{q}", model_dtype) for r, q in _ROLES.items()})


def _tc_to_quark(tc: Optional[TensorConfig], role: str, where: str, model_dtype: str, like=None):
    if tc is None:
        return None
    if like is not None:  # keep the source's spelling of the same numerics
        try:
            if _tc_from_quark(like, role, where, model_dtype) == tc:
                return like
        except ValueError:
            pass
    if not isinstance(tc.observer, MinMax):
        raise ValueError(f"{where}: observer {tc.observer!r} has no Quark spelling here (only MinMax() converts)")
    spec = tc.spec
    if role in ("weight", "bias") and spec.tensor_scale_mode is TensorScale.AMAX:
        spec = dataclasses.replace(spec, tensor_scale_mode=TensorScale.GIVEN)
    try:
        return qcore_to_quark(spec, role=role, dynamic=tc.dynamic, model_dtype=model_dtype)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def _layer_to_quark(lc: Optional[LayerConfig], where: str, model_dtype: str,
                    like: Optional[QuarkLayerSpec] = None) -> QuarkLayerSpec:
    lc = lc or LayerConfig()
    out = QuarkLayerSpec(**{q: _tc_to_quark(getattr(lc, r), r, f"{where}.{r}", model_dtype,
                                            None if like is None else getattr(like, q))
                            for r, q in _ROLES.items()})
    if like is not None and all(getattr(out, q) is getattr(like, q) for q in _ROLES.values()):
        return like
    return out


def config_from_quark(d: Any, *, model_dtype: str = "float32") -> ModelConfig:
    """The ``ModelConfig`` of a Quark ``quantization_config`` (a dict, or a ``QuarkConfig``).

    model_dtype: the model's dtype, which Quark's ``scale_type: "float"`` refers to."""
    try:
        qc = d if isinstance(d, QuarkConfig) else QuarkConfig.from_dict(d)
    except RecursionError:  # unknown keys are kept (Quark adds fields); one nested without end is not a config
        raise ValueError("quantization_config: nested too deeply to be a Quark config") from None
    if qc.softmax_quant_spec is not None:
        raise ValueError("quantization_config.softmax_quant_spec: qcore does not quantize attention softmax outputs")
    if qc.kv_cache_post_rope:
        raise ValueError("quantization_config.kv_cache_post_rope: qcore's KV-cache scales are on the k/v projection "
                         "outputs (before RoPE)")
    ex = qc.export
    if ex is not None and (ex.weight_merge_groups or ex.min_kv_scale != 0.0 or ex.extra):
        raise ValueError(f"quantization_config.export: {ex.to_dict()} has settings qcore does not reproduce "
                         f"(weight_merge_groups / min_kv_scale)")
    layer = _layer_from_quark(qc.global_quant_config, "global_quant_config", model_dtype)
    by_type = {}
    for k, v in (qc.layer_type_quant_config or {}).items():
        name = k.rsplit(".", 1)[-1]
        if name not in MODULE_TYPES:
            raise ValueError(f"layer_type_quant_config: module type {k!r} is not one qcore quantizes "
                             f"({list(MODULE_TYPES)})")
        by_type[name] = _layer_from_quark(v, f"layer_type_quant_config[{k!r}]", model_dtype)
    by_name = {k: _layer_from_quark(v, f"layer_quant_config[{k!r}]", model_dtype)
               for k, v in (qc.layer_quant_config or {}).items()}
    kv = None
    if qc.kv_cache_quant_config:
        outs = set()
        for pat, ls in qc.kv_cache_quant_config.items():
            lc = _layer_from_quark(ls, f"kv_cache_quant_config[{pat!r}]", model_dtype)
            if lc.output is None:
                raise ValueError(f"kv_cache_quant_config[{pat!r}]: no output_tensors spec (the KV-cache scale)")
            rest = dataclasses.replace(lc, output=None)
            if rest != layer:
                raise ValueError(f"kv_cache_quant_config[{pat!r}]: its weight/input specs differ from "
                                 f"global_quant_config; qcore's KV-cache config changes only the output")
            outs.add(lc.output)
        if len(outs) != 1:
            raise ValueError("kv_cache_quant_config: the entries have different output specs; qcore's KV-cache config "
                             "has one")
        out = outs.pop()
        if out.dynamic:
            raise ValueError("kv_cache_quant_config: dynamic KV-cache scales are not supported (vLLM reads static ones)")
        kv = KVCacheConfig(out.spec, observer=out.observer, targets=tuple(qc.kv_cache_quant_config))
        if ex is not None and tuple(ex.kv_cache_group) != kv.targets:
            raise ValueError(f"quantization_config.export.kv_cache_group {list(ex.kv_cache_group)} differs from the "
                             f"kv_cache_quant_config patterns {list(kv.targets)}")
    elif ex is not None and ex.kv_cache_group:
        raise ValueError(f"quantization_config.export.kv_cache_group {list(ex.kv_cache_group)} without a "
                         f"kv_cache_quant_config")
    if kv is not None:  # Quark also lists the KV targets in layer_quant_config: implied by kv_cache here
        implied = dataclasses.replace(layer, output=kv.output)
        by_name = {k: v for k, v in by_name.items() if not (k in kv.targets and v == implied)}
    algos = qc.algo_config
    algorithms = ()
    if algos is not None:
        items = list(algos) if isinstance(algos, (list, tuple)) else [algos]
        for a in items:
            if not isinstance(a, Mapping) or not isinstance(a.get("name"), str):
                raise ValueError(f"quantization_config.algo_config: entry {a!r} has no 'name'")
        algorithms = tuple(dict(a) for a in items)
    exclude = None if qc.exclude is None or tuple(qc.exclude) == ("lm_head",) else tuple(qc.exclude)
    return ModelConfig(layer, by_type=by_type, by_name=by_name, exclude=exclude, kv_cache=kv, algorithms=algorithms,
                       origin=qc.to_dict())


def config_to_quark(config: ModelConfig, *, model_dtype: str = "float32", pack_method: str = "reorder",
                    weight_format: str = "real_quantized") -> dict:
    """Quark's ``quantization_config`` dict for ``config`` (what ``config.json`` holds for a Quark export).

    Fields are derived as Quark 0.13 writes them. A config read with ``config_from_quark`` remembers its source
    (``ModelConfig.origin``): wherever the numerics are unchanged, the source's own spelling is written back, so
    a Quark config read and written back is equal.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    like = QuarkConfig.from_dict(config.origin) if config.origin is not None else None
    if any(v is None for v in config.by_type.values()):
        raise ValueError(f"by_type: None entries ({[k for k, v in config.by_type.items() if v is None]}) have no "
                         f"Quark spelling (Quark's exclude lists names); use by_name or exclude")
    lk = (lambda m, k: None if like is None or not m(like) or k not in m(like) else m(like)[k])  # noqa: E731
    layer = _layer_to_quark(config.layer, "layer", model_dtype, None if like is None else like.global_quant_config)
    by_name = {k: _layer_to_quark(v, f"by_name[{k!r}]", model_dtype, lk(lambda q: q.layer_quant_config, k))
               for k, v in config.by_name.items() if v is not None}
    kv: dict[str, QuarkLayerSpec] = {}
    if config.kv_cache is not None:
        merged = dataclasses.replace(config.layer, output=config.kv_cache.output)
        for pat in config.kv_cache.targets:
            kv[pat] = _layer_to_quark(merged, f"kv_cache[{pat!r}]", model_dtype,
                                      lk(lambda q: q.kv_cache_quant_config, pat))
            if pat not in by_name:  # Quark lists the KV targets in layer_quant_config too
                by_name[pat] = _layer_to_quark(merged, f"kv_cache[{pat!r}]", model_dtype,
                                               lk(lambda q: q.layer_quant_config, pat))
    exclude = ("lm_head",) if config.exclude is None else tuple(config.exclude)
    exclude += tuple(n for n, v in config.by_name.items() if v is None and n not in exclude)
    algos = [_algo_to_quark(a) for a in config.algorithms] or None
    if like is not None and algos is None and not like.algo_config:
        algos = like.algo_config  # [] and null both mean none
    export = QuarkExport(kv_cache_group=tuple(kv), weight_format=weight_format, pack_method=pack_method)
    if like is not None and like.export is not None and dataclasses.replace(
            like.export, weight_format=weight_format, pack_method=pack_method) == like.export and \
            tuple(like.export.kv_cache_group) == tuple(kv):
        export = like.export
    qc = QuarkConfig(
        global_quant_config=layer,
        exclude=exclude,
        algo_config=algos,
        layer_type_quant_config={k: _layer_to_quark(v, f"by_type[{k!r}]", model_dtype,
                                                    lk(lambda q: q.layer_type_quant_config, k))
                                 for k, v in config.by_type.items()},
        layer_quant_config=by_name,
        kv_cache_quant_config=kv,
        version=_QUARK_VERSION if like is None else like.version,
        export=export,
    )
    return qc.to_dict()


def _algo_to_quark(a) -> dict:
    """One algorithm entry in Quark's ``algo_config`` schema (entries qcore cannot read are kept as given)."""
    from qcore.algorithms.config import parse_algorithm
    try:
        return parse_algorithm(a).to_quark()
    except (ValueError, TypeError):
        return dict(a)

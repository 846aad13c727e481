"""Loading quantized checkpoints into qcore's modules through transformers (no amd-quark needed).

- ``from_pretrained(directory)`` loads a checkpoint written by ``export_hf`` or by AMD Quark itself
  (``quant_method`` ``"quark"`` or ``"qcore"``): the model's quantized Linears become frozen qcore modules
  (packed codes + scales, dequantized in the forward), with logits identical to the in-memory frozen model.
  ``load_quark`` is the same function, named for Quark-written checkpoints.
- ``import qcore.adapters`` registers the quantization method ``"qcore"`` with transformers' public plug-in API
  (``register_quantization_config`` / ``register_quantizer``), so ``AutoModelForCausalLM.from_pretrained(d)``
  loads checkpoints whose ``quant_method`` is ``"qcore"`` too. ``"quark"`` stays transformers' own (it needs
  amd-quark): qcore never replaces it; ``from_pretrained`` here routes a Quark checkpoint to qcore explicitly.

Loading checks every tensor against the config before any weight is read: names, dtypes and shapes (from the
safetensors headers; a truncated or corrupted file fails here), then the values (scales finite and positive,
e8m0 NaN codes, zero points in range); errors name the tensor and the layer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
from typing import Any, Optional

import torch
from torch import nn

import qcore
from qcore.formats import quark_layout as L
from qcore.formats.safetensors_io import CorruptCheckpointError, SafetensorsFile, read_json_object

from .config import ModelConfig
from .export import _TORCH_ST, _np
from .modules import QUANT_CLASSES
from .quantizer import _set_module, plan_model

__all__ = ["from_pretrained", "load_quark", "register_with_transformers", "CorruptCheckpointError"]

_ST_TORCH = {st: t for t, st in _TORCH_ST.items()}  # safetensors dtype name -> torch dtype
_OWN_KEYS = ("quant_method", "qcore", "source_method")
_QUARK_KEYS = ("global_quant_config", "layer_quant_config", "layer_type_quant_config", "kv_cache_quant_config",
               "exclude", "algo_config")


def check_format_version(own: Any, where: str) -> None:
    """Refuse a qcore block (``quantization_config["qcore"]``) written by a newer qcore: its ``format_version``
    must be an int no greater than this reader's ``QCORE_FORMAT_VERSION``."""
    from .export import QCORE_FORMAT_VERSION
    if not isinstance(own, dict) or "format_version" not in own:
        return
    v = own["format_version"]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CorruptCheckpointError(f"{where}.qcore.format_version must be a positive int, got {v!r}")
    if v > QCORE_FORMAT_VERSION:
        raise CorruptCheckpointError(f"{where}.qcore.format_version is {v}; this qcore ({qcore.__version__}) reads "
                                     f"format versions up to {QCORE_FORMAT_VERSION}: upgrade qcore to load it")


def checkpoint_config(raw: dict) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint's ``quantization_config``: qcore's own when present, else Quark's."""
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"quantization_config must be a JSON object, got {type(raw).__name__}")
    own = raw.get("qcore")
    if own is not None and not isinstance(own, dict):
        raise CorruptCheckpointError(f"quantization_config.qcore must be a JSON object, got {own!r}"[:300])
    check_format_version(own, "quantization_config")
    if isinstance(own, dict) and "config" in own:
        mine = ModelConfig.from_dict(own["config"])
        quark = raw.get("source_method", raw.get("quant_method")) == "quark"
        if quark or any(k in raw for k in _QUARK_KEYS):  # what Quark and vLLM read (or a reader of Quark's fields
            theirs = ModelConfig.from_quark({**{k: v for k, v in raw.items() if k not in _OWN_KEYS},  # and the same
                                             "quant_method": "quark"})
            # Quark's scale_type follows the model dtype the export wrote them in: equal for one of them
            wheres = []
            for dt in ("float32", "bfloat16", "float16"):
                try:
                    wheres.append(_first_difference(theirs.to_quark(model_dtype=dt), mine.to_quark(model_dtype=dt)))
                except ValueError:  # a config this dtype cannot spell (E8M0 scales in float16)
                    continue
            if not wheres:  # no model dtype spells the qcore block's config in Quark's terms (where a "qcore"
                if not quark:  # checkpoint then writes no Quark fields)
                    raise CorruptCheckpointError("quantization_config: Quark fields beside a qcore block whose "
                                                 "config has no Quark spelling")
                raise CorruptCheckpointError("quantization_config: quant_method 'quark', but the qcore block's "
                                             "config has no Quark spelling: Quark and vLLM would load another model "
                                             "than qcore")
            where = None if None in wheres else wheres[0]
            if where is not None:
                raise CorruptCheckpointError(f"quantization_config.{where} disagrees with the qcore block's config: "
                                             f"Quark and vLLM would load another model than qcore")
        return mine
    if raw.get("source_method", raw.get("quant_method")) not in ("quark", "qcore"):
        raise ValueError(f"quantization_config: quant_method {raw.get('quant_method')!r} is not 'quark' or 'qcore'")
    d = {k: v for k, v in raw.items() if k not in _OWN_KEYS}
    d["quant_method"] = "quark"
    return ModelConfig.from_quark(d)


def _first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """The dotted path of the first place two JSON-like values differ, or None when they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            where = _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
            if where is not None:
                return where
        return None
    return None if a == b else (path or "(root)")


def read_config(d: pathlib.Path) -> tuple:
    """``(config.json as a dict, its quantization_config)`` of the checkpoint directory ``d``, read safely (a
    malformed or too deeply nested file is a ``CorruptCheckpointError`` naming it)."""
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{str(d)!r} is not a checkpoint directory (no config.json)")
    cfg = read_json_object(d / "config.json", what="the model config")
    return cfg, cfg.get("quantization_config")


def hf_config(d: pathlib.Path):
    """transformers' ``AutoConfig`` of the checkpoint directory ``d``; a config.json transformers cannot read is a
    ``CorruptCheckpointError`` naming the file, not transformers' traceback."""
    from transformers import AutoConfig
    bad: tuple = (ValueError, TypeError, KeyError, AttributeError, OSError, IndexError)
    try:  # transformers 5 validates config fields with huggingface_hub's strict dataclasses
        from huggingface_hub.errors import StrictDataclassError
        bad += (StrictDataclassError,)
    except ImportError:
        pass
    try:
        return AutoConfig.from_pretrained(d, local_files_only=True)
    except bad as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: transformers cannot build the model config from "
                                     f"it ({msg})") from None


class _Shell(nn.Module):
    """Placeholder for one quantized module while transformers loads the checkpoint: parameters named, shaped and
    typed as the checkpoint stores them (on meta until loaded)."""

    def __init__(self, name: str, m: nn.Module, config):
        super().__init__()
        q = QUANT_CLASSES[type(m)].from_module(m, config, name=name)  # on meta: planned here, filled in _build
        object.__setattr__(self, "_wrapper", q)  # not a submodule: its float weight is not in the checkpoint
        spec = q.specs["weight"]
        self.shape = q.weight_shape
        self.layout = L.weight_layout(spec, self.shape, module="Linear" if isinstance(m, nn.Linear) else "other")
        self.expected = dict(L.expected_weight(spec, self.shape, layout=self.layout))
        for role in q.static_roles():
            self.expected.update(L.expected_activation(role, q.specs[role], q.static_scale_shape(role),
                                                       layout=self.layout))
        self.qname = name
        for n, (dt, shape) in self.expected.items():
            self.register_parameter(n, nn.Parameter(torch.empty(shape, dtype=_ST_TORCH[dt], device="meta"),
                                                    requires_grad=False))
        if getattr(m, "bias", None) is not None:
            self.bias = m.bias


_FLOAT_ST = ("F32", "F16", "BF16")


def unexpected_keys(model: nn.Module, names) -> list:
    """The ``names`` (checkpoint tensors) that are not tensors of ``model``, sorted, leaving out those transformers
    itself ignores on load: the model's ``_keys_to_ignore_on_load_unexpected`` and its non-persistent buffers
    (older files store the rotary ``inv_freq``)."""
    import re
    state = model.state_dict(keep_vars=True)
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    transient = {f"{n}.{b}" if n else b for n, m in model.named_modules() for b in m._non_persistent_buffers_set}
    return sorted(k for k in names if k not in state and k not in transient and not any(p.search(k) for p in ignore))


def check_tensors(files: list, model: nn.Module, shells: dict[str, _Shell]) -> None:
    """The whole checkpoint against the model its config builds, from the safetensors headers (before any weight
    is read): every quantized module's tensors (names, dtypes, shapes of its layout), every other parameter and
    persistent buffer of the model present with its shape (float ones stored in one float dtype, the one the
    checkpoint's other float tensors use), and no tensor the config does not explain. A tensor the model needs
    and the file lacks would otherwise be left to random initialisation. Raises ``CorruptCheckpointError``
    naming the tensor (and its file)."""
    entries: dict = {}
    for f in files:
        st = SafetensorsFile(f)
        for k, e in st.entries.items():
            if k in entries:
                raise CorruptCheckpointError(f"tensor {k!r} is stored twice ({pathlib.Path(entries[k][1]).name} and "
                                             f"{pathlib.Path(f).name})")
            entries[k] = (e, f)
    if not entries:
        raise CorruptCheckpointError("the checkpoint has no safetensors files (qcore never loads pickled weights)")
    for name, sh in shells.items():
        for suffix, (dt, shape) in sh.expected.items():
            key = getattr(sh, "disk", {}).get(suffix, f"{name}.{suffix}")  # fused experts: the family's names
            if key not in entries:
                raise CorruptCheckpointError(f"layer {name!r}: tensor {key!r} is missing from the checkpoint "
                                             f"(layout {sh.layout!r} stores {sorted(sh.expected)})")
            e, f = entries[key]
            if e.dtype != dt or tuple(e.shape) != tuple(shape):
                raise CorruptCheckpointError(f"layer {name!r}: tensor {key!r} is {e.dtype} {list(e.shape)} in "
                                             f"{pathlib.Path(f).name}; the config ({sh.layout!r} layout) needs {dt} "
                                             f"{list(shape)}")
    quantized = {f"{n}.{s}" for n, sh in shells.items() for s in sh.expected}
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list] = {}  # tied tensors (one object under several names) are stored once
    for k, t in state.items():
        if k not in quantized:
            groups.setdefault(id(t), []).append((k, t))
    floats = [entries[k][0].dtype for keys in groups.values() for k, t in keys
              if k in entries and t.is_floating_point()]
    want_float = max(set(floats), key=floats.count) if floats else None  # the checkpoint's float dtype
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # transformers' tied name -> its source
    from .experts import check_split_experts, float_experts_split
    split = {k: v for k, v in float_experts_split(model).items() if k not in entries}  # float fused experts stored
    for keys in groups.values():  # per expert (as save_pretrained writes them; transformers merges them on load)
        present = [(k, t) for k, t in keys if k in entries]
        if not present and all(tied.get(k) in entries for k, _ in keys):
            continue  # tied to a stored tensor (e.g. lm_head.weight to the token embedding): written once
        if not present and keys[0][0] in split:
            check_split_experts(keys[0][0], keys[0][1], split[keys[0][0]], entries, want_float)
            continue
        if not present:
            raise CorruptCheckpointError(f"tensor {keys[0][0]!r} of the model is missing from the checkpoint "
                                         f"(it would be left to random initialisation)")
        for k, t in present:
            e, f = entries[k]
            if t.is_floating_point():
                ok = e.dtype in _FLOAT_ST and e.dtype == want_float
                want = f"{want_float} (the checkpoint's float dtype)"
            else:
                want = _TORCH_ST.get(t.dtype, str(t.dtype))
                ok = e.dtype == want
            if not ok or tuple(e.shape) != tuple(t.shape):
                raise CorruptCheckpointError(f"tensor {k!r} is {e.dtype} {list(e.shape)} in {pathlib.Path(f).name}; "
                                             f"the model needs {want} {list(t.shape)}")
    on_disk = {k for sh in shells.values() for k in getattr(sh, "disk", {}).values()}
    on_disk |= {d for parts in split.values() for d, _ in parts}
    extra = [k for k in unexpected_keys(model, entries) if k not in on_disk]
    if extra:
        raise CorruptCheckpointError(f"tensor {extra[0]!r} in {pathlib.Path(entries[extra[0]][1]).name} is not a "
                                     f"tensor of the model its config describes"
                                     f"{f' (and {len(extra) - 1} more: {extra[1:4]})' if len(extra) > 1 else ''}")


def _build(sh: _Shell, pack_method: str, dtype: torch.dtype) -> nn.Module:
    """The frozen qcore module of a loaded shell (validated values)."""
    if hasattr(sh, "build"):  # fused MoE experts (qcore.adapters.experts.ExpertsShell)
        return sh.build(pack_method, dtype)
    where = f"layer {sh.qname!r}"
    params = dict(sh.named_parameters(recurse=False))
    missing = [n for n in sh.expected if params[n].is_meta]
    if missing:
        raise CorruptCheckpointError(f"{where}: tensors {missing} were not loaded from the checkpoint")
    arrays = {n: _np(params[n]) for n in sh.expected}
    q, shape = sh._wrapper, sh.shape
    spec = q.specs["weight"]
    parts = L.decode_weight(arrays, spec, shape, layout=sh.layout, pack_method=pack_method, where=where)
    device = params["weight"].device
    q.load_frozen(parts, shape=shape, dtype=dtype, device=device)
    with torch.no_grad():
        if "bias" in q._parameters and q._parameters["bias"] is not None:
            q.load_bias(sh.bias)  # exported as the fake-quantized floats it computes with
        for role in q.static_roles():
            a = L.decode_activation(arrays, role, q.specs[role], where=where)
            if a["tensor_scale"] is not None:
                q.load_static_scales(role, tensor_scale=a["tensor_scale"], device=device)
            else:
                q.load_static_scales(role, scale=a["scale"], zero_point=a["zero_point"], device=device)
    left = [n for n, t in list(q.named_parameters()) + list(q.named_buffers()) if t is not None and t.is_meta]
    if left:
        raise RuntimeError(f"{where}: {left} stayed unloaded (a qcore bug; please report it)")
    return q


def _make_classes():
    from transformers.quantizers import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class QcoreHfConfig(QuantizationConfigMixin):
        """transformers' view of a qcore / Quark ``quantization_config`` (the dict is kept as it is)."""

        def __init__(self, **kwargs):
            self.raw = dict(kwargs)
            self.quant_method = "qcore"

        def to_dict(self) -> dict:
            d = dict(self.raw)
            d["quant_method"] = d.pop("source_method", d.get("quant_method", "qcore"))
            return d

        def to_diff_dict(self) -> dict:
            return self.to_dict()

    class QcoreHfQuantizer(HfQuantizer):
        """Swaps the planned modules for checkpoint-shaped placeholders before loading, and for frozen qcore
        modules after."""

        requires_calibration = True

        def __init__(self, quantization_config, **kwargs):
            super().__init__(quantization_config, **kwargs)
            self._shells: dict[str, _Shell] = {}

        def validate_environment(self, *args, **kwargs):
            return None

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            raw = self.quantization_config.raw
            config = checkpoint_config(raw)
            export = raw.get("export") or {}
            if not isinstance(export, dict):
                raise CorruptCheckpointError(f"quantization_config.export must be a JSON object, got {export!r}"[:300])
            self.pack_method = export.get("pack_method", "reorder")
            if not isinstance(self.pack_method, str) or self.pack_method not in L.PACK_METHODS:
                raise CorruptCheckpointError(f"quantization_config.export.pack_method {self.pack_method!r} is not "
                                             f"one of {sorted(L.PACK_METHODS)}")
            stated = (raw.get("qcore") or {}).get("layouts") if isinstance(raw.get("qcore"), dict) else None
            if stated is not None and not (isinstance(stated, dict) and all(isinstance(v, str)
                                                                              for v in stated.values())):
                raise CorruptCheckpointError(f"quantization_config.qcore.layouts must map layer names to layout "
                                             f"names, got {stated!r}"[:300])
            from .experts import stored_float_experts
            self._float_experts = stored_float_experts(model, config, checkpoint_files)  # Quark 0.13's MoE exports
            for p in plan_model(model, config, _check_float=False):  # a saved config, as it was saved
                if p.name in self._float_experts:
                    continue
                if p.type == "Experts":
                    from .experts import ExpertsShell
                    sh = ExpertsShell(model, p.name, model.get_submodule(p.name), p.config)
                else:
                    sh = _Shell(p.name, model.get_submodule(p.name), p.config)
                layout = sh.layout
                if stated is not None and stated.get(p.name, layout) != layout:
                    raise CorruptCheckpointError(f"layer {p.name!r}: the checkpoint says layout "
                                                 f"{stated[p.name]!r}, its config gives {layout!r}")
                if layout == "qcore" and raw.get("source_method", raw.get("quant_method")) == "quark":
                    raise CorruptCheckpointError(f"layer {p.name!r}: quant_method 'quark' but the config's format "
                                                 f"has no Quark tensor layout (a qcore extension checkpoint says "
                                                 f"quant_method 'qcore')")
                _set_module(model, p.name, sh)
                self._shells[p.name] = sh
            if not checkpoint_files:
                raise CorruptCheckpointError("transformers found no checkpoint files to load")
            check_tensors(list(checkpoint_files), model, self._shells)
            return model

        def update_weight_conversions(self, weight_conversions, model):
            from .experts import drop_expert_converters  # quantized fused experts load per expert, as stored
            return super().update_weight_conversions(drop_expert_converters(weight_conversions, self._shells), model)

        def _process_model_after_weight_loading(self, model, **kwargs):
            shell = {id(p) for sh in self._shells.values() for p in sh.parameters()}
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point() and not p.is_meta
                          and id(p) not in shell  # checkpoint tensors (e.g. float16 scales), not the model's
                          and p.dtype in (torch.float32, torch.bfloat16, torch.float16)), torch.float32)
            for name, sh in self._shells.items():
                _set_module(model, name, _build(sh, self.pack_method, dtype))
            self._shells = {}
            model.qcore_config = checkpoint_config(self.quantization_config.raw)
            if getattr(self, "_float_experts", None):  # fused experts the checkpoint stores float: excluded, by name
                from .experts import exclude_float_experts
                model.qcore_config = exclude_float_experts(model, model.qcore_config, self._float_experts)
            from qcore.algorithms.config import parse_algorithms, split_rotation
            rot, _ = split_rotation(parse_algorithms(model.qcore_config.algorithms))
            if rot is not None and rot.online:  # the online transforms of the rotated weights (QuaRot / SpinQuant)
                own = any(isinstance(a, dict) and a.get("name") in ("qcore_rotation", "quarot", "spinquant")
                          for a in model.qcore_config.algorithms)
                if not own:
                    raise CorruptCheckpointError(
                        f"quantization_config.algo_config: Quark's rotation with online transforms "
                        f"({list(rot.online)}) uses Quark's own Hadamard tables, which qcore does not reproduce; "
                        f"load this checkpoint with amd-quark")
                from .rotation import install_online
                install_online(model, rot)
            return model

        def is_serializable(self):
            return False

        @property
        def is_trainable(self):
            return False

    return QcoreHfConfig, QcoreHfQuantizer


_registered: dict = {}

#: loggers of optional libraries that print on import: torchao's "Failed to load ... _C_mxfp8 ... .so" (its CUDA
#: extensions, missing on CPU-only machines) and torch's pytree "register_constant() on Enum subclasses is
#: deprecated" (torchao registering its enums); neither concerns qcore, and they would print on every command
_NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_optional_imports():
    """Within the block, the loggers in ``_NOISY_IMPORT_LOGGERS`` show errors only (their levels are put back
    after it; nothing global changes, and later messages of those libraries show as usual)."""
    loggers = [logging.getLogger(n) for n in _NOISY_IMPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def register_with_transformers() -> bool:
    """Register quant_method ``"qcore"`` with transformers (idempotent); False when transformers is absent."""
    if "config" in _registered:
        return True
    try:
        with quiet_optional_imports():  # transformers.quantizers imports torchao when it is installed
            from transformers.quantizers import auto
    except ImportError:
        return False
    cfg_cls, q_cls = _make_classes()
    if "qcore" in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:  # registered by an earlier import (e.g. a reload)
        cfg_cls = auto.AUTO_QUANTIZATION_CONFIG_MAPPING["qcore"]
    else:
        auto.register_quantization_config("qcore")(cfg_cls)
    if "qcore" not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer("qcore")(q_cls)
    _registered["config"] = cfg_cls
    return True


def __getattr__(name):
    if name == "QcoreHfConfig":
        register_with_transformers()
        return _registered["config"]
    raise AttributeError(name)


def from_pretrained(directory, *, dtype: Optional[torch.dtype] = None, device_map: Any = None, **kwargs):
    """Load a quantized checkpoint (``quant_method`` ``"quark"`` or ``"qcore"``; ``"compressed-tensors"`` goes to
    ``qcore.adapters.import_ct.load_compressed_tensors``) from a local directory into qcore's frozen modules.
    ``dtype`` is the float dtype of the rest of the model (default: the checkpoint's). Extra keyword arguments go
    to the model class's ``from_pretrained`` (``model_class``)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"from_pretrained: directory must be a str or os.PathLike, got {type(directory).__name__}")
    _check_device_map(device_map)
    register_with_transformers()
    d = pathlib.Path(directory)
    _, raw = read_config(d)
    if isinstance(raw, dict) and raw.get("quant_method") == "compressed-tensors":
        if device_map is not None or kwargs:
            extra = sorted(kwargs) + (["device_map"] if device_map is not None else [])
            raise TypeError(f"from_pretrained: a compressed-tensors checkpoint loads through "
                            f"qcore.adapters.import_ct.load_compressed_tensors, which takes dtype only; got {extra}")
        from .import_ct import load_compressed_tensors
        return load_compressed_tensors(d, dtype=dtype)
    if not isinstance(raw, dict) or raw.get("quant_method") not in ("quark", "qcore"):
        got = None if not isinstance(raw, dict) else raw.get("quant_method")
        raise ValueError(f"{str(d)!r}: quantization_config.quant_method is {got!r}; qcore loads 'quark' and 'qcore' "
                         f"checkpoints (a float model loads with AutoModelForCausalLM.from_pretrained)")
    try:
        checkpoint_config(raw)  # the quantization config, checked before any file is read
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: {e}") from None
    from qcore.formats.inspect import checkpoint_files
    for f in checkpoint_files(d):  # headers first: a truncated or corrupted file fails here, naming the tensor
        SafetensorsFile(f)
    config = hf_config(d)
    config.quantization_config = dict(raw, quant_method="qcore", source_method=raw["quant_method"])
    kw = dict(config=config, local_files_only=True, use_safetensors=True)
    if dtype is not None:
        kw["dtype"] = dtype
    if device_map is not None:
        kw["device_map"] = device_map
    kw.update(kwargs)
    try:
        return model_class(config).from_pretrained(d, **kw).eval()
    except CorruptCheckpointError as e:  # raised by check_tensors / _build: name the checkpoint too
        raise CorruptCheckpointError.naming(d, e) from None


def model_class(config: Any):
    """The transformers class a checkpoint's ``config`` was saved from: the first of ``config.architectures`` that
    transformers has (a ``BertModel`` checkpoint loads as a ``BertModel``, not as the causal LM
    ``AutoModelForCausalLM`` would build), else ``AutoModelForCausalLM``."""
    import transformers
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
            return cls
    return transformers.AutoModelForCausalLM


def _check_device_map(device_map: Any) -> None:
    """A ``device_map`` naming devices (a device, an index, or a dict of them) names ones this machine has
    (``ValueError`` before any file is read); accelerate's strategies ("auto", ...) are left to it."""
    from ._device import check_device
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    for v in values:
        if isinstance(v, bool) or v is None or v in ("auto", "balanced", "balanced_low_0", "sequential", "disk"):
            continue
        if isinstance(v, int):
            v = f"cuda:{v}"
        if isinstance(v, (str, torch.device)):
            check_device(v, what="device_map")


load_quark = from_pretrained

"""Load a compressed-tensors checkpoint (qcore's ``export_compressed_tensors``, or one written by
compressed-tensors / llm-compressor) into qcore's frozen quantized modules, without the compressed_tensors
package: ``load_compressed_tensors(directory)``. ``model.qcore_config`` is the ``ModelConfig`` that describes the
loaded model (the one qcore stored in the checkpoint, else ``config_from_ct`` derives it from the
compressed-tensors config), so ``export_hf`` / ``export_gguf`` / ``export_compressed_tensors`` write it again.

The model is built with its parameters on the meta device (no random initialisation, one copy of the weights);
every tensor's name, dtype and shape is checked against the config before any weight is read, then the values;
errors name the tensor. The schema and codecs are ``qcore.formats.compressed_tensors``; what maps to what is in
``docs/compressed_tensors.md``.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn

import qcore
from qcore.formats import compressed_tensors as CT
from qcore.formats.quark_layout import WeightParts
from qcore.formats.safetensors_io import CorruptCheckpointError, SafetensorsFile

from .config import KVCacheConfig, LayerConfig, ModelConfig, TensorConfig
from .export import _TORCH_ST
from .export_ct import _MODEL_DTYPES, _kv_role
from .modules import QUANT_CLASSES

__all__ = ["load_compressed_tensors", "config_from_ct"]


def _ct_is_match(name: str, module: nn.Module, target: str) -> bool:
    """compressed-tensors' ``is_match`` for one target: ``re:`` (``re.match``), an exact name, or a class name of
    the module's MRO."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target == name:
        return True
    return any(c.__name__ == target for c in type(module).__mro__ if issubclass(c, nn.Module))


def _layer_config(s: CT.CTScheme, where: str) -> LayerConfig:
    roles: dict[str, Any] = {}
    if s.weights is None:
        raise ValueError(f"{where}: a scheme without weights is not supported")
    ws, _ = CT.args_to_spec(s.weights, role="weight", where=f"{where}.weights")
    roles["weight"] = TensorConfig(ws)
    for role, a in (("input", s.input_activations), ("output", s.output_activations)):
        if a is not None:
            spec, dyn = CT.args_to_spec(a, role=role, where=f"{where}.{role}_activations")
            roles[role] = TensorConfig(spec, dynamic=dyn)
    return LayerConfig(**roles)


def _module_groups(model: nn.Module, ctc: CT.CTConfig) -> dict[str, str]:
    """Module name -> config group (the first group whose targets match it and that ``ignore`` does not)."""
    out = {}
    for name, m in model.named_modules():
        if type(m) is not nn.Linear:
            continue
        if any(_ct_is_match(name, m, t) for t in ctc.ignore):
            continue
        for g, s in ctc.config_groups.items():
            if any(_ct_is_match(name, m, t) for t in s.targets):
                out[name] = g
                break
    return out


def config_from_ct(model: nn.Module, ctc: CT.CTConfig) -> ModelConfig:
    """The ``ModelConfig`` that gives ``model`` the quantization a compressed-tensors config describes: the
    layer config of a single ``"Linear"`` group with the float Linears excluded by name, else one ``by_name``
    entry per quantized module. A KV-cache scheme becomes ``KVCacheConfig`` on ``*k_proj`` / ``*v_proj``."""
    which = _module_groups(model, ctc)
    if not which:
        raise ValueError("quantization_config: the config groups match no Linear of the model")
    lcs = {g: _layer_config(s, f"quantization_config.config_groups.{g}") for g, s in ctc.config_groups.items()
           if g in which.values()}
    floats = tuple(n for n, m in model.named_modules() if type(m) is nn.Linear and n not in which)
    kv = None
    if ctc.kv_cache_scheme is not None:
        spec, dyn = CT.args_to_spec(ctc.kv_cache_scheme, role="kv_cache", where="quantization_config.kv_cache_scheme")
        if dyn or spec.dtype.name != "float8_e4m3fn" or not isinstance(spec.granularity, qcore.PerTensor):
            raise ValueError("quantization_config.kv_cache_scheme: qcore loads static per-tensor fp8 KV caches")
        kv = KVCacheConfig(spec)
    if len(lcs) == 1:
        return ModelConfig(next(iter(lcs.values())), exclude=floats, kv_cache=kv)
    return ModelConfig(LayerConfig(), by_name={n: lcs[g] for n, g in which.items()}, exclude=floats, kv_cache=kv)


_ST_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I8": np.int8, "U8": np.uint8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
          "BOOL": np.bool_, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "F8_E8M0": np.uint8}
_ST_TORCH = {st: t for t, st in _TORCH_ST.items()}
_FLOAT_ST = ("F32", "BF16", "F16")


class _Reader:
    def __init__(self, d: pathlib.Path):
        from qcore.formats.inspect import checkpoint_files
        self.entries: dict = {}
        for f in checkpoint_files(d):
            sf = SafetensorsFile(f)
            for k, e in sf.entries.items():
                self.entries[k] = (sf, e)
        if not self.entries:
            raise CorruptCheckpointError(f"{str(d)!r}: no tensors (qcore never loads pickled weights)")
        self.used: set = set()

    def check(self, name: str, dtypes: tuple, shape: Optional[tuple], where: str) -> str:
        if name not in self.entries:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} is missing from the checkpoint")
        sf, e = self.entries[name]
        if e.dtype not in dtypes or (shape is not None and tuple(e.shape) != tuple(shape)):
            raise CorruptCheckpointError(f"{where}: tensor {name!r} is {e.dtype} {list(e.shape)} in "
                                         f"{sf.path.name}; expected {'/'.join(dtypes)} "
                                         f"{'any shape' if shape is None else list(shape)}")
        return e.dtype

    def array(self, name: str) -> np.ndarray:
        sf, e = self.entries[name]
        self.used.add(name)
        return np.frombuffer(sf.raw(name), dtype=_ST_NP[e.dtype]).reshape(e.shape)

    def torch(self, name: str) -> torch.Tensor:
        sf, e = self.entries[name]
        a = np.array(self.array(name))
        t = torch.from_numpy(a)
        if e.dtype in ("BF16", "F8_E4M3", "F8_E5M2"):
            t = t.view(_ST_TORCH[e.dtype])
        return t


def load_compressed_tensors(directory: Union[str, os.PathLike], *, dtype: Optional[torch.dtype] = None,
                            device: Any = None) -> nn.Module:
    """Load a compressed-tensors checkpoint (qcore's export, or one written by compressed-tensors /
    llm-compressor) into qcore's frozen modules, without the compressed_tensors package. ``model.qcore_config``
    is the ``ModelConfig`` (the stored qcore one when qcore wrote the checkpoint, else ``config_from_ct``), so
    ``export_hf`` / ``export_compressed_tensors`` / ``export_gguf`` can write the model again.

    dtype: the float dtype of the model (default: the checkpoint config's ``torch_dtype``). device: where the
    model goes after loading (default CPU). Every tensor's name, dtype and shape is checked against the config
    before any weight is read; values too (scales finite and positive, codes and zero points in range); errors
    name the tensor."""
    d = pathlib.Path(directory)
    try:
        return _load(d, dtype, device)
    except CorruptCheckpointError as e:  # every refusal names the checkpoint
        raise CorruptCheckpointError.naming(d, e) from None


def _load(d: pathlib.Path, dtype: Optional[torch.dtype], device: Any) -> nn.Module:
    from .hf import check_format_version, hf_config, model_class, read_config
    _, raw = read_config(d)
    if not isinstance(raw, dict) or raw.get("quant_method") != CT.QUANT_METHOD:
        got = raw.get("quant_method") if isinstance(raw, dict) else None
        raise ValueError(f"{str(d)!r}: quantization_config.quant_method is {got!r}; expected "
                         f"{CT.QUANT_METHOD!r} (qcore.adapters.from_pretrained loads 'quark' and 'qcore')")
    try:
        check_format_version(raw.get("qcore"), "quantization_config")
        ctc = CT.CTConfig.from_dict(raw)
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: {e}") from None
    reader = _Reader(d)
    hf = hf_config(d)
    if hasattr(hf, "quantization_config"):
        del hf.quantization_config
    if dtype is None:
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    if dtype not in _MODEL_DTYPES:
        raise ValueError(f"load_compressed_tensors: dtype {dtype} is not float32, bfloat16 or float16")
    from accelerate import init_empty_weights
    with init_empty_weights(include_buffers=False):  # parameters on meta (each is assigned from the checkpoint)
        cls = model_class(hf)
        model = (cls.from_config(hf, dtype=dtype) if hasattr(cls, "from_config") else cls._from_config(hf, dtype=dtype))
        model = model.eval()
    if raw.get("qcore") is not None and not isinstance(raw.get("qcore"), dict):
        raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: quantization_config.qcore must be a JSON object, "
                                     f"got {raw.get('qcore')!r}"[:300])
    own = ctc.qcore if isinstance(ctc.qcore, dict) and "config" in ctc.qcore else None
    config = ModelConfig.from_dict(own["config"]) if own is not None else config_from_ct(model, ctc)
    from .quantizer import _set_module, plan_model
    plans = plan_model(model, config, _check_float=False)  # a saved config, as it was saved
    which = _module_groups(model, ctc)
    float_here = sorted(set(which) - {p.name for p in plans if p.config.weight is not None})
    if float_here:  # compressed-tensors' loaders would quantize what qcore's config leaves float
        raise CorruptCheckpointError(f"layer {float_here[0]!r}: matched by the compressed-tensors group "
                                     f"{which[float_here[0]]!r} but its weight is float in the qcore config"
                                     + (f" (and {len(float_here) - 1} more)" if len(float_here) > 1 else ""))
    # 1. every quantized tensor's name, dtype and shape, before anything is read
    todo = []
    for p in plans:
        where = f"layer {p.name!r}"
        m = model.get_submodule(p.name)
        if type(m) is not nn.Linear:
            raise CorruptCheckpointError(f"{where}: a {type(m).__name__}; compressed-tensors stores Linear layers")
        if p.config.weight is None:  # KV cache only: a float projection whose attention holds the k / v scale
            q = QUANT_CLASSES[nn.Linear].from_module(m, p.config, name=p.name)
            kv = _kv_role(p.name, q, config)
            if not kv or p.config.input is not None or p.config.bias is not None:
                raise CorruptCheckpointError(f"{where}: the config quantizes no weight here, and compressed-tensors "
                                             f"has nothing but KV-cache scales for such a layer")
            dts = {"weight": reader.check(f"{p.name}.weight", _FLOAT_ST, (m.out_features, m.in_features), where)}
            if m.bias is not None:
                reader.check(f"{p.name}.bias", _FLOAT_ST, (m.out_features,), where)
            key = f"{p.name.rsplit('.', 1)[0]}.{kv}_scale"
            reader.check(key, _FLOAT_ST, None, where)
            todo.append((p, q, None, None, None, dts, {"output": (key, None)}))
            continue
        if p.name not in which:
            raise CorruptCheckpointError(f"{where}: quantized by the qcore config but matched by no config group "
                                         f"of the compressed-tensors config")
        g = which[p.name]
        fmt = ctc.scheme_format(g)
        q = QUANT_CLASSES[nn.Linear].from_module(m, p.config, name=p.name)
        spec = q.specs["weight"]
        want = CT.spec_to_args(spec, role="weight", where=f"{where} weight")
        have = ctc.config_groups[g].weights
        if have is None or CT.args_to_spec(have, role="weight")[0].dtype.bits != spec.dtype.bits or \
                (want.type, want.strategy, want.group_size, want.block_structure, want.symmetric) != \
                (have.type, have.strategy, have.group_size, have.block_structure, have.symmetric):
            theirs = None if have is None else have.to_dict()
            raise CorruptCheckpointError(f"{where}: the qcore config's weight spec ({want.to_dict()}) is not the "
                                         f"compressed-tensors group {g!r}'s ({theirs})")
        shape = (m.out_features, m.in_features)
        exp = CT.expected_weight(spec, shape, fmt=fmt, scale_dtype="F32", where=where)
        dts = {}
        for suffix, (dt, shp) in exp.items():
            ok = _FLOAT_ST if dt == "F32" else (dt,)
            dts[suffix] = reader.check(f"{p.name}.{suffix}", ok, shp, where)
        if f"{p.name}.weight_g_idx" in reader.entries:
            reader.check(f"{p.name}.weight_g_idx", ("I32", "I64"), (shape[1],), where)
            dts["weight_g_idx"] = "I32"
        acts = {}
        kv = _kv_role(p.name, q, config) if q.qconfig.output is not None else None
        for role in q.static_roles():
            if role == "output" and kv:
                key = f"{p.name.rsplit('.', 1)[0]}.{kv}_scale"
            else:
                key = f"{p.name}.{role}_scale"
            reader.check(key, _FLOAT_ST, None, where)
            if int(np.prod(reader.entries[key][1].shape)) != 1:
                raise CorruptCheckpointError(f"{where}: tensor {key!r} has shape {list(reader.entries[key][1].shape)}; "
                                             f"qcore loads per-tensor static scales")
            zkey = f"{p.name}.{role}_zero_point"
            if not q.specs[role].symmetric:
                reader.check(zkey, ("I8", "I32", "U8"), None, where)
            acts[role] = (key, zkey if not q.specs[role].symmetric else None)
        if m.bias is not None:
            reader.check(f"{p.name}.bias", _FLOAT_ST, (m.out_features,), where)
        todo.append((p, q, spec, shape, fmt, dts, acts))
    owned = {f"{p.name}.{k}" for p, *_ in todo for k in ("weight", "bias")}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = set()
    for k, t in model.state_dict(keep_vars=True).items():
        if k in owned:
            continue
        if k not in reader.entries:
            if getattr(hf, "tie_word_embeddings", False) and head is not None and t is head.weight:
                tied.add(k)  # the output head shares the input embedding (written once)
                continue
            raise CorruptCheckpointError(f"tensor {k!r} of the model is missing from the checkpoint")
        reader.check(k, _FLOAT_ST if t.is_floating_point() else (_TORCH_ST[t.dtype],), tuple(t.shape),
                     f"tensor {k!r}")
    # the model's float tensors (norms, embeddings, biases, float Linears) all in the checkpoint's one float dtype
    qweights = {f"{p.name}.weight" for p, q, spec, *_ in todo if spec is not None}
    floats = {k: reader.entries[k][1].dtype for k, t in model.state_dict(keep_vars=True).items()
              if t.is_floating_point() and k in reader.entries and k not in qweights}
    if floats:
        kinds = list(floats.values())
        want = max(set(kinds), key=kinds.count)
        odd = sorted(k for k, v in floats.items() if v != want)
        if odd:
            raise CorruptCheckpointError(f"tensor {odd[0]!r} is {floats[odd[0]]} in "
                                         f"{reader.entries[odd[0]][0].path.name}; the checkpoint's other float "
                                         f"tensors are {want}")
    # 2. values, module by module (parameters were created on the meta device: every one is assigned here)
    with torch.no_grad():
        for p, q, spec, shape, fmt, dts, acts in todo:
            where = f"layer {p.name!r}"
            if spec is None:
                q._parameters["weight"] = nn.Parameter(reader.torch(f"{p.name}.weight").to(dtype),
                                                       requires_grad=False)
            else:
                arrays = {s: reader.array(f"{p.name}.{s}") for s in dts}
                try:
                    codes, scales, zp = CT.decode_weight(arrays, spec, shape, fmt=fmt, dtypes=dts, where=where)
                except ValueError as e:
                    raise CorruptCheckpointError(str(e)) from None
                q.load_frozen(WeightParts(codes=np.array(codes), scales=scales, zero_points=zp), shape=shape,
                              dtype=dtype, device=torch.device("cpu"))
            if q._parameters.get("bias") is not None:
                q._parameters["bias"] = nn.Parameter(reader.torch(f"{p.name}.bias").to(dtype), requires_grad=False)
            for role, (key, zkey) in acts.items():
                s = CT.scale_from_dtype(reader.array(key), reader.entries[key][1].dtype).reshape(())
                if not np.isfinite(s) or not s > 0:
                    raise CorruptCheckpointError(f"{where}: tensor {key!r} holds {float(s)!r}; scales must be "
                                                 f"finite and positive")
                z = None
                if zkey is not None:
                    rs = q.specs[role]
                    k = 0 if rs.dtype.signed else 1 << (rs.dtype.bits - 1)
                    z = float(reader.array(zkey).reshape(-1)[0]) + k
                    if not rs.qmin <= z <= rs.qmax:
                        raise CorruptCheckpointError(f"{where}: tensor {zkey!r} is out of range for {rs.dtype.name}")
                    z = torch.full(q.static_scale_shape(role), z)
                q.load_static_scales(role, scale=np.array(s, np.float32), zero_point=z)
            _set_module(model, p.name, q)
        quantized = {p.name for p, *_ in todo}
        for name, mod in model.named_modules():
            if name in quantized:
                continue
            for leaf, t in list(mod._parameters.items()):
                k = f"{name}.{leaf}" if name else leaf
                if t is not None and k in reader.entries:
                    v = reader.torch(k)
                    mod._parameters[leaf] = nn.Parameter(v.to(t.dtype) if t.is_floating_point() else v,
                                                         requires_grad=t.requires_grad)
            for leaf, t in list(mod._buffers.items()):
                k = f"{name}.{leaf}" if name else leaf
                if t is not None and k in reader.entries and leaf not in mod._non_persistent_buffers_set:
                    v = reader.torch(k)
                    mod._buffers[leaf] = v.to(t.dtype) if t.is_floating_point() else v
    if tied:
        model.tie_weights()
    left_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left_meta:
        raise CorruptCheckpointError(f"tensors {left_meta[:5]} were not loaded from the checkpoint")
    left = sorted(set(reader.entries) - reader.used)
    if left:
        more = f" (and {len(left) - 1} more: {left[1:4]})" if len(left) > 1 else ""
        raise CorruptCheckpointError(f"tensor {left[0]!r} in {reader.entries[left[0]][0].path.name} is not a tensor "
                                     f"the config explains{more}")
    model.qcore_config = config
    if device is not None:
        model.to(device)
    return model.eval()

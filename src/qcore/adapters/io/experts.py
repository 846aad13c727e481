"""Fused MoE experts (``qcore.adapters.modules.QuantExperts``) in checkpoints, and the passes that refuse them.

On disk a quantized fused experts module is written as the per-expert Linear layers the model family's own
checkpoints hold, under the names ``save_pretrained`` writes for the float model (transformers' conversion
mapping, reverted): Mixtral ``model.layers.0.block_sparse_moe.experts.3.w1`` / ``w3`` / ``w2``, Qwen2-MoE and
Qwen3-MoE ``model.layers.0.mlp.experts.3.gate_proj`` / ``up_proj`` / ``down_proj``, with Quark's tensor names
(``weight``, ``weight_scale``, ``weight_zero_point``, ``input_scale``, ...): the gate and up halves of
``gate_up_proj`` are the ``w1`` / ``w3`` (``gate_proj`` / ``up_proj``) rows; a per-tensor (or two-level tensor)
scale, one per expert and fused projection in qcore, is written to both halves. A model whose conversion mapping
has no per-expert names gets qcore's own: ``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``. Such a
checkpoint says ``quant_method: "qcore"`` (transformers' Quark integration, amd-quark 0.13, does not read
quantized fused experts), so the tensors are in qcore's layout (1-D packed codes, ``quark_hf.checkpoint_method``):
in Quark's int8 / fp8 ``[I, H]`` layout, transformers without qcore would load them as float weights. Older
exports in Quark's layouts (``experts_layout``) are still read, as their ``qcore.layouts`` say.

``qcore.adapters.from_pretrained`` reads them back (``ExpertsShell``): the per-expert tensors are loaded as they
are, checked, and joined into a frozen ``QuantExperts``. Float fused experts are written per expert too (as
``save_pretrained`` does) when no experts of the model are quantized; fused experts a checkpoint stores float under
their fused names (AMD Quark 0.13 leaves them float) are loaded float and excluded in the loaded config.
"""

from __future__ import annotations

import pathlib
import re
import warnings
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from qcore.formats import quark_layout as L
from qcore.formats.safetensors_io import CorruptCheckpointError, SafetensorsFile, TensorRecord

from .records import ST_TORCH, to_numpy, record, tensor_record
from ..modules import EXPERT_PROJS, QuantExperts, QuantModule, is_fused_experts
from ..plan import default_exclude, plan_model, resolve_config

__all__ = ["disk_names", "experts_layout", "experts_records", "ExpertsShell", "check_no_experts",
           "drop_expert_converters"]

ISSUE = "docs/adapters.md, 'Families by feature'"
_HALVES = ("gate", "up")


# ---------------------------------------------------------------------------------------------------------------
# refusals: passes and formats that do not handle fused experts yet
# ---------------------------------------------------------------------------------------------------------------


def _experts_named(model: nn.Module, config: Any) -> list[str]:
    """The fused experts modules of ``model`` that are (or, for a float model quantized with ``config``, would
    be) quantized."""
    names = [n for n, m in model.named_modules() if isinstance(m, QuantExperts)]
    if names or any(isinstance(m, QuantModule) for m in model.modules()) or config is None:
        return names
    if not any(is_fused_experts(m) for m in model.modules()):
        return []
    try:
        with warnings.catch_warnings():  # plan_model's own warnings are the quantizer's to give, once
            warnings.simplefilter("ignore")
            plans = plan_model(model, resolve_config(config))
    except (ValueError, TypeError):
        return []  # the caller's own checks say what is wrong with the config
    return [p.name for p in plans if p.type == "Experts"]


def check_no_experts(model: nn.Module, config: Any = None, *, who: str) -> None:
    """Before any work: ValueError naming the first quantized fused experts tensor of ``model`` (quantized, or
    planned by ``config``) for a writer ``who`` that does not write them yet."""
    names = _experts_named(model, config)
    if names:
        raise ValueError(f"{who}: the model's fused MoE experts are quantized ({len(names)} module(s), e.g. tensor "
                         f"{names[0]}.gate_up_proj); {who} does not handle quantized fused experts yet "
                         f"({ISSUE}). {_INSTEAD.get(who, _INSTEAD['export'])}, or keep the experts float: "
                         f"exclude=[..., 're:.*\\.experts']")


_INSTEAD = {"quantize_checkpoint": "Quantize the model in memory (quantize_model) and write it with export_hf",
            "export": "Write the model with export_hf (per-expert tensors, read by qcore.adapters.from_pretrained)"}


# ---------------------------------------------------------------------------------------------------------------
# names and layout on disk
# ---------------------------------------------------------------------------------------------------------------


def disk_names(model: nn.Module, name: str, n_experts: int) -> dict[tuple, str]:
    """``{(proj, e, half): checkpoint prefix}`` of the per-expert Linears of the fused experts module ``name``:
    ``("gate_up_proj", e, "gate")``, ``("gate_up_proj", e, "up")``, ``("down_proj", e, None)``. From
    transformers' conversion mapping of ``model`` (what ``save_pretrained`` writes); qcore's own
    ``<name>.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` when it has none."""
    return _disk_names(model, name, n_experts)[0]


def _disk_names(model: nn.Module, name: str, n_experts: int) -> tuple[dict[tuple, str], bool]:
    """(``disk_names``, whether they are transformers' own)."""
    own = _own_names(name, n_experts)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return own, False
    e_ = n_experts
    with torch.device("cpu"):  # (transformers builds models to load under a meta device context)
        probe = {f"{name}.gate_up_proj": torch.arange(e_ * 2, dtype=torch.float32).reshape(e_, 2, 1),
                 f"{name}.down_proj": (torch.arange(e_, dtype=torch.float32) + 2 * e_).reshape(e_, 1, 1)}
        try:
            out = revert_weight_conversion(model, dict(probe)) if hasattr(model, "config") else probe
        except Exception:  # a mapping transformers cannot revert on this probe: qcore's own names
            return own, False
    found: dict[tuple, str] = {}
    for k, t in out.items():
        if t.numel() != 1 or not k.endswith(".weight"):
            return own, False
        v = int(t.reshape(()).item())
        key = ("gate_up_proj", v // 2, _HALVES[v % 2]) if v < 2 * e_ else ("down_proj", v - 2 * e_, None)
        found[key] = k[:-len(".weight")]
    if set(found) != set(own) or len(set(found.values())) != len(found):
        return own, False
    return found, True


def _own_names(name: str, n_experts: int) -> dict[tuple, str]:
    """qcore's own per-expert names (a family whose checkpoints have none)."""
    return {**{("gate_up_proj", e, h): f"{name}.{e}.{h}_proj" for e in range(n_experts) for h in _HALVES},
            **{("down_proj", e, None): f"{name}.{e}.down_proj" for e in range(n_experts)}}


def _rows(proj: str, half: Optional[str], out: int) -> tuple:
    if half is None:
        return 0, out
    return (0, out // 2) if half == "gate" else (out // 2, out)


def experts_layout(spec, shapes: dict) -> str:
    """The layout (``qcore.formats.quark_layout``) every per-expert Linear of a fused experts module is stored in:
    the Linear layout of its gate / up / down slices when they agree, else qcore's extension."""
    _, o, i = shapes["gate_up_proj"]
    _, o2, i2 = shapes["down_proj"]
    layouts = {L.weight_layout(spec, (o // 2, i), module="Linear"), L.weight_layout(spec, (o2, i2), module="Linear")}
    return layouts.pop() if len(layouts) == 1 else "qcore"


def split_problem(spec, shapes: dict) -> Optional[str]:
    """Why the gate / up halves of ``gate_up_proj`` cannot be written as two Linears (None when they can)."""
    _, o, i = shapes["gate_up_proj"]
    rows = spec.scale_shape((o, i))[0]
    if rows not in (1, o):
        return (f"its weight scales ({type(spec.granularity).__name__}) span {o // rows} rows, which the gate / up "
                f"halves of gate_up_proj would split")
    return None


def _split(q, rows: tuple, out: int) -> L.WeightParts:
    """One half's ``WeightParts`` of an expert's [out, in] ``QTensor`` (rows ``rows``)."""
    a, b = rows

    def cut(t):
        if t is None:
            return None
        x = np.asarray(t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t)
        return x[a:b] if x.ndim and x.shape[0] == out and (a, b) != (0, out) else x

    def arr(t):
        return None if t is None else np.asarray(t.detach().cpu().float().numpy() if t.is_floating_point()
                                                 else t.detach().cpu().numpy())
    return L.WeightParts(codes=cut(arr(q.codes)), scales=cut(arr(q.scales.float())),
                         zero_points=None if q.zero_points is None else cut(arr(q.zero_points.float())),
                         shifts=None if q.subblock_shifts is None else cut(arr(q.subblock_shifts)),
                         tensor_scale=None if q.tensor_scale is None else arr(q.tensor_scale.float()).reshape(()))


def _static(m: QuantExperts, proj: str, role: str, e: int, rows: tuple, out: int) -> dict:
    """A role's calibrated scale arrays of expert ``e``'s ``proj`` (the rows of ``rows`` for a per-feature output
    scale of a half)."""
    spec = m.specs[role]
    b = m._buffers
    if spec.two_level:
        return {"tensor_scale": b[f"{proj}_{role}_tensor_scale"][e].detach().cpu().float().numpy()}
    s = b[f"{proj}_{role}_scale"][e].detach().cpu().float().numpy()
    z = b.get(f"{proj}_{role}_zero_point")
    z = None if z is None else z[e].detach().cpu().float().numpy()
    if role == "output" and s.ndim == 1 and (rows[0], rows[1]) != (0, out):
        s = s[rows[0]:rows[1]]
        z = None if z is None else z[rows[0]:rows[1]]
    return {"scale": s, "zero_point": z}


def _linears(model: nn.Module, name: str, m: QuantExperts):
    """``[(prefix on disk, proj, e, half, rows, out)]`` of the per-expert Linears, in expert order."""
    shapes = {p: m.expert_shape(p) for p in EXPERT_PROJS}
    names = disk_names(model, name, shapes["gate_up_proj"][0])
    out = []
    for e in range(shapes["gate_up_proj"][0]):
        for proj, half in (("gate_up_proj", "gate"), ("gate_up_proj", "up"), ("down_proj", None)):
            o = shapes[proj][1]
            out.append((names[(proj, e, half)], proj, e, half, _rows(proj, half, o), o))
    return out


def experts_records(model: nn.Module, name: str, m: QuantExperts, layout: str, pack_method: str
                    ) -> list[TensorRecord]:
    """The tensors of a quantized fused experts module in the checkpoint: per expert, its gate / up / down Linears
    (weight codes and scales in ``layout``, calibrated activation scales), as lazy records (one expert's encoded
    tensors at a time)."""
    spec = m.specs["weight"]
    problem = split_problem(spec, {p: m.expert_shape(p) for p in EXPERT_PROJS})
    if problem is not None:
        raise ValueError(f"export {name!r}: {problem}; not written yet ({ISSUE})")
    cache: dict = {}
    records: list[TensorRecord] = []
    for prefix, proj, e, half, rows, out in _linears(model, name, m):
        shape = (rows[1] - rows[0], m.expert_shape(proj)[2])

        def enc(proj=proj, e=e, rows=rows, out=out):
            key = (proj, e, rows)
            if cache.get("key") != key:
                cache.clear()
                cache["key"] = key
                cache["enc"] = L.encode_weight(_split(m.expert_qtensor(proj, e), rows, out), spec, layout=layout,
                                               pack_method=pack_method)
            return cache["enc"]
        for suffix, (dt, shp) in L.expected_weight(spec, shape, layout=layout).items():
            records.append(record(f"{prefix}.{suffix}", dt, lambda enc=enc, suffix=suffix: enc()[suffix][1], shp))
        for role in m.static_roles():
            if not m.is_calibrated(role):
                raise ValueError(f"export {name!r}: static {role} scales are not calibrated; run quantize_model "
                                 f"with calibration data before exporting")
            arrays = L.activation_tensors(role, m.specs[role], layout=layout,
                                          **_static(m, proj, role, e, rows, out))
            for n, (dt, a) in arrays.items():
                records.append(record(f"{prefix}.{n}", dt, lambda a=a: a, a.shape))
    return records


# ---------------------------------------------------------------------------------------------------------------
# loading (qcore.adapters.io.quark_hf)
# ---------------------------------------------------------------------------------------------------------------


class ExpertsShell(nn.Module):
    """Placeholder for one quantized fused experts module while transformers loads the checkpoint: one submodule
    per per-expert Linear (``0.w1``, ...: the checkpoint names below the experts module, after transformers'
    renamings), holding parameters named, shaped and typed as the checkpoint stores them (on meta until
    loaded). ``expected``: ``{path below the module: (dtype, shape)}``; ``disk``: ``{that path: the name in the
    checkpoint}``. ``own``: the per-expert weights are in qcore's extension (``"qcore"`` layout) whatever their
    format (``quark_hf.own_layout``)."""

    def __init__(self, model: nn.Module, name: str, m: nn.Module, config, *, own: bool = False):
        super().__init__()
        q = QuantExperts.from_module(m, config, name=name)  # planned here (on meta), filled by build()
        object.__setattr__(self, "_wrapper", q)
        if "weight" not in q.specs:
            raise ValueError(f"experts {name!r}: the config quantizes no weight (activation-only experts are not "
                             f"read from checkpoints yet, {ISSUE})")
        spec = q.specs["weight"]
        shapes = {p: q.expert_shape(p) for p in EXPERT_PROJS}
        problem = split_problem(spec, shapes)
        if problem is not None:
            raise CorruptCheckpointError(f"experts {name!r}: {problem}; not read yet ({ISSUE})")
        self.qname = name
        self.layout = "qcore" if own else experts_layout(spec, shapes)
        self.expected: dict[str, tuple] = {}
        self.disk: dict[str, str] = {}
        self.linears = []
        tail = name.rpartition(".")[2] + "."
        for prefix, proj, e, half, rows, out in _linears(model, name, q):
            if tail not in prefix:
                raise CorruptCheckpointError(f"experts {name!r}: checkpoint name {prefix!r} does not hold "
                                             f"{tail[:-1]!r}; qcore cannot place it")
            rel = prefix.rsplit(tail, 1)[1]
            shape = (rows[1] - rows[0], shapes[proj][2])
            want = dict(L.expected_weight(spec, shape, layout=self.layout))
            for role in q.static_roles():
                sshape = q.expert_static_scale_shape(proj, role)
                if role == "output" and sshape:
                    sshape = (shape[0],)
                want.update(L.expected_activation(role, q.specs[role], sshape, layout=self.layout))
            holder = nn.Module()
            for suffix, (dt, shp) in want.items():
                holder.register_parameter(suffix, nn.Parameter(torch.empty(shp, dtype=ST_TORCH[dt], device="meta"),
                                                               requires_grad=False))
                self.expected[f"{rel}.{suffix}"] = (dt, shp)
                self.disk[f"{rel}.{suffix}"] = f"{prefix}.{suffix}"
            _set_path(self, rel, holder)
            self.linears.append((rel, proj, e, half, rows, out, shape))

    def build(self, pack_method: str, dtype: torch.dtype) -> QuantExperts:
        """The frozen ``QuantExperts`` of the loaded tensors (validated values)."""
        q = self._wrapper
        spec = q.specs["weight"]
        where = f"experts {self.qname!r}"
        params = dict(self.named_parameters())
        missing = [self.disk[n] for n in self.expected if params[n].is_meta]
        if missing:
            raise CorruptCheckpointError(f"{where}: tensors {missing[:3]} were not loaded from the checkpoint")
        device = next(iter(params.values())).device
        halves: dict = {}
        acts: dict = {}
        for rel, proj, e, half, rows, out, shape in self.linears:
            arrays = {k[len(rel) + 1:]: to_numpy(params[k]) for k in self.expected if k.startswith(rel + ".")}
            lw = f"{where} ({self.disk[rel + '.weight']})"
            parts = L.decode_weight(arrays, spec, shape, layout=self.layout, pack_method=pack_method, where=lw)
            halves.setdefault((proj, e), []).append(parts)
            for role in q.static_roles():
                acts.setdefault((proj, e, role), []).append((L.decode_activation(arrays, role, q.specs[role],
                                                                                 where=lw), rel))
        joined = {p: [_join(halves[(p, e)], f"{where} expert {e} {p}") for e in range(q.expert_shape(p)[0])]
                  for p in EXPERT_PROJS}
        q.load_frozen(joined, dtype=dtype, device=device)
        with torch.no_grad():
            for (proj, e, role), got in acts.items():
                spec_r = q.specs[role]
                vals = [a for a, _ in got]
                key = "tensor_scale" if spec_r.two_level else "scale"
                if role == "input" and any(not np.array_equal(vals[0][key], v[key]) for v in vals[1:]):
                    raise CorruptCheckpointError(f"{where}: the input scales of expert {e}'s gate and up Linears "
                                                 f"({got[0][1]}, {got[1][1]}) differ; they see the same input, "
                                                 f"which qcore quantizes once")
                if spec_r.two_level:
                    if any(not np.array_equal(vals[0][key], v[key]) for v in vals[1:]):
                        raise CorruptCheckpointError(f"{where}: expert {e}'s {role} tensor scales of {proj} differ")
                    _put(q, f"{proj}_{role}_tensor_scale", e, vals[0][key], device)
                    continue
                for k, buf in (("scale", f"{proj}_{role}_scale"), ("zero_point", f"{proj}_{role}_zero_point")):
                    if buf not in q._buffers:
                        continue
                    parts = [v[k] if v[k] is not None else np.zeros(np.shape(v["scale"]), np.float32) for v in vals]
                    if role == "output" and np.ndim(parts[0]) == 1 and len(parts) > 1:
                        arr = np.concatenate(parts)
                    else:
                        if any(not np.array_equal(parts[0], x) for x in parts[1:]):
                            raise CorruptCheckpointError(f"{where}: expert {e}'s {role} {k}s of {proj} differ between "
                                                         f"its gate and up Linears")
                        arr = parts[0]
                    _put(q, buf, e, arr, device)
            q.mark_static_scales_loaded()
        left = [n for n, t in list(q.named_parameters()) + list(q.named_buffers()) if t is not None and t.is_meta]
        if left:
            raise RuntimeError(f"{where}: {left} stayed unloaded (a qcore bug; please report it)")
        return q


def _put(q: QuantExperts, buf: str, e: int, arr, device) -> None:
    """Write expert ``e``'s row of the buffer ``buf`` (made real, on ``device``, the first time)."""
    b = q._buffers[buf]
    if b.is_meta:
        b = q._buffers[buf] = torch.full(b.shape, float("nan"), dtype=torch.float32, device=device)
    b[e].copy_(torch.from_numpy(np.asarray(arr, np.float32)).reshape(b[e].shape))


def _join(parts: list, where: str) -> L.WeightParts:
    """One expert projection's ``WeightParts`` from its Linears' (gate and up rows joined; down as it is)."""
    if len(parts) == 1:
        return parts[0]
    a, b = parts
    rows = a.codes.shape[0]

    def cat(x, y, what):
        if x is None and y is None:
            return None
        if x is None or y is None:
            raise CorruptCheckpointError(f"{where}: {what} stored for one of the gate / up Linears only")
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim and x.shape[0] == rows:
            return np.concatenate([x, y])
        if not np.array_equal(x, y):
            raise CorruptCheckpointError(f"{where}: the gate and up Linears have different per-tensor {what}; qcore "
                                         f"holds one per expert's gate_up_proj (requantize the experts with qcore)")
        return x
    return L.WeightParts(codes=np.concatenate([a.codes, b.codes]), scales=cat(a.scales, b.scales, "scales"),
                         zero_points=cat(a.zero_points, b.zero_points, "zero points"),
                         shifts=cat(a.shifts, b.shifts, "shifts"),
                         tensor_scale=cat(a.tensor_scale, b.tensor_scale, "tensor scales"))


def _set_path(root: nn.Module, path: str, module: nn.Module) -> None:
    parts = path.split(".")
    cur = root
    for p in parts[:-1]:
        if p not in cur._modules:
            cur.add_module(p, nn.Module())
        cur = cur._modules[p]
    cur.add_module(parts[-1], module)


def drop_expert_converters(conversions: list, shells: dict) -> list:
    """transformers' weight conversions without those that merge per-expert tensors into the fused parameters of
    the experts loaded through an ``ExpertsShell`` (their per-expert tensors load as they are)."""
    if not any(isinstance(sh, ExpertsShell) for sh in shells.values()):
        return conversions
    out = []
    for c in conversions:
        targets = getattr(c, "_original_target_patterns", None) or getattr(c, "target_patterns", None) or []
        targets = [targets] if isinstance(targets, str) else list(targets)
        if any(re.sub(r"^.*\.", "", t.rstrip("$")) in EXPERT_PROJS for t in targets if isinstance(t, str)):
            continue
        out.append(c)
    return out


# ---------------------------------------------------------------------------------------------------------------
# float (excluded) fused experts: written as the family's per-expert float Linears, as save_pretrained does
# ---------------------------------------------------------------------------------------------------------------


def float_experts_split(model: nn.Module) -> dict[str, list]:
    """``{state-dict key of a float fused experts parameter: [(checkpoint name, (proj, e, rows)), ...]}`` for the
    float fused experts of ``model`` (known layout), when the model holds no quantized fused experts: they are
    written per expert under the names ``save_pretrained`` writes (and transformers' own conversion merges them
    back on load). Empty when the model has quantized fused experts (qcore's loader then reads the float ones
    under their fused names) or when the family's checkpoints have no per-expert names."""
    if any(isinstance(m, QuantExperts) for m in model.modules()):
        return {}
    out: dict[str, list] = {}
    for name, m in model.named_modules():
        if not is_fused_experts(m):
            continue
        e_ = m.gate_up_proj.shape[0]
        names, theirs = _disk_names(model, name, e_)
        if not theirs:
            continue  # no per-expert names in this family's checkpoints: the fused parameters as they are
        for proj in EXPERT_PROJS:
            o = getattr(m, proj).shape[1]
            halves = ("gate", "up") if proj == "gate_up_proj" else (None,)
            out[f"{name}.{proj}"] = [(names[(proj, e, h)] + ".weight", (proj, e, _rows(proj, h, o)))
                                     for e in range(e_) for h in halves]
    return out


def float_experts_records(model: nn.Module, key: str, t: torch.Tensor, parts: list) -> list[TensorRecord]:
    """The per-expert float tensors of the fused parameter ``t`` (state-dict ``key``), lazily sliced."""
    return [tensor_record(disk, t.detach()[e, rows[0]:rows[1]]) for disk, (proj, e, rows) in parts]


def check_split_experts(key: str, t: torch.Tensor, parts: list, entries: dict, want_float: Optional[str]) -> None:
    """A float fused experts parameter (state-dict ``key``, the model's tensor ``t``) stored per expert: every
    per-expert tensor present, in the checkpoint's float dtype, with its slice's shape (``CorruptCheckpointError``
    naming the tensor otherwise)."""
    for disk, (proj, e, rows) in parts:
        if disk not in entries:
            raise CorruptCheckpointError(f"tensor {key!r} of the model is missing from the checkpoint (neither it nor "
                                         f"its per-expert tensors such as {disk!r} are stored)")
        ent, f = entries[disk]
        shape = (rows[1] - rows[0], t.shape[2])
        if ent.dtype != want_float or tuple(ent.shape) != shape:
            raise CorruptCheckpointError(f"tensor {disk!r} is {ent.dtype} {list(ent.shape)} in {pathlib.Path(f).name}; "
                                         f"the model needs {want_float} (the checkpoint's float dtype) {list(shape)}")


def stored_float_experts(model: nn.Module, config, checkpoint_files) -> list[str]:
    """The fused experts modules that ``config`` quantizes but the checkpoint stores float under their fused names
    (AMD Quark 0.13 leaves transformers 5's fused experts float, whatever its config says): loaded float."""
    if not checkpoint_files or not any(is_fused_experts(m) for m in model.modules()):
        return []
    with warnings.catch_warnings():  # the loader's own plan_model gives them, once
        warnings.simplefilter("ignore")
        names = [p.name for p in plan_model(model, config, check_float=False) if p.type == "Experts"]
    if not names:
        return []
    keys: set = set()
    for f in checkpoint_files:
        keys |= set(SafetensorsFile(f).entries)
    return [n for n in names if all(f"{n}.{p}" in keys for p in EXPERT_PROJS)]


def exclude_float_experts(model: nn.Module, config, names: list):
    """``config`` with the fused experts ``names`` (stored float) excluded: what the loaded model holds."""
    exclude = list(config.exclude) if config.exclude is not None else default_exclude(model)
    return config.replace(exclude=tuple(exclude) + tuple(n for n in names if n not in exclude))

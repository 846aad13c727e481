"""Importance matrices of a torch model (llama.cpp's ``llama-imatrix``): collection, files, quantizer weights.

``collect_imatrix(model, data)`` runs the calibration batches through the whole model (one forward per batch,
no gradients) with a forward pre-hook on every Linear-like module (``nn.Linear`` and its qcore subclasses,
transformers' ``Conv1D``), and returns ``{name: ImatrixStats}``: per module, the sum over calibration tokens of
each input column's square, and the token count (``qcore.algorithms.imatrix``). Names (``names=``):
``"gguf"`` (default) the llama.cpp tensor names ``blk.3.attn_q.weight`` (``qcore.adapters.gguf_names.gguf_names``,
the map the GGUF export writes with), so the result is the file ``llama-imatrix`` would write for the same
model; ``"module"`` the torch module names (``model.layers.3.self_attn.q_proj``) for any model.

What is counted, as llama.cpp does: every token of every batch, except padding (a dict batch's
``attention_mask`` zeros are left out wherever a module's input has the mask's ``[batch, tokens]`` shape). The
output head (``output.weight``) is left out unless ``process_output=True`` (``llama-imatrix --process-output``);
the token embedding is a lookup, not a matrix product, so it has no statistic. Fused MoE experts of
transformers' standard layout (``_plain_experts``: Mixtral, Qwen2/3-MoE, OLMoE) give per-expert statistics over
the tokens routed to each expert (llama.cpp's ``mul_mat_id`` branch): ``ffn_gate_exps`` / ``ffn_up_exps`` (the
experts' input) and ``ffn_down_exps`` (``act(gate) * up``, recomputed from the expert's weights); module names
``<experts>.gate_up_proj`` / ``<experts>.down_proj``. Other experts, and routers that are not ``nn.Linear``
(llama.cpp's ``ffn_gate_inp``), get no entry (the quantizer then uses no importance for them, as llama.cpp does
for any tensor missing from the file).

``save_imatrix(stats, path)`` writes llama.cpp's file (GGUF for ``.gguf``, legacy for ``.dat``;
``qcore.formats.imatrix``); ``load_imatrix(path)`` reads either back as ``{name: ImatrixStats}``.
``module_quant_weights(model, stats)`` turns collected or loaded statistics into ``{module name: float32
weights}``: the ``imatrix=`` argument of ``qcore.quantize(module.weight (canonical [out, in]), gguf_spec,
imatrix=...)``, i.e. llama.cpp's ``quant_weights`` for that tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Optional

import numpy as np
import torch
from torch import nn

from qcore.algorithms.config import ROTATION_CONFIGS, AutoSmoothQuantConfig, AWQConfig, SmoothQuantConfig
from qcore.algorithms.imatrix import ImatrixStats, quant_weights
from qcore.formats.imatrix import ImatrixDat, ImatrixGGUF, read_imatrix, write_imatrix

from .batches import call_model, device_of, progress_bar, to_device
from .gguf_names import expert_names, gguf_names
from .modules import EXPERT_PROJS, IN_OUT, QuantExperts, is_fused_experts, weight_layout
from .moe import find_moe_blocks

__all__ = ["collect_imatrix", "save_imatrix", "load_imatrix", "module_quant_weights", "linear_modules",
           "model_importance"]

_NAMES = ("gguf", "module")


def _in_features(m: nn.Module) -> Optional[int]:
    if isinstance(m, nn.Linear):
        return int(m.in_features)
    if weight_layout(m) == IN_OUT and getattr(m, "weight", None) is not None and m.weight.dim() == 2:
        return int(m.weight.shape[0])  # transformers' Conv1D: weight [in, out]
    return None


def linear_modules(model: nn.Module) -> dict:
    """Module name -> input features, for every Linear-like module of ``model``."""
    return {n: k for n, m in model.named_modules() if (k := _in_features(m)) is not None}


def _key_map(model: nn.Module, names: str, process_output: bool) -> dict:
    """Module name -> the statistic's name, for the modules collected."""
    lin = linear_modules(model)
    if names == "module":
        head = _head_name(model)
        return {n: n for n in lin if process_output or n != head}

    try:
        g = gguf_names(model)
    except (TypeError, ValueError) as e:
        raise ValueError(f"collect_imatrix: names='gguf' needs a model qcore writes as GGUF ({e}); pass "
                         f"names='module' for module names") from None
    return {n: f"{g[n]}.weight" for n in lin if n in g and (process_output or g[n] != "output")}


def _head_name(model: nn.Module) -> Optional[str]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    for n, m in model.named_modules():
        if m is head:
            return n
    return None


def _plain_experts(model: nn.Module) -> dict:
    """Fused experts modules whose math qcore recomputes: ``{experts module name: MoEBlock}`` for transformers'
    standard fused layout (Mixtral, Qwen2/3-MoE, OLMoE, ...: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``
    plain parameters, ``act_fn``, no biases), each token ``act_fn(x @ gate.T) * (x @ up.T)`` into ``down_proj``.
    Other experts (biased or interleaved gpt-oss experts, qcore's quantized experts) are not collected."""

    out = {}
    for b in find_moe_blocks(model):
        name = f"{b.name}.{b.experts}" if b.name else b.experts
        ex = model.get_submodule(name)
        gu, dn = ex._parameters.get("gate_up_proj"), ex._parameters.get("down_proj")
        if gu is None or dn is None or gu.dim() != 3 or dn.dim() != 3 or not callable(getattr(ex, "act_fn", None)):
            continue
        e, i2, h = gu.shape
        if i2 % 2 or tuple(dn.shape) != (e, h, i2 // 2) or e != b.num_experts \
                or any("bias" in k for k in ex._parameters) or getattr(ex, "is_transposed", False):
            continue
        out[name] = b
    return out


def _expert_keys(model: nn.Module, experts: dict, names: str) -> dict:
    """Experts module name -> (gate, up, down) statistic names."""
    if names == "module":
        return {n: (f"{n}.gate_up_proj", f"{n}.gate_up_proj", f"{n}.down_proj") for n in experts}

    g = expert_names(model)
    return {n: tuple(f"{g[n]}.{t}.weight" for t in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
            for n in experts if n in g}


def _collect_experts(ex: nn.Module, x: torch.Tensor, index: torch.Tensor, acc: dict, key: str) -> None:
    """Add one call's tokens to the experts' sums: ``x`` [T, H] (float64 squares), ``index`` [T, k] the routed
    experts. ``acc[key] = [in sums [E, H], in counts [E], down sums [E, I], down counts [E]]``."""
    e_n = ex.gate_up_proj.shape[0]
    if key not in acc:
        acc[key] = [torch.zeros(e_n, x.shape[-1], dtype=torch.float64, device=x.device),
                    torch.zeros(e_n, dtype=torch.int64),
                    torch.zeros(e_n, ex.down_proj.shape[-1], dtype=torch.float64, device=x.device),
                    torch.zeros(e_n, dtype=torch.int64)]
    a = acc[key]
    xd = x.to(torch.float64)
    for e in range(e_n):
        tok = (index == e).any(-1).nonzero().reshape(-1)  # a token listing expert e (once: top-k are distinct)
        if tok.numel() == 0:
            continue
        cur = x[tok]
        a[0][e] += (xd[tok] * xd[tok]).sum(0)
        a[1][e] += int(tok.numel())
        gate, up = nn.functional.linear(cur, ex.gate_up_proj[e]).chunk(2, dim=-1)
        hid = (ex.act_fn(gate) * up).to(torch.float64)
        a[2][e] += (hid * hid).sum(0)
        a[3][e] += int(tok.numel())


def collect_imatrix(model: nn.Module, data: Iterable, *, names: str = "gguf", process_output: bool = False,
                    progress: bool = True) -> dict:
    """``{name: ImatrixStats}`` of every Linear-like module of ``model`` over the calibration batches ``data``
    (tensors of token ids, dicts such as a tokenizer's output, or tuples: what ``model(batch)`` takes). See
    the module docstring for ``names`` and what is counted."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module, got {type(model).__name__}")
    if names not in _NAMES:
        raise ValueError(f"names must be one of {_NAMES}, got {names!r}")
    if isinstance(data, (torch.Tensor, Mapping)) or data is None:
        raise TypeError(f"data must be an iterable of calibration batches (a list of tensors or dicts), got "
                        f"{type(data).__name__}")
    keys = _key_map(model, names, process_output)
    if not keys and not _plain_experts(model):
        raise ValueError("collect_imatrix: the model has no Linear-like module to collect (nn.Linear, Conv1D)")
    batches = list(data)
    if not batches:
        raise ValueError("collect_imatrix: data holds no calibration batch")
    dev = device_of(model)
    sums: dict = {}
    counts: dict = {}
    mask: list = [None]

    def hook(mod_name):
        def pre(mod, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            x = x.detach()
            m = mask[0]
            if m is not None and tuple(x.shape[:-1]) == tuple(m.shape):
                x = x[m]
            rows = x.reshape(-1, x.shape[-1]).to(torch.float64)
            s = (rows * rows).sum(0)
            if not bool(torch.isfinite(s).all()):
                raise ValueError(f"collect_imatrix: non-finite activations reach {mod_name!r} "
                                 f"({keys[mod_name]!r})")
            if mod_name in sums:
                sums[mod_name] += s
                counts[mod_name] += int(rows.shape[0])
            else:
                sums[mod_name], counts[mod_name] = s, int(rows.shape[0])
        return pre

    experts = _plain_experts(model)
    ekeys = _expert_keys(model, experts, names)
    eacc: dict = {}

    def ehook(mod_name):
        def pre(mod, args, kwargs):
            vals = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index") if k in kwargs]
            x, index = vals[0].detach(), vals[1].detach()
            m = mask[0]
            if m is not None and m.numel() == x.shape[0]:
                keep = m.reshape(-1)
                x, index = x[keep], index[keep]
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"collect_imatrix: non-finite activations reach {mod_name!r}")
            with torch.no_grad():
                _collect_experts(mod, x, index, eacc, mod_name)
        return pre

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n), with_kwargs=True) for n in keys]
    handles += [model.get_submodule(n).register_forward_pre_hook(ehook(n), with_kwargs=True) for n in ekeys]
    try:
        with torch.no_grad():
            for b in progress_bar(batches, total=len(batches), desc="imatrix", enabled=progress):
                b = to_device(b, dev)
                am = b.get("attention_mask") if isinstance(b, Mapping) else None
                mask[0] = None if am is None or bool((am != 0).all()) else (am != 0)
                call_model(model, b)
    finally:
        for h in handles:
            h.remove()
        mask[0] = None
    out = {}
    for n, k in keys.items():
        if n not in sums:  # never called (e.g. a branch the batches never reach): zero tokens
            s = torch.zeros(linear_modules(model)[n], dtype=torch.float64)
            c = 0
        else:
            s, c = sums[n], counts[n]
        out[k] = ImatrixStats(s.reshape(1, -1).cpu().numpy(), np.array([c], np.int64))
    for n, (kg, ku, kd) in ekeys.items():
        ex = model.get_submodule(n)
        e_n, _, h = ex.gate_up_proj.shape
        a = eacc.get(n) or [torch.zeros(e_n, h, dtype=torch.float64), torch.zeros(e_n, dtype=torch.int64),
                            torch.zeros(e_n, ex.down_proj.shape[-1], dtype=torch.float64),
                            torch.zeros(e_n, dtype=torch.int64)]
        inp = ImatrixStats(a[0].cpu().numpy(), a[1].numpy())
        out[kg] = inp
        out[ku] = inp
        out[kd] = ImatrixStats(a[2].cpu().numpy(), a[3].numpy())
    return dict(sorted(out.items()))


def imatrix_format(path, format: Optional[str]) -> str:
    """The imatrix file format of ``path``: ``format`` ("gguf" or "dat") or, when None, its extension."""
    if format is None:
        ext = os.fspath(path).rsplit(".", 1)[-1].lower() if "." in os.path.basename(os.fspath(path)) else ""
        if ext not in ("gguf", "dat"):
            raise ValueError(f"path {os.fspath(path)!r}: give format='gguf' or 'dat' (or a .gguf / .dat name)")
        return ext
    if format not in ("gguf", "dat"):
        raise ValueError(f"format must be 'gguf' or 'dat', got {format!r}")
    return format


def save_imatrix(stats: Mapping[str, ImatrixStats], path, *, format: Optional[str] = None, datasets=(),
                 chunk_size: int = 512, overwrite: bool = False) -> None:
    """Write ``{name: ImatrixStats}`` as llama.cpp's imatrix file: ``format`` ``"gguf"`` (``imatrix.gguf``,
    llama.cpp's default) or ``"dat"`` (legacy), by default from the file name. ``datasets``: the calibration
    data's name(s); ``chunk_size``: tokens per chunk (llama.cpp's ``n_ctx``: the chunk count stored, and the
    legacy format's ``ncall``, derive from it)."""

    fmt = imatrix_format(path, format)
    if not isinstance(stats, Mapping) or not stats:
        raise ValueError("stats must be a non-empty {name: ImatrixStats} mapping")
    ds = (datasets,) if isinstance(datasets, str) else tuple(datasets)
    if fmt == "gguf":
        obj = ImatrixGGUF.from_stats(stats, datasets=ds, chunk_size=chunk_size)
    else:
        obj = ImatrixDat.from_stats(stats, chunk_size=chunk_size, dataset=ds[-1] if ds else "")
    write_imatrix(obj, path, overwrite=overwrite)


def load_imatrix(path, *, chunk_size: int = 512) -> dict:
    """``{name: ImatrixStats}`` from a llama.cpp imatrix file of either format (``chunk_size``: for the legacy
    format, which does not store it; the quantizer's weights do not depend on it)."""

    obj = read_imatrix(path)
    return obj.stats(chunk_size=chunk_size) if isinstance(obj, ImatrixDat) else obj.stats()


def module_quant_weights(model: nn.Module, stats: Mapping[str, ImatrixStats]) -> dict:
    """``{module name: float32 quant_weights}`` for the Linear-like modules of ``model`` that ``stats`` (keyed by
    GGUF tensor names or by module names, as ``collect_imatrix`` / ``load_imatrix`` give) has an entry for:
    the ``imatrix=`` argument of ``qcore.quantize`` for that module's canonical ``[out, in]`` weight. Modules
    without an entry are absent (llama.cpp then quantizes without importance). An entry whose width is not the
    module's input width is refused (an imatrix of another model)."""
    if not isinstance(stats, Mapping):
        raise TypeError(f"stats must be a mapping of name -> ImatrixStats, got {type(stats).__name__}")
    lin = linear_modules(model)
    try:

        g = {f"{v}.weight": k for k, v in gguf_names(model).items() if k in lin}
    except (TypeError, ValueError):
        g = {}
    out = {}
    for key, st in stats.items():
        mod = g.get(key, key if key in lin else None)
        if mod is None:
            continue
        if not isinstance(st, ImatrixStats):
            raise TypeError(f"stats[{key!r}] must be an ImatrixStats, got {type(st).__name__}")
        if st.n != lin[mod] or st.n_mat != 1:
            raise ValueError(f"stats[{key!r}] has {st.n_mat} x {st.n} values; module {mod!r} takes {lin[mod]} "
                             f"inputs (an importance matrix of another model?)")
        out[mod] = quant_weights(st)
    return out


def experts_quant_weights(model: nn.Module, stats: Mapping[str, ImatrixStats]) -> dict:
    """``{experts module name: {"gate_up_proj": float32 [E, 2, H], "down_proj": float32 [E, 1, I]}}`` for the fused
    experts of ``model`` (float or ``QuantExperts``) that ``stats`` has entries for (GGUF names ``blk.N.ffn_gate_exps
    .weight`` / ``ffn_up_exps`` / ``ffn_down_exps``, or module names ``<experts>.gate_up_proj`` / ``.down_proj``):
    llama.cpp's per-expert ``quant_weights``, the gate rows' and the up rows' of ``gate_up_proj`` apart (one
    statistic each in llama.cpp's file; the same input, so equal when collected together). An entry whose shape is
    not ``[E, in]`` of its experts is refused; experts with any of their entries missing are absent."""
    exps = {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts) or is_fused_experts(m)}
    keys = {n: [_expert_keys(model, exps, "module")[n]] for n in exps}
    try:
        for n, k in _expert_keys(model, exps, "gguf").items():
            keys[n].insert(0, k)
    except (TypeError, ValueError):
        pass
    out = {}
    for n, m in exps.items():
        shapes = {p: (m.expert_shape(p) if isinstance(m, QuantExperts) else tuple(m._parameters[p].shape))
                  for p in EXPERT_PROJS}
        for gate, up, down in keys[n]:
            if not all(k in stats for k in (gate, up, down)):
                continue
            w = {}
            for k, proj in ((gate, "gate_up_proj"), (up, "gate_up_proj"), (down, "down_proj")):
                st = stats[k]
                if not isinstance(st, ImatrixStats):
                    raise TypeError(f"stats[{k!r}] must be an ImatrixStats, got {type(st).__name__}")
                e_, _, i = shapes[proj]
                if st.n != i or st.n_mat != e_:
                    raise ValueError(f"stats[{k!r}] has {st.n_mat} x {st.n} values; the experts {n!r} take {e_} x {i} "
                                     f"({proj}; an importance matrix of another model?)")
                w.setdefault(proj, []).append(np.asarray(quant_weights(st), np.float32).reshape(e_, i))
            out[n] = {p: np.ascontiguousarray(np.stack(v, axis=1)) for p, v in w.items()}
            break
    return out


# ---------------------------------------------------------------------------------------------------------------
# quantize_model(..., imatrix=): the importance of each module with a GGUF weight spec
# ---------------------------------------------------------------------------------------------------------------

IMPORTANCE_ATTR = "_gguf_importance"  # module-local state: float32 [in] weights of a GGUF-spec module


def _read_stats(imatrix) -> Mapping:
    if isinstance(imatrix, (str, os.PathLike)):
        path = os.fspath(imatrix)
        if not os.path.isfile(path):
            raise ValueError(f"imatrix={path!r}: no such file (an imatrix file: llama.cpp's .gguf or legacy .dat)")
        try:
            return load_imatrix(path)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"imatrix={path!r}: not a readable imatrix file: {e}") from None
    if isinstance(imatrix, Mapping):
        if not imatrix:
            raise ValueError("imatrix: an empty mapping (expected {name: ImatrixStats} from collect_imatrix or "
                             "load_imatrix)")
        return imatrix
    raise TypeError(f"imatrix must be a mapping of name -> ImatrixStats (collect_imatrix / load_imatrix) or the path "
                    f"of an imatrix file, got {type(imatrix).__name__}")


def check_importance_algorithms(algorithms) -> None:
    """ValueError when the algorithms change the layers' inputs (rotations, smoothing): an importance matrix of
    the float model no longer describes them."""

    changers = [a.name for a in algorithms if isinstance(a, ROTATION_CONFIGS + (AWQConfig, SmoothQuantConfig,
                                                                               AutoSmoothQuantConfig))]
    if changers:
        raise ValueError(f"imatrix= with the algorithms {changers}: they change the layers' inputs, so an importance "
                         f"matrix of the float model no longer describes them; quantize with imatrix= without them")


def model_importance(model: nn.Module, plans: list, imatrix, algorithms=()) -> dict:
    """``{module name: float32 quant_weights}`` for the planned modules whose weight spec is a GGUF type, from
    ``imatrix`` (``{name: ImatrixStats}`` keyed by GGUF tensor names or module names, or an imatrix file's path),
    checked before any work (``quantize_model(..., imatrix=)``; docs/gguf.md "Importance matrices and GPTQ for
    GGUF types"; fused experts: ``experts_quant_weights``, ``{proj: [E, halves, in]}``). ValueError when no planned
    module has a GGUF weight spec, when a Linear or fused experts with a GGUF spec have no entry (the output head
    excepted: ``llama-imatrix`` leaves it out unless ``--process-output``; embeddings are lookups and never have
    one; both are quantized without importance, as llama.cpp does), when an entry's width
    is not its module's input width, or with algorithms that change the layers' inputs (rotations, smoothing)."""
    check_importance_algorithms(algorithms)
    stats = _read_stats(imatrix)
    gguf = [p for p in plans if p.config.weight is not None and p.config.weight.spec.gguf]
    if not gguf:
        raise ValueError("imatrix= applies to modules whose weight spec is a GGUF type (q2_k ... q6_k, q4_0 ... q8_0, "
                         "iq4_nl); the config gives none")
    weights = module_quant_weights(model, stats)
    weights.update(experts_quant_weights(model, stats))  # fused experts: {proj: [E, halves, in]}
    head = _head_name(model)
    lin = linear_modules(model)
    out, missing = {}, []
    for p in gguf:
        if p.name in weights:
            out[p.name] = weights[p.name]
        elif (p.name in lin and p.name != head) or p.type == "Experts":
            missing.append(p.name)
    if missing:
        try:
            g = gguf_names(model)
            shown = [f"{n} ({g[n]}.weight)" if n in g else n for n in missing[:5]]
        except (TypeError, ValueError):
            shown = missing[:5]
        raise ValueError(f"imatrix has no entry for {len(missing)} module(s) with a GGUF weight spec: "
                         f"{', '.join(shown)}{' ...' if len(missing) > 5 else ''} (entries look like "
                         f"{list(stats)[:3]}); an importance matrix of another model, or collected with other names?")
    # tied weights: one tensor, one importance (or none)
    by_tensor: dict = {}
    for p in gguf:
        w = getattr(model.get_submodule(p.name), "weight", None)
        if isinstance(w, torch.Tensor):
            by_tensor.setdefault(id(w), []).append(p.name)
    for names in by_tensor.values():
        vals = [out.get(n) for n in names]
        if len(names) > 1 and any(v is not None for v in vals) and not all(
                v is not None and np.array_equal(v, vals[0]) for v in vals):
            import warnings
            warnings.warn(f"imatrix: the tied weight of {names} has an importance for some of its modules only; it is "
                          f"quantized without (llama.cpp writes one tensor for them)", stacklevel=3)
            for n in names:
                out.pop(n, None)
    return out


class attached_importance:
    """Context manager: ``{module name: weights}`` set as module-local state (``IMPORTANCE_ATTR``) on the
    modules of ``model`` while ``quantize_model`` runs (GPTQ reads it from the float module, the wrappers copy it
    when they are made); removed from those float modules on exit."""

    def __init__(self, model: nn.Module, importance: Mapping):
        self._mods = [(model.get_submodule(n), {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}
                       if isinstance(w, Mapping) else np.ascontiguousarray(w, dtype=np.float32))
                      for n, w in importance.items()]

    def __enter__(self):
        for m, w in self._mods:
            m.__dict__[IMPORTANCE_ATTR] = w
        return self

    def __exit__(self, *exc):
        for m, _ in self._mods:
            m.__dict__.pop(IMPORTANCE_ATTR, None)
        return False


def importance_digest(model: nn.Module) -> Optional[str]:
    """A digest of the importance attached to ``model``'s modules (None without): what ties a work directory to
    the imatrix of the run."""
    import hashlib

    h, any_ = hashlib.sha256(), False
    for n, m in model.named_modules():
        w = m.__dict__.get(IMPORTANCE_ATTR)
        if w is not None:
            any_ = True
            for k, v in (sorted(w.items()) if isinstance(w, Mapping) else [("", w)]):  # fused experts: per proj
                h.update(n.encode() + k.encode() + b"\0" + np.ascontiguousarray(v, dtype=np.float32).tobytes())
    return h.hexdigest() if any_ else None

"""A GGUF file evaluated as llama.cpp computes it: ``llama_cpp_perplexity``, ``computing_as_llama_cpp``.

``from_gguf`` gives a model holding exactly the file's weights, and qcore's perplexity of it is the file's own.
llama.cpp (its CPU backend, what llama-cpp-python and ``llama-perplexity`` run) computes the same weights
differently; what of that changes the figure, and what this module reproduces (``LlamaCppNumerics``, each part
switchable to measure its share: bench/bench_gguf_llama_ppl.py, bench/results/GGUF_LLAMA_PPL.md):

- ``activations``: every matrix product with a weight tensor of the file (each Linear, the fused experts, the
  output head: ``output``, or ``token_embd`` where the head is tied) first converts its activation rows to the
  weight type's ``vec_dot_type`` (``qcore.ggml_act``): 8-bit blocks ``Q8_0`` (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4
  weights), ``Q8_1`` (Q4_1, Q5_1), ``Q8_K`` (k-quants), float16 for F16 weights, bfloat16 for BF16; F32 weights
  see the activations as they are. The module's input is replaced by ``qcore.ggml_act.activation_values``.
- ``offsets``: a Q4_1 / Q5_1 dot product multiplies each block's weight offset ``m`` by Q8_1's float16 ``s``
  (``fp16(d * sum(codes))``), not by the sum of the rounded activations: each such module adds
  ``q8_1_residual(x) @ m.T`` (``m`` the file's offsets, one per block of 32, in the model's row order).
- ``kv_cache``: llama.cpp keeps K and V in a float16 cache (its default ``type_k`` / ``type_v``) and computes
  ``K Q`` with ``Q`` converted to float16 (the F16 cache's vec_dot_type) and ``V softmax(K Q)`` with the
  probabilities converted to float16: the attention runs with q, k, v and the probabilities rounded to float16
  (a registered transformers attention function, ``ATTENTION``; flash attention off, llama-cpp-python's
  default).

Everything else in llama.cpp's graphs is float32 as in transformers (norms, rope, softmax, the residual stream,
biases, Gemma's scaled embedding and soft-capping); what remains is the order of float32 sums.

The model must come from ``from_gguf`` (its ``qcore_gguf_report`` names each tensor's GGUF type) and compute in
float32. ``llama_cpp_perplexity(path, tokenizer, ...)`` loads the file, evaluates it under the protocol
(``evaluate.perplexity``) inside ``computing_as_llama_cpp``, and is what ``qcore quantize --export gguf``
reports as ``ppl_llama_cpp``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
from collections.abc import Iterable, Iterator
from typing import Optional, Union

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from qcore import ggml_act
from qcore.formats import gguf as G

from ..gguf_names import gguf_family
from ..io.gguf import from_gguf
from . import evaluate as E

__all__ = ["LlamaCppNumerics", "computing_as_llama_cpp", "llama_cpp_perplexity", "gguf_matmul_types",
           "ATTENTION"]

ATTENTION = "qcore_llama_cpp"  # the transformers attention function (and mask) registered for the F16 cache
_OFFSET_TYPES = {"Q4_1": (20, 2), "Q5_1": (24, 2)}  # block bytes, byte offset of m (float16) in the block


@dataclasses.dataclass(frozen=True)
class LlamaCppNumerics:
    """Which of llama.cpp's departures from float32 to reproduce (module docstring); ``variant``: the activation
    quantizers' ``qcore.ggml_act`` variant (``"x86"``: ggml-cpu on x86, ``"ref"``: ggml's reference C)."""

    activations: bool = True
    offsets: bool = True
    kv_cache: bool = True
    variant: str = "x86"

    def __post_init__(self):
        for f in ("activations", "offsets", "kv_cache"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"LlamaCppNumerics.{f} must be True or False, got {getattr(self, f)!r}")
        if self.variant not in ggml_act.VARIANTS:
            raise ValueError(f"LlamaCppNumerics.variant must be one of {ggml_act.VARIANTS}, got {self.variant!r}")
        if self.offsets and not self.activations:
            raise ValueError("LlamaCppNumerics(offsets=True) needs activations=True: Q8_1's sums are those of the "
                             "rounded activations")


# -- which module multiplies by which tensor ---------------------------------------------------------------------

def _report(model):
    rep = getattr(model, "qcore_gguf_report", None)
    if rep is None:
        raise ValueError(f"model: computing as llama.cpp needs a model loaded by from_gguf (it has no "
                         f"qcore_gguf_report), got {type(model).__name__}")
    return rep


def gguf_matmul_types(model: nn.Module) -> dict:
    """``{module name: (GGUF type, GGUF tensor name(s))}`` of every module of a ``from_gguf`` model that llama.cpp
    runs as a matrix product with a tensor of the file: Linear-like modules (their ``.weight``), fused experts
    (``gate_up_proj`` / ``down_proj`` -> one entry each, ``"<experts>.gate_up_proj"``), and the output head
    (the ``output`` tensor's type, or ``token_embd``'s where the file has no ``output``)."""
    rep = _report(model)
    by_gguf = {r.gguf_name: r for r in rep.tensors}
    out = {}
    for r in rep.tensors:
        if not r.gguf_name.endswith(".weight") or r.gguf_name == "token_embd.weight":
            continue
        role = r.gguf_name.split(".")[-2]
        if role.endswith("_exps"):
            continue
        mod = r.name[:-len(".weight")] if r.name.endswith(".weight") else None
        if mod is None or not isinstance(_get(model, mod), (nn.Linear,)) and not _is_conv1d(_get(model, mod)):
            continue
        out[mod] = (r.gguf_type, (r.gguf_name,))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        name = next(n for n, m in model.named_modules() if m is head)
        src = by_gguf.get("output.weight") or by_gguf.get("token_embd.weight")
        if src is not None:
            out[name] = (src.gguf_type, (src.gguf_name,))
    for exp_name, parts in _experts(model, by_gguf).items():
        for proj, (kind, names) in parts.items():
            out[f"{exp_name}.{proj}"] = (kind, names)
    return out


def _get(model, name):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _is_conv1d(m) -> bool:
    return type(m).__name__ in ("Conv1D", "QuantConv1D")


def _experts(model, by_gguf) -> dict:
    """``{experts module name: {"gate_up_proj": (type, names), "down_proj": (type, names)}}``."""
    out = {}
    for name, m in model.named_modules():
        if not (hasattr(m, "gate_up_proj") or hasattr(m, "expert_shape")) or not hasattr(m, "act_fn"):
            continue
        layer = _layer_index(name)
        if layer is None:
            continue
        gate, up, down = (by_gguf.get(f"blk.{layer}.ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
        if gate is None or up is None or down is None:
            continue
        if gate.gguf_type != up.gguf_type:
            raise ValueError(f"{name}: ffn_gate_exps is {gate.gguf_type} and ffn_up_exps {up.gguf_type}; qcore "
                             f"computes the experts' gate and up as one product")
        out[name] = {"gate_up_proj": (gate.gguf_type, (gate.gguf_name, up.gguf_name)),
                     "down_proj": (down.gguf_type, (down.gguf_name,))}
    return out


def _layer_index(name: str) -> Optional[int]:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a in ("layers", "h") and b.isdigit():
            return int(b)
    return None


# -- Q4_1 / Q5_1 offsets in the model's row order -----------------------------------------------------------------

def _offsets(reader, names: tuple, model, arch) -> Optional[torch.Tensor]:
    """The float16 offsets ``m`` of each block of the Q4_1 / Q5_1 tensor(s) ``names`` as float32 ``[rows, blocks]``
    (experts: ``[E, rows, blocks]``, gate rows then up rows), rows in the model's order (as ``from_gguf`` puts the
    weights), or None for other types."""
    ts = {t.name: t for t in reader.tensors}
    arrs = []
    for n in names:
        t = ts[n]
        kind = t.tensor_type.name
        if kind not in _OFFSET_TYPES:
            return None
        size, at = _OFFSET_TYPES[kind]
        data = np.asarray(t.data)
        blocks = data.reshape(*data.shape[:-1], data.shape[-1] // size, size)
        m = np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)
        role = n.split(".")[-2]
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        n_head = int(cfg.num_attention_heads)
        if arch.permute_qk and role in ("attn_q", "attn_k"):
            m = G.unpermute_qk(m, n_head if role == "attn_q" else int(getattr(cfg, "num_key_value_heads", None)
                                                                          or n_head))
        if role == "attn_qkv" and gguf_family(model)[0].qkv_layout == "per_head":
            m = G.qkv_heads_from_gguf(m, n_head)
        arrs.append(m)
    return torch.from_numpy(np.concatenate(arrs, axis=-2) if len(arrs) > 1 else arrs[0])


# -- the installed numerics ------------------------------------------------------------------------------------

def _vec_dot(kind: str) -> str:
    try:
        return ggml_act.vec_dot_type(kind)
    except ValueError:
        raise ValueError(f"computing as llama.cpp: GGUF type {kind} has no vec_dot_type qcore reproduces") from None


def _round(x: torch.Tensor, vdt: str, variant: str) -> torch.Tensor:
    if vdt == "F32":
        return x
    return ggml_act.activation_values(x.float(), vdt, variant=variant).to(x.dtype)


def _linear_forward(orig, vdt: str, m: Optional[torch.Tensor], variant: str):
    def forward(x, *args, **kwargs):
        y = orig(_round(x, vdt, variant), *args, **kwargs)
        if m is not None:
            y = y + ggml_act.q8_1_residual(x.float(), variant=variant).to(y.dtype) @ m.to(y.device, y.dtype).T
        return y
    return forward


def _experts_forward(mod, kinds: dict, offsets: dict, variant: str):
    """The experts' forward with each expert's two products computed as llama.cpp's ``mul_mat_id``."""
    # every expert's weight [E, out, in] dequantized once (a qcore QuantExperts), or the float parameter
    gu, down = (mod.effective_proj(p) if hasattr(mod, "effective_proj") else getattr(mod, p).detach()
                for p in ("gate_up_proj", "down_proj"))
    n = gu.shape[0]

    def product(x, w, proj, e):
        vdt = kinds[proj]
        y = F.linear(_round(x, vdt, variant), w)
        m = offsets.get(proj)
        if m is not None:
            y = y + ggml_act.q8_1_residual(x.float(), variant=variant).to(y.dtype) @ m[e].to(y.device, y.dtype).T
        return y

    def forward(hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=n + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in (int(i[0]) for i in hit):
            if e == n:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            x = hidden_states[token_idx]
            gate, up = product(x, gu[e], "gate_up_proj", e).chunk(2, dim=-1)
            y = product(mod.act_fn(gate) * up, down[e], "down_proj", e)
            final.index_add_(0, token_idx, (y * top_k_weights[token_idx, top_k_pos, None]).to(final.dtype))
        return final
    return forward


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().to(x.dtype)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers' eager attention with q, k, v and the probabilities rounded to float16 (llama.cpp's F16 KV
    cache and the F16 vec_dot of its two attention products); the mask as eager's (additive float)."""
    from transformers.integrations.sdpa_attention import repeat_kv
    groups = getattr(module, "num_key_value_groups", 1)
    q, k, v = _f16(query), repeat_kv(_f16(key), groups), repeat_kv(_f16(value), groups)
    if scaling is None:
        scaling = module.head_dim ** -0.5
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        w = w + attention_mask[:, :, :, :k.shape[-2]]
    w = _f16(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype))
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)


@contextlib.contextmanager
def computing_as_llama_cpp(model: nn.Module, *, numerics: LlamaCppNumerics = LlamaCppNumerics(),
                           path: Union[None, str, os.PathLike] = None) -> Iterator[nn.Module]:
    """Within the block, ``model`` (from ``from_gguf``, float32) computes as llama.cpp's CPU backend does (module
    docstring; ``numerics`` chooses the parts). ``path``: the GGUF file (default: the one ``from_gguf`` read,
    ``model.qcore_gguf_report.path``), read for the Q4_1 / Q5_1 offsets. Everything is put back on exit."""
    if not isinstance(numerics, LlamaCppNumerics):
        raise TypeError(f"numerics must be a LlamaCppNumerics, got {type(numerics).__name__}")
    rep = _report(model)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes - {torch.float32}:
        raise ValueError(f"model: computing as llama.cpp needs float32 weights (from_gguf(dtype=torch.float32)), got "
                         f"{sorted(str(d) for d in dtypes)}")
    types = gguf_matmul_types(model)
    reader = None
    if numerics.offsets and any(k in _OFFSET_TYPES for k, _ in types.values()):
        import gguf
        reader = gguf.GGUFReader(pathlib.Path(path if path is not None else rep.path))
        arch = gguf_family(model)[2]
    patched, variant = [], numerics.variant
    cfg = getattr(model, "config", None)
    old_attn = getattr(cfg, "_attn_implementation", None)
    try:
        if numerics.activations:
            experts = {}
            for name, (kind, names) in types.items():
                vdt = _vec_dot(kind)
                m = _offsets(reader, names, model, arch) if reader is not None and kind in _OFFSET_TYPES else None
                owner, _, proj = name.rpartition(".")
                if proj in ("gate_up_proj", "down_proj") and not isinstance(_get(model, name), nn.Module):
                    experts.setdefault(owner, ({}, {}))
                    experts[owner][0][proj] = vdt
                    if m is not None:
                        experts[owner][1][proj] = m
                    continue
                mod = model.get_submodule(name)
                mod.forward = _linear_forward(mod.forward, vdt, m, variant)
                patched.append(mod)
            for owner, (kinds, offs) in experts.items():
                mod = model.get_submodule(owner)
                mod.forward = _experts_forward(mod, kinds, offs, variant)
                patched.append(mod)
        if numerics.kv_cache:
            _register_attention()
            _set_attention(model, ATTENTION)
        yield model
    finally:
        for mod in patched:
            del mod.forward  # the instance attribute: the class's forward again
        if numerics.kv_cache and old_attn is not None:
            _set_attention(model, old_attn)


def _set_attention(model: nn.Module, name: str) -> None:
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "_attn_implementation"):
            c._attn_implementation = name


def llama_cpp_perplexity(path: Union[str, os.PathLike], tokenizer, *, token_ids: Optional[torch.Tensor] = None,
                         text: Optional[str] = None, seq_len: int = E.SEQ_LEN,
                         windows: Iterable[int] = E.EVAL_WINDOWS, progress: bool = False,
                         numerics: LlamaCppNumerics = LlamaCppNumerics()) -> float:
    """The perplexity llama.cpp computes for the GGUF file ``path`` under the protocol (``evaluate.perplexity``'s
    windows and arguments), predicted by qcore: the file loaded by ``from_gguf`` (float32) and evaluated inside
    ``computing_as_llama_cpp``."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"path: no such GGUF file: {str(p)!r}")
    model = from_gguf(p, dtype=torch.float32)
    with computing_as_llama_cpp(model, numerics=numerics, path=p):
        return E.perplexity(model, tokenizer, token_ids=token_ids, text=text, seq_len=seq_len, windows=windows,
                            progress=progress)

"""Export a quantized model as one GGUF file (llama.cpp's format): ``export_gguf``.

Families: those whose architecture record (``qcore.adapters.families``) names a ``gguf_arch`` that qcore writes
(``qcore.formats.gguf.ARCHS``): Llama and Mistral (llama.cpp's ``llama``), Qwen2 (``qwen2``, q/k/v biases), Qwen3
(``qwen3``, per-head q/k norms ``attn_q_norm`` / ``attn_k_norm``), Gemma (``gemma``: norms stored as ``1 + w``, the
head tied to ``token_embd``), Gemma2 (``gemma2``: also its sandwich norms, soft-capping and sliding window), Gemma3
(``gemma3``: also q/k norms, a rope base per layer type), Phi-3
(``phi3``: fused ``attn_qkv`` and ``ffn_up`` holding gate and up), and the mixtures of experts: Mixtral
(``llama`` with experts), Qwen2-MoE (``qwen2moe``, with its shared expert ``ffn_*_shexp``), Qwen3-MoE
(``qwen3moe``), GPT-2 (``gpt2``) and GPT-NeoX (``gptneox``): LayerNorms written with their biases
(``formats.gguf.Arch.norm``), biases on every projection, the fused ``attn_qkv``; GPT-2's learned positions
(``position_embd``, the record's ``pos_embed``) and its transformers ``Conv1D`` projections (weights stored
``[in, out]``) written as the Linear ``[out, in]`` they are (quantized: their canonical layout already; float:
transposed); GPT-NeoX's ``query_key_value`` rows, interleaved per head (the record's ``qkv_layout``
``per_head``), reordered to llama.cpp's ``[q | k | v]`` (``formats.gguf.qkv_heads_to_gguf``: weights, biases,
block bytes, codes and scales move with their rows), its partial rotary as ``rope.dimension_count``, its head
written even when tied (llama.cpp's graph always reads ``output``). The tensor names come from the record
(``gguf_names``; the fused experts module of each layer, ``gguf_names.expert_names``, as the 3-D ``ffn_gate_exps`` /
``ffn_up_exps`` / ``ffn_down_exps`` ``[E, out, in]``: gate and
up are the two halves of each expert's ``gate_up_proj`` rows); every other family is refused before any work
(``check_gguf``), naming its model_type and what is missing. Each expert's block matrix is encoded as a Linear
of the same spec would be (one GGUF type per tensor), and reported per tensor; experts with a GGUF weight spec
are written as their type (``down_proj`` its own where it has one), byte for byte (``_encode_gguf_experts``).

Each quantized weight whose qcore grid is a GGUF block type (``qcore.formats.gguf.gguf_type``: int4 symmetric ->
Q4_0, uint4 / int4 asymmetric -> Q4_1 (Q4_0 when every zero point is 7 or 8, ``gguf.q4_0_holds``: what ggml's
Q4_0 files import as), int8 symmetric -> Q8_0, MXFP4 -> MXFP4 (type 39); groups of a multiple of 32 along the
input axis, per channel or per tensor) is written code for code. It is **lossless** when ggml's
dequantization of the written blocks equals the in-memory dequantized weight (float16-exact scales; for
asymmetric Q4_1 also a float16-exact ``scale * zero_point``), which is checked for every tensor. Weights no GGUF
type holds (groups of 16, int2, fp8, NVFP4, MX6, ...) are re-quantized from the in-memory dequantized weight
with ggml's reference quantizer of the nearest type (4-bit ints -> Q4_0 / Q4_1, 8-bit ints -> Q8_0, fp4 ->
MXFP4), or written as float (F16 where the values are float16, else F32) when no block type is near; their
distance from the in-memory model is reported. ``strict=True`` refuses anything not lossless instead
(ValueError naming the tensor).

Float tensors: norms F32 (as llama.cpp expects), other float matrices F16 if the model holds float16, else F32.
For ``llama`` files ``attn_q`` / ``attn_k`` rows are permuted to llama.cpp's rotary order
(``formats.gguf.permute_qk``; llama.cpp's converter does this for ``llama`` only). A tied output head is not
written (llama.cpp and transformers reuse ``token_embd``), except where the graph needs one
(``Arch.output_required``: ``gptneox``).

**Activation quantization is not part of GGUF** (llama.cpp quantizes activations its own way inside its
kernels). A model with quantized inputs or outputs (static or dynamic, incl. a KV cache) is refused unless
``drop_activations=True``; then the weights are written and ``GGUFExportInfo.dropped`` names each dropped role.
Online rotations (QuaRot / SpinQuant hooks) are refused: llama.cpp's graphs cannot run them.

Tokenizer (llama.cpp needs one): ``tokenizer=`` a transformers BPE (byte-level, GPT-2 style) tokenizer, converted
to ``tokenizer.ggml.*`` (model ``gpt2``, pre-tokenizer ``tokenizer_pre``, by default the architecture's
``Arch.tokenizer_pre``: ``gpt-2`` for GPT-2 and GPT-NeoX, ``default`` elsewhere), a SentencePiece tokenizer
(Llama-2, Mistral, Gemma, Phi-3: a slow one with ``sp_model``, or a fast one whose BPE has byte fallback; model
``llama`` with scores and piece types, ``src/qcore/adapters/io/_gguf_tokenizer.py``), or the path of a GGUF file whose
``tokenizer.*`` fields are copied verbatim (e.g. the file the model was loaded from).

Guarantees: no pickle; the write is atomic (a hidden temporary sibling file renamed into place with
``os.replace``) and deterministic (the same model gives a byte-identical file); validation names the offending
tensor before anything is written. The GGUF writer (gguf-py) holds the encoded tensors in memory until the
file is written (the quantized size of the model, not the float size).

Import a GGUF file (llama.cpp's format) into a transformers model with frozen qcore modules: ``from_gguf``.

Architectures: those qcore writes (``qcore.formats.gguf.ARCHS``): ``llama`` (Llama, and Mistral, which llama.cpp
writes as ``llama``: it comes back as a Llama), ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``, ``gemma3``, ``phi3``,
``gpt2`` (GPT-2's projections come back as transformers ``Conv1D``: quantized ones as ``QuantConv1D`` from the
blocks, float ones transposed back to ``[in, out]``), ``gptneox`` (``attn_qkv`` rows put back per head,
``formats.gguf.qkv_heads_from_gguf``; ``partial_rotary_factor`` from ``rope.dimension_count``; a head written
for a tied model comes back untied, with the same values), and with experts ``llama`` (``expert_count`` in the
metadata: Mixtral), ``qwen2moe``, ``qwen3moe``; fused experts come back as a frozen ``QuantExperts`` built from
the blocks when their three tensors share one block type and
one qcore spec (``_import_experts``), or when they are of GGUF spec types with gate and up alike
(``_import_gguf_experts``: k-quants, Q5_x, IQ4_NL, float-offset Q4_1; ``ffn_down_exps`` may have its own type, as
llama.cpp's mixes write it: the experts' per-projection spec), else as float experts holding ggml's
dequantization (reported).
The model is built from the file's metadata (``formats.gguf.config_from_metadata``) as the transformers family
whose record (``qcore.adapters.families``) names that ``gguf_arch``, and the tensor names come from the record
(``export_gguf.gguf_names``), as on export. Gemma's (Gemma2's, Gemma3's) norms are stored as ``s = 1 + w`` and
read back as ``w' = s - 1`` (float32; for ``s`` in [0.5, 2] the model's ``1 + w'`` is ``s`` exactly, not always
``w' == w``).

Every Linear weight stored as Q4_0, Q4_1, Q8_0 or MXFP4 (type 39) becomes a frozen qcore module built from the
file's blocks directly (codes and scales, no float round trip; ``qcore.formats.gguf.import_blocks`` gives the
qcore spec, one per tensor, groups of 32 along the input axis): Q8_0 -> int8 symmetric, Q4_0 -> int4
symmetric (uint4 with zero points 7 / 8 where ggml's quantizer wrote negative block scales), Q4_1 -> uint4 with
integer zero points (symmetric when they are all 0), MXFP4 -> mxfp4; float16 scales (E8M0 for MXFP4). Each is
checked: ``qcore.dequantize`` of the imported parts equals ggml's dequantization (gguf-py's, bit for bit) of the
tensor, so the model computes with exactly the values transformers' own GGUF loader would give it (in float32).

A quantized token embedding becomes a frozen ``QuantEmbedding``; when the output head is tied to it
(``tie_word_embeddings``, no ``output`` tensor) the head becomes a frozen module of the same spec sharing the
embedding's buffers (``_tied_head_of``): llama.cpp's head multiplies by the same quantized matrix, and
``export_gguf`` writes such a head as no tensor (``_shares_weight``), so the file goes back byte for byte.

What has no exact qcore grid is imported as a float weight holding ggml's dequantization and listed in a
warning and in the report (``how="dequantized"``), or refused with ``strict=True``:

- block types qcore has no spec for (IQ2_*, IQ3_*, TQ*, ...): refused
  (ValueError naming the tensor) unless ``dequantize_other=True``.

Q2_K..Q6_K, Q5_0, Q5_1, IQ4_NL, Q4_1 tensors whose offsets ``m`` are not ``-d * k`` for integer zero points
(ggml's quantizer writes ``m = min(x)``) and Q8_0 tensors no int8 grid holds become frozen modules of qcore's GGUF
spec of their type (``make_spec("q4_k")``, ...) holding the file's block bytes as they are
(``load_frozen_gguf``); a module with a GGUF spec is written as its type from those bytes, so such files
export back byte for byte.

F32 / F16 / BF16 tensors stay float (in ``dtype``). In ``llama`` files ``attn_q`` / ``attn_k`` rows are put back
from llama.cpp's rotary order into transformers' (``formats.gguf.unpermute_qk``; codes and scales move with their
rows, exact).

The model carries ``model.qcore_config`` (a ``ModelConfig`` describing exactly its quantized modules, so that
``export_hf`` and ``export_gguf`` write it again) and ``model.qcore_gguf_report`` (``GGUFImportReport``: per
tensor its GGUF type, how it was imported, the qcore spec, and whether the model holds its values exactly).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn

import qcore
from qcore import QuantSpec
from qcore._fsutil import check_file_destination, model_sources, staged_dir, staged_file
from qcore.dtypes import IntDType
from qcore.formats import gguf as G
from qcore.formats.gguf import check_file
from qcore.formats.quark_layout import WeightParts
from qcore.formats.safetensors_io import CorruptCheckpointError

from ._gguf_tokenizer import sentencepiece_fields_of
from .common import (check_config_describes, check_destination, export_units, refuse_low_rank, weight_parts,
                     will_rotate_online)
from ..config import ModelConfig, LayerConfig, TensorConfig
from ..modules import (IN_OUT, QUANT_CLASSES, QuantExperts, QuantModule, input_rotations, is_fused_experts,
                       linear_weight, weight_layout)
from ..batches import set_module
from ..families import FAMILIES
from ..gguf_names import expert_names, family_problem, gguf_arch, gguf_family, gguf_names

__all__ = ['export_gguf', 'export_gguf_dir', 'check_gguf', 'gguf_names', 'gguf_family', 'GGUFExportInfo',
           'TensorReport', 'GGUF_FILE', 'from_gguf', 'GGUFImportReport', 'ImportedTensor', 'check_gguf_file',
           'GGUFFile']


# ---------------------------------------------------------------------------------------------------------------
# export (formerly export_gguf.py)
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorReport:
    """One quantized weight in the GGUF file: its GGUF type, whether it is lossless, and the max abs difference
    between ggml's dequantization of it and the in-memory dequantized weight."""

    name: str
    gguf_name: str
    gguf_type: str
    exact: bool
    max_abs_diff: float
    how: str  # "codes" (written code for code), "requantized" (ggml's quantizer), "float"


@dataclass(frozen=True)
class GGUFExportInfo:
    path: str
    bytes_on_disk: int
    types: dict = field(default_factory=dict)  # gguf tensor name -> type name
    quantized: tuple = ()  # TensorReport per quantized weight
    dropped: tuple = ()  # "module (role)" of activation quantization not written
    # keys of export_gguf(metadata=) gguf-py's writer cannot write (empty arrays); out of the repr, which stays what
    # it was for every export without metadata=
    not_carried: tuple = field(default=(), repr=False)

    @property
    def lossless(self) -> bool:
        return all(r.exact for r in self.quantized)

    @property
    def inexact(self) -> tuple:
        return tuple(r for r in self.quantized if not r.exact)


def _in_memory_weight(m: QuantModule) -> np.ndarray:
    return m.effective("weight", canonical=True).float().cpu().numpy()


def _nearest_type(spec) -> Optional[str]:
    el = spec.dtype
    if isinstance(el, IntDType) and el.bits == 4:
        return "Q4_0" if el.signed and spec.symmetric else "Q4_1"
    if isinstance(el, IntDType) and el.bits == 8:
        return "Q8_0"
    if el.name == "float4_e2m1fn":
        return "MXFP4"
    return None


def _float_array(w: np.ndarray) -> tuple[np.ndarray, str]:
    h = w.astype(np.float16)
    if np.array_equal(h.astype(np.float32), w):
        return h, "F16"
    return np.ascontiguousarray(w, np.float32), "F32"


def _exactness(data: np.ndarray, kind: str, how: str, ref: np.ndarray) -> tuple[bool, float]:
    """Whether the written tensor ``data`` (2-D rows of blocks, or float) holds the in-memory weight ``ref``
    exactly, and the max abs difference: ggml's dequantization of blocks, the values of a float tensor."""
    if how == "float":
        return (bool(np.array_equal(data.astype(np.float32), ref)),
                float(np.max(np.abs(data.astype(np.float64) - ref), initial=0.0)))
    return G.is_exact(data, kind, ref)


def _encode_quantized(name: str, gbase: str, m: QuantModule, strict: bool) -> tuple[np.ndarray, str, TensorReport]:
    spec = m.specs["weight"]
    if spec.gguf:  # a GGUF spec: its own ggml type, the stored block bytes as they are (no re-quantization)
        kind = G.GGUF_KIND_OF[spec.gguf]
        data = m.gguf_blocks()
        shape = m.weight_shape if m.frozen else tuple(_in_memory_weight(m).shape)
        if len(shape) != 2:
            raise ValueError(f"export_gguf: {name!r} has a weight of shape {list(shape)}; GGUF holds 2-D matrices")
        ref = _in_memory_weight(m)
        if m.weight_dtype != torch.float32:  # a model cast to float16 / bfloat16 computes with the blocks' values
            vals = torch.from_numpy(G.dequantize(data, kind, ref.shape))  # rounded to its dtype
            exact = torch.equal(vals.to(m.weight_dtype).float(), torch.from_numpy(ref))
        else:
            exact, diff = _exactness(data, kind, "codes", ref)
        if not exact:
            raise RuntimeError(f"export_gguf: {name}.weight: the {kind} blocks do not reproduce the module's weight "
                               f"(a qcore bug; please report it)")
        return data, kind, TensorReport(f"{name}.weight", f"{gbase}.weight", kind, True, 0.0, "codes")
    parts, shape = weight_parts(m)
    ref = _in_memory_weight(m)
    if ref.shape != tuple(shape):
        raise ValueError(f"export_gguf: {name!r} has a weight of shape {list(ref.shape)}; GGUF holds 2-D matrices")
    kind = G.gguf_type(spec, shape)
    if kind == "Q4_1" and G.q4_0_holds(parts, spec, shape):
        kind = "Q4_0"  # zero points 7 / 8 only (e.g. ggml's Q4_0 imported): no offset to round
    if kind is not None:
        data = G.encode(parts, spec, kind=kind)
        how = "codes"
    else:
        kind = _nearest_type(spec) if shape[1] % G.BLOCK == 0 else None
        if kind is not None:
            data, how = G.quantize_float(ref, kind), "requantized"
        else:
            data, kind = _float_array(ref)
            how = "float"
    exact, diff = _exactness(data, kind, how, ref)
    rep = TensorReport(f"{name}.weight", f"{gbase}.weight", kind, exact, diff, how)
    if strict and not exact:
        why = {"codes": "its scales (or Q4_1 offsets) are not float16", "float": "",
               "requantized": f"no GGUF type has its grid ({spec.name or spec.dtype.name}, {spec.granularity})"}[how]
        raise ValueError(f"export_gguf(strict=True): {name}.weight is not lossless as {kind} ({why}; max abs "
                         f"difference {diff:.3g}); quantize with float16 scales and a GGUF grid, or pass "
                         f"strict=False to accept the difference")
    return data, kind, rep


def _expert_mats(m: nn.Module) -> tuple[dict, Optional[dict], Any]:
    """``({gguf role: float32 [E, out, in]}, {gguf role: [per-expert WeightParts]} or None, spec)`` of a fused
    experts module: gate = the first half of each expert's ``gate_up_proj`` rows, up = the second, down."""
    gate, up, down = G.EXPERT_TENSORS
    if not isinstance(m, QuantExperts) or "weight" not in m.specs:
        gu = m.gate_up_proj.detach().float().cpu().numpy()
        i = gu.shape[1] // 2
        return {gate: gu[:, :i], up: gu[:, i:], down: m.down_proj.detach().float().cpu().numpy()}, None, None
    spec = m.specs["weight"]
    mats: dict = {gate: [], up: [], down: []}
    parts: dict = {gate: [], up: [], down: []}

    def np_(t):
        return None if t is None else t.detach().cpu().float().numpy()
    for proj, roles in (("gate_up_proj", (gate, up)), ("down_proj", (down,))):
        for q in m.expert_qtensors(proj):
            ref = np_(qcore.dequantize(q))
            codes = q.codes.detach().cpu().numpy()
            out = codes.shape[0]
            half = out // len(roles)
            for k, role in enumerate(roles):
                a, b = k * half, (k + 1) * half

                def cut(x):
                    return None if x is None else (x[a:b] if x.ndim and x.shape[0] == out else x)
                mats[role].append(ref[a:b])
                parts[role].append(WeightParts(codes=codes[a:b], scales=cut(np_(q.scales)),
                                               zero_points=cut(np_(q.zero_points))))
    return {r: np.stack(v) for r, v in mats.items()}, parts, spec


def _encode_experts(name: str, blk: str, m: nn.Module, strict: bool) -> tuple[list, list]:
    """The three 3-D expert tensors of the experts module ``name`` (``[(gguf name, data, type)]``) and their
    reports: code for code where the grid is a GGUF type (every expert the same type), else requantized with
    ggml's reference quantizer, else float (see ``_encode_quantized``)."""
    if isinstance(m, QuantExperts) and "weight" in m.specs and m.weight_spec("down_proj").gguf:
        return _encode_gguf_experts(name, blk, m)
    mats, parts, spec = _expert_mats(m)
    tensors, reports = [], []
    for role in G.EXPERT_TENSORS:
        ref = mats[role]
        e_, o, i = ref.shape
        gname = f"{blk}.{role}.weight"
        if parts is None:  # float experts
            wdt = m.gate_up_proj.dtype
            if wdt == torch.float16:
                data, kind = ref.astype(np.float16), "F16"
            else:
                data, kind = np.ascontiguousarray(ref, np.float32), "F32"
            tensors.append((gname, data, kind))
            continue
        ps = parts[role]
        kind = G.gguf_type(spec, (o, i))
        if kind == "Q4_1" and all(G.q4_0_holds(p, spec, (o, i)) for p in ps):
            kind = "Q4_0"
        if kind is not None:
            data, how = np.stack([G.encode(p, spec, kind=kind) for p in ps]), "codes"
        else:
            kind = _nearest_type(spec) if i % G.BLOCK == 0 else None
            if kind is not None:
                data, how = G.quantize_float(ref.reshape(e_ * o, i), kind).reshape(e_, o, -1), "requantized"
            else:
                data, kind = _float_array(ref)
                how = "float"
        exact, diff = _exactness(data.reshape(e_ * o, -1), kind, how, ref.reshape(e_ * o, i))
        rep = TensorReport(f"{name}.{'down_proj' if role == 'ffn_down_exps' else 'gate_up_proj'}", gname, kind,
                           exact, diff, how)
        if strict and not exact:
            raise ValueError(f"export_gguf(strict=True): {name} ({gname}) is not lossless as {kind} (max abs "
                             f"difference {diff:.3g}); quantize the experts with float16 scales and a GGUF grid, or "
                             f"pass strict=False to accept the difference")
        tensors.append((gname, np.ascontiguousarray(data), kind))
        reports.append(rep)
    return tensors, reports


def _encode_gguf_experts(name: str, blk: str, m: nn.Module) -> tuple[list, list]:
    """``_encode_experts`` of experts with a GGUF weight spec: their own type, the stored block bytes as they are
    (``QuantExperts.gguf_blocks``; gate and up are the first and second half of each expert's ``gate_up_proj``
    rows, whose blocks run along the row), checked to reproduce the module's weights."""
    gate, up, down = G.EXPERT_TENSORS
    tensors, reports = [], []
    for proj, roles in (("gate_up_proj", (gate, up)), ("down_proj", (down,))):
        kind = G.GGUF_KIND_OF[m.weight_spec(proj).gguf]  # down_proj may have its own (llama.cpp's mixes)
        data = m.gguf_blocks(proj)
        e_, o, i = m.expert_shape(proj)
        ref = m.effective_proj(proj)
        vals = torch.from_numpy(G.dequantize(data.reshape(e_ * o, -1), kind, (e_ * o, i)).reshape(e_, o, i))
        if not torch.equal(vals.to(ref.dtype).float(), ref.float().cpu()):
            raise RuntimeError(f"export_gguf: {name}.{proj}: the {kind} blocks do not reproduce the experts' weights "
                               f"(a qcore bug; please report it)")
        half = o // len(roles)
        for k, role in enumerate(roles):
            tensors.append((f"{blk}.{role}.weight", np.ascontiguousarray(data[:, k * half:(k + 1) * half]), kind))
            reports.append(TensorReport(f"{name}.{proj}", f"{blk}.{role}.weight", kind, True, 0.0, "codes"))
    return tensors, reports


def _unit_problem(name: str, roles: list, drop_activations: bool) -> Optional[str]:
    """Why a module quantizing ``roles`` cannot be written to GGUF (None: it can; activations dropped if asked)."""
    acts = [r for r in roles if r != "weight"]
    if "weight" not in roles:
        return f"{name!r} quantizes {acts} but not its weight; GGUF has no activation quantization"
    if "bias" in acts:
        return f"{name!r} has a quantized bias; GGUF holds biases as float (F32) only"
    if acts and not drop_activations:
        return (f"{name!r} quantizes its {acts[0]} activations, which GGUF cannot hold (llama.cpp quantizes "
                f"activations its own way); pass drop_activations=True to write the weights only")
    return None


def check_gguf(model: nn.Module, config: Optional[ModelConfig] = None, *, drop_activations: bool = False,
               plans=None) -> None:
    """Before any work: ValueError if ``export_gguf`` would refuse ``model`` quantized with ``config`` (default
    ``model.qcore_config``) for reasons the architecture and the config already decide (``qcore quantize
    --export gguf`` calls it before the baseline evaluation; ``export_gguf`` itself too)."""
    config = config if config is not None else getattr(model, "qcore_config", None)
    refuse_low_rank(model, config, "export_gguf")  # quantized Conv1D (GPT-2) is written as the Linear it is
    try:
        fam, arch, _, _ = gguf_arch(model)
    except TypeError as e:
        raise ValueError(str(e)) from None
    if not isinstance(config, ModelConfig):
        return  # export_gguf reads the modules themselves
    if will_rotate_online(model, config):
        raise ValueError("export_gguf: the model carries online rotations; llama.cpp's graphs cannot apply them")
    units = export_units(model, config, plans=plans)
    for u in units:
        why = _unit_problem(u.name, [r for r in ("weight", "input", "output", "bias")
                                     if getattr(u.config, r) is not None], drop_activations)
        if why:
            raise ValueError(f"export_gguf: {why}")
        if u.name == fam.lm_head and not arch.output and not _tied_same_config(model, config, u):
            raise ValueError(_head_refusal(u.name, arch))


def _tied_same_config(model: nn.Module, config: ModelConfig, head_unit) -> bool:
    """The head is tied to the token embedding and the config gives the embedding the head's weight config."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    emb = model.get_input_embeddings()
    name = next((n for n, m in model.named_modules() if m is emb), None)
    u = next((x for x in export_units(model, config) if x.name == name), None)
    return u is not None and u.config.weight == head_unit.config.weight


def _check_model(model: nn.Module, drop_activations: bool) -> tuple:
    refuse_low_rank(model, None, "export_gguf")
    fam, arch, meta, d = gguf_arch(model)
    rot = input_rotations(model)
    if rot:
        raise ValueError(f"export_gguf: the model carries online rotations (e.g. before {next(iter(rot))!r}); "
                         f"llama.cpp's graphs cannot apply them")
    dropped = []
    for n, m in model.named_modules():
        if not isinstance(m, QuantModule):
            continue
        why = _unit_problem(n, list(m.specs), drop_activations)
        if why:
            raise ValueError(f"export_gguf: {why}")
        dropped += [f"{n} ({r})" for r in m.specs if r != "weight"]
    return arch, meta, d, dropped


def _tokenizer_fields(tokenizer: Any, vocab_size: int, pre: str) -> list[tuple[str, Any, Any, Any]]:
    """``[(key, value, GGUFValueType, sub type)]`` of the tokenizer metadata."""
    import gguf
    V = gguf.GGUFValueType
    if isinstance(tokenizer, (str, os.PathLike)):
        check_file(tokenizer)
        r = gguf.GGUFReader(tokenizer)
        out = []
        for k, f in r.fields.items():
            if not k.startswith("tokenizer."):
                continue
            sub = f.types[1] if f.types[0] == V.ARRAY else None
            out.append((k, f.contents(), f.types[0], sub))
        toks = [v for k, v, *_ in out if k == "tokenizer.ggml.tokens"]
        if not toks or len(toks[0]) != vocab_size:
            raise ValueError(f"export_gguf: the tokenizer of {str(tokenizer)!r} has "
                             f"{len(toks[0]) if toks else 0} tokens, the model's vocab_size is {vocab_size}")
        return out
    spm = sentencepiece_fields_of(tokenizer, vocab_size)
    if spm is not None:  # SentencePiece (Llama-2, Mistral, Gemma, Phi-3): llama.cpp's "llama" tokenizer
        kinds = {"str": (V.STRING, None), "u32": (V.UINT32, None), "bool": (V.BOOL, None),
                 "[str]": (V.ARRAY, V.STRING), "[f32]": (V.ARRAY, V.FLOAT32), "[i32]": (V.ARRAY, V.INT32)}
        return [(k, v, *kinds[kind]) for k, v, kind in spm]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"export_gguf: tokenizer must be a transformers fast tokenizer or the path of a GGUF file, "
                        f"got {type(tokenizer).__name__}")
    spec = json.loads(backend.to_str())
    if spec.get("model", {}).get("type") != "BPE":
        raise ValueError(f"export_gguf: only BPE tokenizers are converted (this one is "
                         f"{spec.get('model', {}).get('type')!r}); give the path of a GGUF file that has it instead "
                         f"(Python: tokenizer=; qcore quantize --export gguf copies the tokenizer of a .gguf --model)")
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"export_gguf: the tokenizer has ids up to {max(vocab.values())}, the model's vocab_size "
                         f"is {vocab_size}")
    special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        else:
            tokens.append(t)
            types.append(int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.USER_DEFINED if t in added
                             else gguf.TokenType.NORMAL))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    out = [("tokenizer.ggml.model", "gpt2", V.STRING, None), ("tokenizer.ggml.pre", pre, V.STRING, None),
           ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
           ("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)]
    if merges:  # GGUF has no empty arrays (llama.cpp's BPE loader needs merges; transformers' does not)
        out.append(("tokenizer.ggml.merges", merges, V.ARRAY, V.STRING))
    for key, attr in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unknown", "unk_token_id"),
                      ("padding", "pad_token_id")):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            out.append((f"tokenizer.ggml.{key}_token_id", int(v), V.UINT32, None))
    out.append(("tokenizer.ggml.add_bos_token", bool(getattr(tokenizer, "add_bos_token", False)), V.BOOL, None))
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, str):
        out.append(("tokenizer.chat_template", tmpl, V.STRING, None))
    return out


def _head_refusal(name: str, arch) -> str:
    return (f"export_gguf: {name}: llama.cpp's {arch.name!r} graph computes the head with token_embd (the head "
            f"must be tied to the embedding and not quantized apart from it; exclude {name!r})")


def _check_bias(name: str, role: str, arch) -> None:
    if role not in arch.biases and not (arch.norm == "layernorm" and role in G.NORM_TENSORS):
        raise ValueError(f"export_gguf: {name}: llama.cpp's {arch.name!r} graph has no {role} bias")


def _plan(model: nn.Module, cfg: dict, arch, strict: bool) -> tuple[list, list[TensorReport]]:
    """``[(gguf name, array, type name)]`` in state-dict order, and the reports of the quantized weights."""
    n_head = int(model.config.num_attention_heads)  # the config's attribute (GPT-2's n_head: attribute_map)
    n_kv = int(getattr(model.config, "num_key_value_heads", None) or n_head)
    per_head_qkv = gguf_family(model)[0].qkv_layout == "per_head"
    names = gguf_names(model)
    experts = expert_names(model)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantModule)}
    owned = {}
    for n, m in mods.items():
        for k in m.state_dict():
            if "." not in k and k != "bias":
                owned[f"{n}.{k}"] = n
    tensors, reports, done = [], [], set()
    sd = model.state_dict(keep_vars=True)
    emb_name = next(k for k, v in names.items() if v == "token_embd")
    emb = sd.get(f"{emb_name}.weight")
    for k, t in sd.items():
        mod, _, leaf = k.rpartition(".")
        if mod in experts:
            if mod not in done:
                done.add(mod)
                ts, rs = _encode_experts(mod, experts[mod], model.get_submodule(mod), strict)
                tensors += ts
                reports += rs
            continue
        base = names.get(mod)
        if base is None or leaf not in ("weight", "bias") and k not in owned:
            raise ValueError(f"export_gguf: the model's tensor {k!r} has no place in llama.cpp's {arch.name!r} "
                             f"layout")
        role = base.rpartition(".")[2]
        if leaf == "bias" and mod in mods:
            continue  # written after the module's weight (a frozen module lists its bias first)
        if k in owned:
            if mod in done:  # frozen modules hold weight_packed / weight_scale / ... instead of weight
                continue
            done.add(mod)
            if base == "output" and _shares_weight(mods[mod], mods.get(emb_name),
                                                   bool(cfg.get("tie_word_embeddings"))):
                continue  # tied to the quantized token embedding: llama.cpp computes the head with token_embd
            if base == "output" and not arch.output:
                raise ValueError(_head_refusal(mod, arch))
            data, kind, rep = _encode_quantized(mod, base, mods[mod], strict)
            reports.append(rep)
            name = rep.gguf_name
        else:
            name = f"{base}.{leaf}"
            if leaf == "bias":
                _check_bias(k, role, arch)
            if name == "output.weight" and emb is not None and t is emb and not arch.output_required:
                continue  # tied output head: llama.cpp uses token_embd
            if name == "output.weight" and not arch.output:
                raise ValueError(_head_refusal(mod, arch))
            lw = linear_weight(model.get_submodule(mod)) if leaf == "weight" else None
            a = (t if lw is None else lw).detach().float().cpu().numpy()  # Conv1D's [in, out]: as a Linear's
            if role in G.NORM_TENSORS and arch.norm_offset:
                a = a + np.float32(arch.norm_offset)  # transformers computes x * (1 + w) in float32: the same value
            if a.ndim == 1 or t.dtype != torch.float16 or role in ("ffn_gate_inp", "ffn_gate_inp_shexp"):
                data, kind = np.ascontiguousarray(a, np.float32), "F32"
            else:
                data, kind = a.astype(np.float16), "F16"
        if arch.permute_qk and role in ("attn_q", "attn_k"):
            data = G.permute_qk(data, n_head if role == "attn_q" else n_kv)
        if per_head_qkv and role == "attn_qkv":  # rows (weight, bias, blocks) per head -> [q | k | v]
            data = G.qkv_heads_to_gguf(data, n_head)
        tensors.append((name, np.ascontiguousarray(data), kind))
        bias = getattr(mods[mod], "bias", None) if k in owned else None
        if bias is not None:
            _check_bias(f"{mod}.bias", role, arch)
            b = bias.detach().float().cpu().numpy()
            tensors.append((f"{base}.bias", np.ascontiguousarray(
                G.qkv_heads_to_gguf(b, n_head) if per_head_qkv and role == "attn_qkv" else b, np.float32), "F32"))
    if set(mods) - done:
        raise ValueError(f"export_gguf: quantized modules without tensors in the state dict: "
                         f"{sorted(set(mods) - done)[:3]}")
    return tensors, reports


def export_gguf(model: nn.Module, path: Union[str, os.PathLike], *, tokenizer: Any = None,
                tokenizer_pre: Optional[str] = None, strict: bool = False, drop_activations: bool = False,
                overwrite: bool = False, name: Optional[str] = None,
                metadata: Union[str, os.PathLike, None] = None) -> GGUFExportInfo:
    """Write ``model`` (a transformers Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma2, Gemma3, Phi-3, Mixtral,
    Qwen2-MoE, Qwen3-MoE, GPT-2 or GPT-NeoX quantized with
    ``quantize_model``, frozen or not) to the GGUF file ``path``. See the module docstring for what is written
    and when it is lossless.

    tokenizer: a transformers BPE fast tokenizer (byte-level, or SentencePiece's with byte fallback), a
        SentencePiece tokenizer (``sp_model``), or the path of a GGUF file to copy ``tokenizer.*`` from
        (llama.cpp needs a tokenizer; transformers' GGUF model loader does not).
    tokenizer_pre: llama.cpp's pre-tokenizer name for a converted tokenizer (``"default"``, ``"smollm"``,
        ``"llama-bpe"``, ``"gpt-2"``, ...); None: the architecture's (``formats.gguf.Arch.tokenizer_pre``:
        ``"gpt-2"`` for GPT-2 and GPT-NeoX, else ``"default"``).
    strict: refuse (ValueError naming the tensor) any quantized weight that is not lossless.
    drop_activations: write a model with activation quantization, without it (else ValueError).
    overwrite: replace an existing file (else FileExistsError, before any work).
    name: ``general.name`` (default: the model's hub id, else ``"qcore model"``).
    metadata: the path of a GGUF file (the one the model was loaded from) whose metadata the written file carries
        too: every key of it the writer does not set itself from the model (``general.license``,
        ``general.languages``, ``general.file_type``, ``{arch}.*`` keys qcore does not write, ...; its
        ``tokenizer.*`` keys when the written file gets no tokenizer of its own), copied as they are, after the
        writer's own; ``general.alignment`` is the writer's. GGUF -> GGUF ``convert`` passes its source. A key
        gguf-py's writer cannot write (an empty array) is not carried: ``GGUFExportInfo.not_carried`` names it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for k, v in (("strict", strict), ("drop_activations", drop_activations), ("overwrite", overwrite)):
        if not isinstance(v, bool):
            raise TypeError(f"{k} must be a bool, got {v!r}")
    if tokenizer_pre is not None and (not isinstance(tokenizer_pre, str) or not tokenizer_pre):
        raise TypeError(f"tokenizer_pre must be a non-empty str or None, got {tokenizer_pre!r}")
    if metadata is not None and not isinstance(metadata, (str, os.PathLike)):
        raise TypeError(f"metadata must be the path of a GGUF file or None, got {type(metadata).__name__}")
    path = pathlib.Path(path)
    if path.suffix != ".gguf":
        raise ValueError(f"path must name a .gguf file, got {str(path)!r}")
    check_file_destination(path, overwrite, model_sources(model) + [str(s) for s in (tokenizer, metadata)
                                                                     if isinstance(s, (str, os.PathLike))])
    carried = None if metadata is None else G.read_header(metadata)  # the file's structure checked first
    if not any(isinstance(m, QuantModule) for m in model.modules()):
        raise ValueError("export_gguf: the model has no qcore quantized modules; run quantize_model first")
    arch, meta, cfg, dropped = _check_model(model, drop_activations)
    tok = None if tokenizer is None else _tokenizer_fields(tokenizer, int(cfg["vocab_size"]),
                                                           tokenizer_pre or arch.tokenizer_pre)
    tensors, reports = _plan(model, cfg, arch, strict)

    import gguf
    V = gguf.GGUFValueType
    kinds = {"u32": V.UINT32, "f32": V.FLOAT32, "str": V.STRING, "bool": V.BOOL}
    with staged_file(path, recheck=lambda: check_file_destination(path, overwrite, ())) as tmp:
        w = gguf.GGUFWriter(tmp, arch=arch.name)
        w.add_name(name or _published_name(cfg))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for k, (v, kind) in meta.items():
            w.add_key_value(k, v, kinds[kind])
        for k, v, vt, sub in tok or []:
            w.add_key_value(k, v, vt, sub_type=sub)
        not_carried = _carry_metadata(w, carried, {"general.architecture", "general.name",
                                                    "general.quantization_version", *meta, *(t[0] for t in tok or [])})
        for gname, data, kind in tensors:
            if kind in G.BLOCK_KINDS:
                w.add_tensor(gname, data, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
            else:
                w.add_tensor(gname, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    return GGUFExportInfo(str(path), path.stat().st_size, {n: k for n, _, k in tensors}, tuple(reports),
                          tuple(dropped), not_carried)


def _carry_metadata(w, carried: Optional[G.GGUFHeader], written: set) -> tuple:
    """Add to the writer ``w`` every metadata key of ``carried`` (a checked GGUF header) that is not in
    ``written`` (the writer's own keys): as stored, in the file's order; ``tokenizer.*`` only when the writer
    writes no tokenizer key of its own (one tokenizer, never a mix of two); never ``general.alignment`` (the
    writer's layout). Returns the keys gguf-py's writer cannot write (empty arrays)."""
    if carried is None:
        return ()
    import gguf
    V = gguf.GGUFValueType
    own_tokenizer = any(k.startswith("tokenizer.") for k in written)
    skipped = []
    for k, f in carried.fields.items():
        if k in written or k == "general.alignment" or (own_tokenizer and k.startswith("tokenizer.")):
            continue
        if f.type == 9:
            if len(f.value) == 0:
                skipped.append(k)
                continue
            value = list(f.value) if isinstance(f.value, tuple) else f.value.tolist()
            w.add_key_value(k, value, V.ARRAY, sub_type=V(f.item_type))
        else:
            w.add_key_value(k, f.value, V(f.type))
    return tuple(skipped)


GGUF_FILE = "model.gguf"


def _published_name(cfg: dict) -> str:
    """``general.name`` when none is given: the model's hub id, never a local path (an export is the same bytes
    wherever the model was loaded from)."""
    n = str(cfg.get("_name_or_path") or "")
    if not n or os.path.isabs(n) or os.path.exists(n) or n.startswith(("." + os.sep, ".." + os.sep, "~")):
        return "qcore model"
    return n


def export_gguf_dir(model: nn.Module, directory: Union[str, os.PathLike], *, overwrite: bool = False,
                    **kwargs: Any) -> GGUFExportInfo:
    """``export_gguf`` into ``directory/model.gguf``, the directory written atomically like ``export_hf``'s (a
    staging sibling renamed into place; an existing non-empty directory needs ``overwrite=True``). ``kwargs``
    go to ``export_gguf``."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    directory = pathlib.Path(directory)
    tok = kwargs.get("tokenizer")
    sources = model_sources(model) + ([str(tok)] if isinstance(tok, (str, os.PathLike)) else [])
    check_destination(directory, overwrite, sources)
    with staged_dir(directory, recheck=lambda: check_destination(directory, overwrite, sources)) as tmp:
        info = export_gguf(model, tmp / GGUF_FILE, **kwargs)
    path = directory / GGUF_FILE
    return dataclasses.replace(info, path=str(path), bytes_on_disk=path.stat().st_size)


# ---------------------------------------------------------------------------------------------------------------
# import (formerly import_gguf.py)
# ---------------------------------------------------------------------------------------------------------------

_FLOAT_TYPES = ("F32", "F16", "BF16")
_HELD = ", ".join(sorted(G.BLOCK_KINDS))  # the block types from_gguf imports as qcore codes
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HOW = ("codes", "dequantized", "float")


@dataclass(frozen=True)
class ImportedTensor:
    """One tensor of the GGUF file and what ``from_gguf`` made of it.

    how: ``"codes"`` (a frozen qcore module holding the blocks' codes and scales), ``"dequantized"`` (a block
        type stored as a float weight: ggml's dequantization, in the model dtype) or ``"float"`` (F32/F16/BF16).
    spec: the qcore spec of ``"codes"`` tensors (else None).
    exact: the model holds the tensor's values exactly: for ``"codes"`` always (checked: ``qcore.dequantize``
        equals ggml's dequantization); for float weights when ``dtype`` represents every value.
    max_abs_diff: largest distance between the model's values and the file's (0 when exact).
    reason: why a block-quantized tensor is not ``"codes"`` ("" otherwise).
    """

    name: str
    gguf_name: str
    gguf_type: str
    how: str
    spec: Optional[QuantSpec]
    exact: bool
    max_abs_diff: float
    reason: str = ""


@dataclass(frozen=True)
class GGUFImportReport:
    """What ``from_gguf`` imported, tensor by tensor (``tensors``, in the file's order)."""

    path: str
    tensors: tuple

    @property
    def codes(self) -> tuple:
        """Tensors imported as frozen qcore modules."""
        return tuple(r for r in self.tensors if r.how == "codes")

    @property
    def dequantized(self) -> tuple:
        """Block-quantized tensors imported as float weights (no exact qcore grid)."""
        return tuple(r for r in self.tensors if r.how == "dequantized")

    @property
    def inexact(self) -> tuple:
        return tuple(r for r in self.tensors if not r.exact)

    @property
    def exact(self) -> bool:
        """Every tensor's values are held exactly (a quantized tensor may still be a float weight)."""
        return not self.inexact

    def summary(self) -> str:
        c = collections.Counter((r.gguf_type, r.how) for r in self.tensors)
        return ", ".join(f"{n} {t} -> {h}" for (t, h), n in sorted(c.items()))


# ---------------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------------


def _shape(t) -> tuple:
    return tuple(int(x) for x in reversed(list(t.shape)))  # gguf-py lists ggml's order: [in, out]


def _float_values(data: np.ndarray, kind: str, shape: tuple, name: str) -> np.ndarray:
    raw = np.ascontiguousarray(data)
    if kind == "F32":
        a = raw.view(np.float32)
    elif kind == "F16":
        a = raw.view(np.float16)
    else:  # BF16: the upper half of float32
        a = (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    if a.size != int(np.prod(shape)):
        raise CorruptCheckpointError(f"{name}: {kind} data of {a.size} values, expected {int(np.prod(shape))} "
                                     f"for shape {list(shape)}")
    return a.reshape(shape)


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, bool, float]:
    """``a`` (float16 / float32) as a ``dtype`` tensor, whether that holds it exactly, the max abs difference."""
    t = torch.from_numpy(np.array(a, copy=True)).to(dtype)
    back = t.float().numpy()
    ref = a.astype(np.float32)
    exact = bool(np.array_equal(back, ref))
    diff = 0.0 if exact else float(np.max(np.abs(back.astype(np.float64) - ref.astype(np.float64)), initial=0.0))
    return t, exact, diff


def _check_args(path, dtype, strict, dequantize_other) -> pathlib.Path:
    for k, v in (("strict", strict), ("dequantize_other", dequantize_other)):
        if not isinstance(v, bool):
            raise TypeError(f"{k} must be a bool, got {v!r}")
    if strict and dequantize_other:
        raise ValueError("strict=True refuses every tensor that is not imported as qcore codes, "
                         "dequantize_other=True asks to dequantize some: pass one of them")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)} or None (float32), got {dtype!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike naming a .gguf file, got {type(path).__name__}")
    p = pathlib.Path(path)
    if p.suffix != ".gguf":
        raise ValueError(f"path must name a .gguf file, got {str(p)!r}")
    if not p.is_file():
        raise FileNotFoundError(f"{str(p)!r} is not a file")
    return p


def _plan_import_gguf(spans, model: nn.Module, cfg, names: dict, strict: bool, dequantize_other: bool,
                      reader: str = "qcore") -> tuple[list, dict]:
    """The tensor match of the loading gate (``check_gguf_file``): per tensor ``(span, hf name, module name, kind,
    shape)``, and per fused experts module its three tensors ``{module name: {G.EXPERT_TENSORS role: span}}``
    (``spans``: the file's ``G.TensorSpan``s), every tensor of the file in its place in ``model`` (a skeleton)
    with that parameter's shape and a type its reader reads, every parameter of ``model`` given one; before any
    data is read. ``reader="transformers"``: the types gguf-py dequantizes (``G.WEIGHT_TYPES``), whatever the
    qcore grids."""
    params = dict(model.named_parameters())
    back = {v: k for k, v in names.items()}
    exp_back = {v: k for k, v in expert_names(model).items()}
    out, seen, experts = [], set(), {}
    for t in spans:
        kind = t.type_name
        if t.type_id not in G.WEIGHT_TYPES:
            raise ValueError(f"from_gguf: tensor {t.name!r} is {kind}, not a type model weights are stored in "
                             f"(F32 / F16 / BF16 or a block type gguf-py dequantizes)")
        base, _, leaf = t.name.rpartition(".")
        blk, _, role = base.rpartition(".")
        if blk in exp_back and role in G.EXPERT_TENSORS and leaf == "weight":
            mod_name = exp_back[blk]
            if role in experts.setdefault(mod_name, {}):
                raise CorruptCheckpointError(f"from_gguf: tensor {t.name!r} appears twice in the file")
            shape = t.shape
            gu, dn = params[f"{mod_name}.gate_up_proj"].shape, params[f"{mod_name}.down_proj"].shape
            want = tuple(dn) if role == "ffn_down_exps" else (gu[0], gu[1] // 2, gu[2])
            if shape != want:
                raise CorruptCheckpointError(f"from_gguf: tensor {t.name!r} has shape {list(shape)}; the model's "
                                             f"experts {mod_name} need {list(want)}")
            if reader == "qcore" and kind not in _FLOAT_TYPES and kind not in G.BLOCK_KINDS and (
                    strict or not dequantize_other):
                raise ValueError(f"from_gguf: tensor {t.name!r} is {kind}, which no qcore grid of fused experts "
                                 f"holds; qcore imports experts in {', '.join(sorted(G.BLOCK_KINDS))} and F32/F16/BF16 "
                                 f"(from Python, from_gguf(..., "
                                 f"dequantize_other=True) imports it as its float32 dequantization)")
            experts[mod_name][role] = t
            if len(experts[mod_name]) == len(G.EXPERT_TENSORS):
                seen.update({f"{mod_name}.gate_up_proj", f"{mod_name}.down_proj"})
            continue
        hf = f"{back[base]}.{leaf}" if base in back else None
        if hf is None:
            per_layer = sorted({v.split(".", 2)[2] for v in names.values() if v.startswith("blk.")}
                               | (set(G.EXPERT_TENSORS) if exp_back else set()))
            raise ValueError(f"from_gguf: tensor {t.name!r} has no place in transformers' {cfg.model_type} model "
                             f"(qcore imports its layout: token_embd, output, output_norm, blk.N.{per_layer})")
        if hf in seen:
            raise CorruptCheckpointError(f"from_gguf: tensor {t.name!r} appears twice in the file")
        seen.add(hf)
        if hf not in params:
            raise ValueError(f"from_gguf: tensor {t.name!r} ({hf}) is not a parameter of the model its metadata "
                             f"describes (e.g. a bias the config does not have)")
        shape = t.shape
        want = tuple(params[hf].shape)
        if _conv1d_weight(model, hf):
            want = want[::-1]  # Conv1D's [in, out] parameter: the GGUF tensor is the Linear's [out, in]
        if shape != want and want == (1, *shape) and kind in _FLOAT_TYPES:
            shape = want  # llama.cpp's quantizer writes a float [1, n] matrix (qwen2moe's ffn_gate_inp_shexp) 1-D
        if shape != want:
            raise CorruptCheckpointError(f"from_gguf: tensor {t.name!r} has shape {list(shape)}; the model's "
                                         f"{hf} is {list(want)}")
        mod_name, _, leaf = hf.rpartition(".")
        if reader != "qcore":
            pass
        elif kind not in _FLOAT_TYPES and kind not in G.BLOCK_KINDS:
            if strict or not dequantize_other:
                raise ValueError(f"from_gguf: tensor {t.name!r} is {kind}, which no qcore grid holds; qcore imports "
                                 f"{_HELD} and F32/F16/BF16 (from Python, from_gguf(..., "
                                 f"dequantize_other=True) imports it as its float32 dequantization; qcore convert "
                                 f"has no such option)")
        elif kind in G.BLOCK_KINDS and (leaf != "weight" or len(shape) != 2):
            raise CorruptCheckpointError(f"from_gguf: tensor {t.name!r} ({hf}) is {kind}; qcore imports block types "
                                         f"for 2-D weights only")
        out.append((t, hf, mod_name, kind, shape))
    lacking = [m for m, ts in experts.items() if len(ts) != len(G.EXPERT_TENSORS)]
    missing = [n for n in params if n not in seen and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if lacking:
        m = lacking[0]
        gone = [f"{expert_names(model)[m]}.{r}.weight" for r in G.EXPERT_TENSORS if r not in experts[m]]
        raise CorruptCheckpointError(f"from_gguf: the file has no tensor {gone[0]!r} (experts {m})")
    if missing:
        base, _, leaf = missing[0].rpartition(".")
        raise CorruptCheckpointError(f"from_gguf: the file has no tensor for {missing[:5]} "
                                     f"({names.get(base, '?')}.{leaf} ...)")
    return out, experts


def _conv1d_weight(model: nn.Module, hf: str) -> bool:
    """Whether ``hf`` is the weight of a float transformers ``Conv1D`` (GPT-2): stored ``[in, out]``, the transpose
    of the GGUF tensor (a Linear's ``[out, in]``)."""
    mod_name, _, leaf = hf.rpartition(".")
    return leaf == "weight" and weight_layout(model.get_submodule(mod_name)) == IN_OUT


def _set_param(model: nn.Module, hf: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = hf.rpartition(".")
    m = model.get_submodule(mod_name)
    if _conv1d_weight(model, hf):
        value = value.t().contiguous()  # the GGUF tensor is the Linear's [out, in]
    m._parameters[leaf] = nn.Parameter(value, requires_grad=value.is_floating_point())


def model_config_of_specs(model: nn.Module, specs: dict[str, QuantSpec]) -> Optional[ModelConfig]:
    """The ModelConfig whose plan gives exactly the model's quantized modules: the most common spec as the
    global layer, the others (and every float Linear, and a quantized embedding) by name."""
    if not specs:
        return None
    linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantExperts)) or is_fused_experts(m)]
    counts = collections.Counter(specs[n] for n in linears if n in specs)
    common = counts.most_common(1)[0][0] if counts else None
    by_name: dict[str, Optional[LayerConfig]] = {}
    for n in linears:
        s = specs.get(n)
        if s != common:
            by_name[n] = None if s is None else LayerConfig(weight=TensorConfig(s))
    for n, s in specs.items():  # embeddings: quantized only by name
        if n not in linears:
            by_name[n] = LayerConfig(weight=TensorConfig(s))
    layer = LayerConfig() if common is None else LayerConfig(weight=TensorConfig(common))
    return ModelConfig(layer, by_name=by_name, exclude=())


def _family_of_file(info: G.GGUFModel):
    """The family record qcore reads a checked GGUF model file as (its ``gguf_arch``; with experts or not)."""
    fam = next((f for f in FAMILIES if f.gguf_arch == info.arch and family_problem(f) is None
                and (f.experts is not None) == info.experts), None)
    if fam is None:
        have = sorted({f.gguf_arch for f in FAMILIES if f.gguf_arch and family_problem(f) is None})
        raise ValueError(f"from_gguf: general.architecture is {info.arch!r}"
                         f"{' with experts' if info.experts else ''}; qcore imports {have}")
    return fam


def _skeleton(info: G.GGUFModel, dtype: torch.dtype, *, meta: bool = False):
    """The transformers config and an empty model (parameters on meta) of the checked file ``info``, and its GGUF
    name map. ``meta``: buffers on meta too (the loading gate's skeleton: nothing allocated at all)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    fam = _family_of_file(info)
    kw = dict(info.config)
    names = {t.name for t in info.header.tensors}
    kw["tie_word_embeddings"] = "output.weight" not in names
    for key, attr in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        v = info.header.get(f"tokenizer.ggml.{key}_token_id")
        kw[attr] = None if v is None else int(v)  # not the config class's defaults (Phi-3's 32000)
    cfg = AutoConfig.for_model(fam.model_type, **kw)
    with torch.device("meta") if meta else init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)  # parameters on meta, buffers (rotary) computed
    return cfg, model, gguf_names(model)


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """A GGUF model file that passed the loading gate (``check_gguf_file``): what the header says (``model``:
    ``formats.gguf.GGUFModel``), the family record qcore reads it as, the transformers config, and the tensor
    match (``plan``: per tensor ``(span, hf name, module name, kind, shape)``; ``experts``: per fused experts
    module its three tensors)."""

    path: pathlib.Path
    model: G.GGUFModel
    family: Any
    config: Any
    plan: tuple
    experts: dict


def check_gguf_file(path: Union[str, os.PathLike], *, reader: str = "qcore", strict: bool = False,
                    dequantize_other: bool = False) -> GGUFFile:
    """The loading gate of a GGUF model file, whatever reads it afterwards (``from_gguf``, ``qcore convert``,
    transformers' GGUF reader in ``qcore quantize / eval / imatrix --model X.gguf``): before any allocation that
    a number of the header decides,

    1. ``formats.gguf.check_model_file``: the structure (counts, types, UTF-8, keys and names given once, data
       regions inside the file, aligned, not overlapping) and the hyperparameters (of their types, in range,
       consistent with the tensors' shapes, which the file's size bounds);
    2. the model it must build: the family record of ``general.architecture`` (``families.py``; an architecture
       no record describes is refused, even one transformers reads) and the skeleton of its transformers model,
       built on the meta device (nothing allocated); every tensor of the file in its place (``gguf_names``, the
       same names ``export_gguf`` writes), with that parameter's shape and a type the reader reads, and a tensor
       for every parameter (a missing one would be randomly initialised).

    reader: ``"qcore"`` (``from_gguf``: ``strict`` / ``dequantize_other`` decide which block types are refused)
        or ``"transformers"`` (every type gguf-py dequantizes).
    ValueError (``CorruptCheckpointError`` for a damaged file) of one line naming the file and the key or tensor.
    """
    if reader not in ("qcore", "transformers"):
        raise ValueError(f"reader must be 'qcore' or 'transformers', got {reader!r}")
    p = pathlib.Path(path)
    try:
        info = G.check_model_file(p)
        cfg, model, names = _skeleton(info, torch.float32, meta=True)
        plan, experts = _plan_import_gguf(info.header.tensors, model, cfg, names, strict, dequantize_other, reader)
    except ValueError as e:  # every refusal names the file (and not from_gguf when transformers reads it)
        msg = str(e)
        if reader != "qcore" and msg.startswith("from_gguf: "):
            msg = msg[len("from_gguf: "):]
        msg = msg if str(p) in msg else f"{str(p)!r}: {msg}"
        raise (CorruptCheckpointError if isinstance(e, CorruptCheckpointError) else ValueError)(msg) from None
    return GGUFFile(p, info, _family_of_file(info), cfg, tuple(plan), experts)


def _import_experts(model: nn.Module, mod_name: str, ts: dict, dtype: torch.dtype, strict: bool, reports: list,
                    specs: dict, float_blocks: list) -> None:
    """Import one fused experts module from its three 3-D tensors ``ts`` (``G.EXPERT_TENSORS`` role -> tensor):
    a frozen ``QuantExperts`` when all three are the same block type and one qcore spec holds every block of
    each projection (``G.import_blocks`` on all experts at once: gate and up rows together, down), else float
    ``gate_up_proj`` / ``down_proj`` (ggml's dequantization; block types listed as dequantized)."""
    import gguf
    module = model.get_submodule(mod_name)
    gate, up, down = G.EXPERT_TENSORS
    kinds = {r: t.tensor_type.name for r, t in ts.items()}
    shapes = {r: _shape(t) for r, t in ts.items()}
    e_, i_, h_ = shapes[gate]

    def rows(r):  # [E * out, bytes or values]
        return np.asarray(ts[r].data).reshape(shapes[r][0] * shapes[r][1], -1)

    def values(r):
        t, k, (e, o, i) = ts[r], kinds[r], shapes[r]
        if k in _FLOAT_TYPES:
            return _float_values(np.asarray(t.data), k, (e, o, i), t.name)
        if k in G.TYPE_BYTES:
            return G.dequantize(rows(r), k, (e * o, i), where=t.name).reshape(e, o, i)
        return np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(e, o, i)
    names = {gate: f"{mod_name}.gate_up_proj", up: f"{mod_name}.gate_up_proj", down: f"{mod_name}.down_proj"}
    kind = kinds[gate]
    reason = ""
    if len(set(kinds.values())) != 1 and kinds[gate] == kinds[up] and set(kinds.values()) <= set(G.GGUF_SPEC_KINDS) \
            and isinstance(module, nn.Module) and is_fused_experts(module):
        # llama.cpp's mixes type ffn_down_exps apart: GGUF specs, down_proj its own (QuantExperts proj_weights)
        _import_gguf_experts(model, module, mod_name, ts, kinds[gate], dtype, reports, specs, down_kind=kinds[down])
        return
    if len(set(kinds.values())) != 1:
        reason = (f"the expert tensors have different types {kinds} (qcore: gate and up share one spec; down_proj "
                  f"may have its own GGUF type)")
    elif kind in _FLOAT_TYPES:
        reason = "float"
    elif kind not in G.BLOCK_KINDS:
        reason = f"{kind} is a block type no qcore grid holds"
    elif not (isinstance(module, nn.Module) and is_fused_experts(module)):
        reason = f"{type(module).__name__} is not a fused experts module qcore quantizes"
    spec = None
    if not reason and kind not in G.TYPE_BYTES:  # a GGUF spec's type (k-quants, Q5_x, IQ4_NL): its bytes as they are
        _import_gguf_experts(model, module, mod_name, ts, kind, dtype, reports, specs)
        return
    if not reason:
        gu_blocks = np.concatenate([rows(gate), rows(up)])  # [gate of every expert; up of every expert]
        s1, p1, why1 = G.import_blocks(gu_blocks, kind, (2 * e_ * i_, h_), where=f"{ts[gate].name} + {ts[up].name}")
        s2, p2, why2 = G.import_blocks(rows(down), kind, (e_ * h_, i_), where=ts[down].name)
        reason = why1 or why2
        if not reason and s1 != s2:
            s1, p1, s2, p2 = _same_q4_spec(s1, p1, s2, p2)
            if s1 != s2:
                reason = f"the gate/up and down blocks need different qcore specs ({s1.name}, {s2.name})"
        spec = None if reason else s1
        if spec is None and kind in G.GGUF_SPEC_KINDS:  # Q4_1 with float offsets, ...: qcore's GGUF spec of the type
            _import_gguf_experts(model, module, mod_name, ts, kind, dtype, reports, specs)
            return
    if spec is None:
        if strict and reason != "float":
            raise ValueError(f"from_gguf(strict=True): experts {mod_name} ({ts[gate].name}, ...) cannot be imported as "
                             f"qcore codes: {reason}; pass strict=False to import them as their float dequantization")
        vals = {r: values(r) for r in G.EXPERT_TENSORS}
        for pname, v in (("gate_up_proj", np.concatenate([vals[gate], vals[up]], axis=1)), ("down_proj", vals[down])):
            value, exact, diff = _to_torch(v, dtype)
            _set_param(model, f"{mod_name}.{pname}", value)
        for r, t in ts.items():
            how = "float" if kinds[r] in _FLOAT_TYPES else "dequantized"
            _, exact, diff = _to_torch(vals[r], dtype)
            reports.append(ImportedTensor(names[r], t.name, kinds[r], how, None, exact, diff,
                                          "" if how == "float" else reason))
            if how == "dequantized":
                float_blocks.append(t.name)
        return

    def cut(parts, a, b):
        return WeightParts(codes=parts.codes[a:b], scales=parts.scales[a:b],
                           zero_points=None if parts.zero_points is None else parts.zero_points[a:b])

    def join(x, y):
        return WeightParts(codes=np.concatenate([x.codes, y.codes]), scales=np.concatenate([x.scales, y.scales]),
                           zero_points=None if x.zero_points is None else np.concatenate([x.zero_points,
                                                                                           y.zero_points]))
    ei = e_ * i_
    parts = {"gate_up_proj": [join(cut(p1, e * i_, (e + 1) * i_), cut(p1, ei + e * i_, ei + (e + 1) * i_))
                              for e in range(e_)],
             "down_proj": [cut(p2, e * h_, (e + 1) * h_) for e in range(e_)]}
    for proj, ref_roles in (("gate_up_proj", (gate, up)), ("down_proj", (down,))):
        ref = np.concatenate([values(r) for r in ref_roles], axis=1)
        got = np.stack([qcore.dequantize(qcore.QTensor(p.codes, p.scales, p.zero_points, spec)) for p in parts[proj]])
        if not np.array_equal(got, ref):
            raise RuntimeError(f"from_gguf: experts {mod_name} {proj}: the imported {spec.name} codes do not "
                               f"reproduce ggml's values (a qcore bug; please report it)")
    q = QuantExperts.from_module(module, LayerConfig(weight=TensorConfig(spec)), name=mod_name)
    q.load_frozen(parts, dtype=dtype, device=torch.device("cpu"))
    q.eval()
    set_module(model, mod_name, q)
    specs[mod_name] = spec
    for r, t in ts.items():
        reports.append(ImportedTensor(names[r], t.name, kinds[r], "codes", spec, True, 0.0))


def _import_gguf_experts(model: nn.Module, module: nn.Module, mod_name: str, ts: dict, kind: str,
                         dtype: torch.dtype, reports: list, specs: dict, down_kind: Optional[str] = None) -> None:
    """``_import_experts`` of expert tensors of ``G.GGUF_SPEC_KINDS`` types (gate and up ``kind``; down ``kind`` or
    ``down_kind``, its own spec: ``QuantExperts`` ``proj_weights``): a frozen ``QuantExperts`` with those GGUF
    specs holding the file's block bytes (``load_frozen_gguf``; gate then up rows of each expert)."""
    gate, up, down = G.EXPERT_TENSORS
    down_kind = down_kind or kind
    spec = qcore.make_spec(G.GGUF_SPEC_KINDS[kind])
    kinds = {gate: kind, up: kind, down: down_kind}

    def blocks(r):
        e, o, i = _shape(ts[r])
        return G.gguf_spec_blocks(np.asarray(ts[r].data).reshape(e * o, -1), kinds[r], (e * o, i),
                                  where=ts[r].name).reshape(e, o, -1)
    b = {"gate_up_proj": np.concatenate([blocks(gate), blocks(up)], axis=1), "down_proj": blocks(down)}
    own = {} if down_kind == kind else {"down_proj": TensorConfig(qcore.make_spec(G.GGUF_SPEC_KINDS[down_kind]))}
    q = QuantExperts.from_module(module, LayerConfig(weight=TensorConfig(spec)), name=mod_name, proj_weights=own)
    try:
        q.load_frozen_gguf(b, dtype=dtype, device=torch.device("cpu"))
    except ValueError as e:
        raise CorruptCheckpointError(f"from_gguf: experts {mod_name} ({ts[gate].name}, ...): {e}") from None
    for p in b:
        if not np.array_equal(q.gguf_blocks(p), b[p]):
            raise RuntimeError(f"from_gguf: experts {mod_name}: the module does not hold the file's {kind} blocks "
                               f"(a qcore bug; please report it)")
    q.eval()
    set_module(model, mod_name, q)
    specs[mod_name] = spec
    if own:
        specs[f"{mod_name}.down_proj"] = own["down_proj"].spec  # by name in the model's config (model_config_of_specs)
    names = {gate: f"{mod_name}.gate_up_proj", up: f"{mod_name}.gate_up_proj", down: f"{mod_name}.down_proj"}
    for r, t in ts.items():
        reports.append(ImportedTensor(names[r], t.name, kinds[r], "codes", q.weight_spec(names[r].rsplit(".", 1)[1]),
                                      True, 0.0))


def _same_q4_spec(s1, p1, s2, p2):
    """Q4_0 blocks read as int4 symmetric in one projection and uint4 with zero points 7 / 8 in the other
    (``G.import_blocks``: ggml's quantizer writes negative scales): both as the uint4 grid (code + 8, zero point
    8), which holds the same values. Other pairs are returned as they are."""

    def widen(p):
        return WeightParts(codes=(p.codes.astype(np.int16) + 8).astype(np.uint8), scales=p.scales,
                           zero_points=np.full(p.scales.shape, 8, np.float32))
    a = G.import_spec("Q4_0")
    b = G.import_spec("Q4_0", signed=False)
    if (s1, s2) == (a, b):
        return b, widen(p1), s2, p2
    if (s1, s2) == (b, a):
        return s1, p1, b, widen(p2)
    return s1, p1, s2, p2


def _tied_head_of(model: nn.Module, emb: nn.Module, spec, parts, shape: tuple, dtype: torch.dtype,
                  q: QuantModule) -> Optional[str]:
    """The output head tied to the quantized token embedding ``q`` (imported from ``emb``) as a frozen module of
    the same spec sharing ``q``'s weight buffers (llama.cpp's head multiplies by the same quantized matrix); its
    module name, or None when the model has no separate head module."""
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None)
    if head is None or name is None or head is emb or type(head) not in QUANT_CLASSES:
        return None
    h = QUANT_CLASSES[type(head)].from_module(head, LayerConfig(weight=TensorConfig(spec)), name=name)
    if spec.gguf:
        h.load_frozen_gguf(parts, shape=shape, dtype=dtype, device=torch.device("cpu"))
    else:
        h.load_frozen(parts, shape=shape, dtype=dtype, device=torch.device("cpu"))
    for k, v in q._buffers.items():  # one copy of the blocks: the head's buffers are the embedding's
        if k.startswith("weight_"):
            h._buffers[k] = v
    h.eval()
    set_module(model, name, h)
    return name


def _shares_weight(head: Optional[nn.Module], emb: Optional[nn.Module], tied: bool = False) -> bool:
    """The quantized head holds the quantized token embedding's weight itself (tied: the same parameter, or the
    same frozen buffers; on a ``tied`` model also equal ones, e.g. after a device move copied the buffers) with
    the same spec: llama.cpp computes it with ``token_embd``."""
    if not isinstance(head, QuantModule) or not isinstance(emb, QuantModule) \
            or head.specs.get("weight") != emb.specs.get("weight"):
        return False

    def same(x, y):
        return x is y or (tied and x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y.to(x.device)))
    hw, ew = head._parameters.get("weight"), emb._parameters.get("weight")
    if hw is not None or ew is not None:
        return hw is not None and ew is not None and same(hw, ew)
    hb = {k: v for k, v in head._buffers.items() if k.startswith("weight_")}
    eb = {k: v for k, v in emb._buffers.items() if k.startswith("weight_")}
    return bool(hb) and hb.keys() == eb.keys() and all(same(hb[k], eb[k]) for k in hb)


def from_gguf(path: Union[str, os.PathLike], *, dtype: Optional[torch.dtype] = None, strict: bool = False,
              dequantize_other: bool = False) -> nn.Module:
    """Load the GGUF file ``path`` (architectures: the module docstring) as a transformers model whose
    GGUF-quantized Linear weights are frozen qcore modules (see the module docstring). Returns the model (eval
    mode) with ``model.qcore_config`` (None when no tensor is quantized) and ``model.qcore_gguf_report``.

    dtype: the float dtype of the model (float tensors, and what frozen modules dequantize to); default float32.
    strict: refuse (ValueError naming the tensor) any block-quantized tensor that would not become qcore codes.
    dequantize_other: import block types qcore has no grid for (Q4_K, Q6_K, ...) as their float32
        dequantization (gguf-py's) instead of refusing them.

    The tokenizer loads with ``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=name)``.
    """
    p = _check_args(path, dtype, strict, dequantize_other)
    try:
        return _load(p, dtype or torch.float32, strict, dequantize_other)
    except CorruptCheckpointError as e:  # every refusal names the file
        raise CorruptCheckpointError.naming(p, e) from None


def _load(p: pathlib.Path, dtype: torch.dtype, strict: bool, dequantize_other: bool) -> nn.Module:
    import gguf
    checked = check_gguf_file(p, strict=strict, dequantize_other=dequantize_other)  # the gate: before gguf-py
    reader = gguf.GGUFReader(p)  # maps the file, and before the skeleton is built
    by_name = {t.name: t for t in reader.tensors}
    cfg, model, names = _skeleton(checked.model, dtype)
    a = G.ARCHS[checked.model.arch]
    per_head_qkv = gguf_family(model)[0].qkv_layout == "per_head"  # llama.cpp's [q | k | v] back to per head
    plan = [(by_name[s.name], hf, mod_name, kind, shape) for s, hf, mod_name, kind, shape in checked.plan]
    experts = {m: {r: by_name[s.name] for r, s in ts.items()} for m, ts in checked.experts.items()}
    n_head = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_head)
    tied = bool(cfg.tie_word_embeddings)

    reports, specs, float_blocks = [], {}, []
    for t, hf, mod_name, kind, shape in plan:
        data = np.asarray(t.data)
        role = t.name.split(".")[-2]
        if a.permute_qk and role in ("attn_q", "attn_k"):
            data = G.unpermute_qk(data, n_head if role == "attn_q" else n_kv)
        if per_head_qkv and role == "attn_qkv":  # rows (weight, bias, blocks): codes and scales move with them
            data = G.qkv_heads_from_gguf(data, n_head)
        if kind in _FLOAT_TYPES:
            vals = _float_values(data, kind, shape, t.name)
            if a.norm_offset and role in G.NORM_TENSORS:
                # stored s = 1 + w: w' = s - 1 is exact for s in [0.5, 2] (Sterbenz), so the model's 1 + w' is s
                vals = vals.astype(np.float32) - np.float32(a.norm_offset)
            value, exact, diff = _to_torch(vals, dtype)
            _set_param(model, hf, value)
            reports.append(ImportedTensor(hf, t.name, kind, "float", None, exact, diff))
            continue
        module = model.get_submodule(mod_name)
        spec, parts, reason = None, None, ""
        if kind in G.BLOCK_KINDS:
            if type(module) not in QUANT_CLASSES:
                reason = f"{type(module).__name__} modules are not quantized by qcore"
            elif kind in G.TYPE_BYTES:
                spec, parts, reason = G.import_blocks(data, kind, shape, where=t.name)
            if spec is None and kind in G.GGUF_SPEC_KINDS and type(module) in QUANT_CLASSES:
                # qcore's GGUF spec of the type (k-quants, Q5_0/Q5_1, IQ4_NL; Q4_1 with float offsets m, Q8_0
                # blocks no int8 grid holds): the block bytes as they are
                spec, parts, reason = qcore.make_spec(G.GGUF_SPEC_KINDS[kind]), G.gguf_spec_blocks(
                    data, kind, shape, where=t.name), ""
            ref = G.dequantize(data, kind, shape, where=t.name)
        else:
            reason = f"{kind} is a block type no qcore grid holds"
            ref = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(shape)
            if a.permute_qk and role in ("attn_q", "attn_k"):
                ref = G.unpermute_qk(ref, n_head if role == "attn_q" else n_kv)
            if per_head_qkv and role == "attn_qkv":
                ref = G.qkv_heads_from_gguf(ref, n_head)
        if spec is None:
            if strict:
                raise ValueError(f"from_gguf(strict=True): tensor {t.name!r} ({kind}) cannot be imported as qcore "
                                 f"codes: {reason}; pass strict=False to import it as its float dequantization")
            value, exact, diff = _to_torch(ref, dtype)
            _set_param(model, hf, value)
            reports.append(ImportedTensor(hf, t.name, kind, "dequantized", None, exact, diff, reason))
            float_blocks.append(t.name)
            continue
        q = QUANT_CLASSES[type(module)].from_module(module, LayerConfig(weight=TensorConfig(spec)), name=mod_name)
        if spec.gguf:  # the file's bytes as they are (``ref`` is their dequantization: qcore's = ggml's)
            q.load_frozen_gguf(parts, shape=shape, dtype=dtype, device=torch.device("cpu"))
            if not np.array_equal(q.gguf_blocks(), parts):
                raise RuntimeError(f"from_gguf: {t.name!r}: the module does not hold the file's {kind} blocks (a "
                                   f"qcore bug; please report it)")
        else:
            got = qcore.dequantize(qcore.QTensor(parts.codes, parts.scales, parts.zero_points, spec))
            if not np.array_equal(got, ref):
                raise RuntimeError(f"from_gguf: {t.name!r}: the imported {spec.name} codes do not reproduce ggml's "
                                   f"values (a qcore bug; please report it)")
            q.load_frozen(parts, shape=shape, dtype=dtype, device=torch.device("cpu"))
        q.eval()
        set_module(model, mod_name, q)
        specs[mod_name] = spec
        reports.append(ImportedTensor(hf, t.name, kind, "codes", spec, True, 0.0))
        if tied and isinstance(module, nn.Embedding):
            head = _tied_head_of(model, module, spec, parts, shape, dtype, q)
            if head is not None:
                specs[head] = spec

    for mod_name, ts in experts.items():
        _import_experts(model, mod_name, ts, dtype, strict, reports, specs, float_blocks)

    if tied and not any(isinstance(m, QuantModule) for m in [model.get_output_embeddings()]):
        model.tie_weights()
        out, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and out.weight is not emb.weight:
            out.weight = emb.weight
    left = [n for n, v in list(model.named_parameters()) + list(model.named_buffers()) if v.is_meta]
    if left:
        raise CorruptCheckpointError(f"from_gguf: the file has no tensor for {left[:5]}")
    model.qcore_config = model_config_of_specs(model, specs)
    if model.qcore_config is not None:
        check_config_describes(model, model.qcore_config)  # a qcore bug if the config does not rebuild the model
    model.qcore_gguf_report = GGUFImportReport(str(p), tuple(reports))
    if float_blocks:
        warnings.warn(f"from_gguf: {len(float_blocks)} block-quantized tensor(s) have no exact qcore grid and are "
                      f"imported as float weights holding ggml's dequantization (model.qcore_gguf_report."
                      f"dequantized says why): {', '.join(float_blocks[:5])}{', ...' if len(float_blocks) > 5 else ''}",
                      stacklevel=3)
    return model.eval()

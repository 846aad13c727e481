"""llama.cpp's quantization mixes (``Q4_K_M``, ``Q3_K_M``, ``Q2_K``, ...): which GGUF type each tensor gets, and why.

llama.cpp's ``llama-quantize`` (``llama_model_quantize``) turns a float GGUF file into a *mix*: one default block
type (``Q4_K`` for Q4_K_M) and per-tensor overrides by role, layer and shape (``llama_tensor_get_type`` in
``src/llama-quant.cpp``). ``tensor_types`` reproduces that choice over GGUF tensor names and shapes, from the
rules below, held as data in one table (``MIXES`` and the shared ``OUTPUT_RULES`` / ``POST_RULES``).

Transcribed from llama.cpp's ``src/llama-quant.cpp`` (ggml-org/llama.cpp, the revision stored as commit
``007dbbf3fd17eefe9b47fee45f48f7ba5e62b714``, which has ``llama_quant_compute_types`` and the fallback table
below), checked against the library llama-cpp-python 0.3.36 vendors (its ``libggml`` reports ``ggml_version``
0.25.3, ``ggml_commit`` 0c1e570; its ``libllama`` holds the same strings: the Q2_K/Q3_K -> Q4_0 fallback,
DeepSeek-V4's ``ffn_gate_tid2eid``): the tests (``tests/adapters/test_gguf_mixes.py``, marker ``gguf_client``)
run that library's own quantizer on tiny models of several families and compare every tensor's type, which is
where the one difference from the stored source showed (the F16 fallback of 32-block types, step 4).

What llama.cpp does, in order, per tensor (``llama_tensor_get_type``):

1. **Kept as it is** (not quantized; ``tensor_allows_quantization``): tensors of fewer than 2 dimensions (norms,
   biases), names not ending in ``weight``, ``*_norm.weight``, the MoE router ``ffn_gate_inp.weight``,
   positional embeddings and token types, and a few small tensors of other architectures (``SKIPPED``).
2. **Role** (``tensor_get_category``): ``output.weight``; ``token_embd.weight``; names containing ``attn_qkv``,
   ``attn_kv_b``, ``attn_v``, ``attn_k``, ``attn_q``, ``attn_output``, ``ffn_up``, ``ffn_gate``, ``ffn_down``
   (the first that matches, in that order; ``ffn_down_exps`` / ``ffn_down_shexp`` are ``ffn_down``). ``attn_qkv``
   and ``attn_kv_b`` count as ``attn_v`` (llama.cpp's ``category_is_attn_v``).
3. **The mix's rule** for the role (``MIXES[mix].rules``; the first rule whose conditions all hold, else the
   mix's default type). The output head, and ``token_embd`` when the file has no ``output.weight`` (a tied
   head), follow ``OUTPUT_RULES``: Q8_0 where the row length is not a multiple of the default type's block
   (SmolLM2's 576), else Q6_K (Q8_0 for the Q8_0 mix). ``POST_RULES`` apply after a role's rule (the 70B and
   8-expert bumps of ``attn_v`` / ``attn_k``).
4. **Fallback** when the row length ``ne0`` (the input features: a numpy shape's last axis) is not a multiple
   of the chosen type's block (``FALLBACK``: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0;
   F16 when even 32 does not divide it). The stored source throws for a 32-block type ("no tensor type fallback
   is defined"); the vendored library writes F16 there (its own quantizer's files, tested), and so does qcore.

Counters: ``use_more_bits(i, n)`` (``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``) runs over the index ``i`` of
the ``attn_v`` tensor among all of them (llama.cpp counts them in its tensor order: by layer, then by name) and,
for ``ffn_down``, over the layer (the counter, or with experts the ``blk.N.`` of the name), ``n`` = ``n_layer``.

Mix names are llama.cpp's (``"Q4_K_M"``, case-insensitive); ``ftype`` is its ``LLAMA_FTYPE_MOSTLY_*`` number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

__all__ = ["MIXES", "Mix", "Choice", "MIX_NAMES", "BLOCK_SIZES", "FALLBACK", "OUTPUT_RULES", "POST_RULES",
           "SKIPPED", "mix_name", "tensor_types", "tensor_role", "use_more_bits", "type_counts"]

#: elements per block of each type a mix can give (F16 / F32: 1)
BLOCK_SIZES = {"Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q4_0": 32, "Q4_1": 32,
               "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "IQ4_NL": 32, "F16": 1, "BF16": 1, "F32": 1}

#: llama.cpp's ``tensor_type_fallback``: a type whose block does not divide the row length -> this type (F16 when
#: its block does not divide it either); the 32-block types go to F16 directly
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


@dataclass(frozen=True)
class Rule:
    """``when`` (all of these conditions hold) -> ``type``. Conditions (``_holds``): ``"more_bits"``
    (``use_more_bits`` of the role's index), ``"first_8"`` / ``"first_16"`` (index < n/8, n/16), ``"index_lt_2"``
    / ``"index_lt_4"`` (the role's counter), ``"gqa_ge_4"`` (n_head / n_head_kv >= 4), ``"experts_8"`` (exactly 8
    experts), ``"falcon"``, ``"imatrix"``, ``"model_70b"`` (llama, 80 layers, GQA), ``"row_misfit"`` (the row
    length is not a multiple of the default type's block), ``"default_q8_0"``, ``"type_q3_k_or_q4_k"`` (the type
    chosen so far), each negated by a ``"not_"`` prefix."""

    when: tuple
    type: str
    why: str


def _r(when: str, type_: str, why: str) -> Rule:
    return Rule(tuple(when.split()) if when else (), type_, why)


@dataclass(frozen=True)
class Mix:
    name: str
    ftype: int  # LLAMA_FTYPE_MOSTLY_*
    default: str
    rules: Mapping[str, tuple] = field(default_factory=dict)  # role -> (Rule, ...), first match wins


_MORE = "use_more_bits"
# attn_output of an 8-expert model (Mixtral) in these mixes: Q5_K (llama.cpp: "n_expert == 8" branch)
_AO8 = _r("experts_8 not_falcon", "Q5_K", "attn_output of an 8-expert model")
# "" = the mix's default type
_AO8_KEEP = _r("experts_8 not_falcon", "", "attn_output of an 8-expert model: the default")

#: the mixes: default type and the rules per role (llama.cpp's llama_tensor_get_type_impl, one ftype at a time)
MIXES: dict[str, Mix] = {m.name: m for m in (
    Mix("Q4_0", 2, "Q4_0", {"ffn_down": (_r("imatrix first_8", "Q4_1", "ffn_down of the first n/8 layers with an "
                                                                         "imatrix"),)}),
    Mix("Q4_1", 3, "Q4_1"),
    Mix("Q8_0", 7, "Q8_0"),
    Mix("Q5_0", 8, "Q5_0", {"ffn_down": (_r("imatrix first_8", "Q5_1", "ffn_down of the first n/8 layers with an "
                                                                         "imatrix"),)}),
    Mix("Q5_1", 9, "Q5_1"),
    Mix("Q2_K", 10, "Q2_K", {
        "attn_v": (_r("gqa_ge_4", "Q4_K", "attn_v with n_head / n_head_kv >= 4"), _r("", "Q3_K", "attn_v")),
        "ffn_down": (_r("", "Q3_K", "ffn_down"),),
        "attn_output": (_AO8, _AO8_KEEP, _r("not_falcon", "Q3_K", "attn_output"))}),
    Mix("Q3_K_S", 11, "Q3_K", {"attn_output": (_AO8,)}),
    Mix("Q3_K_M", 12, "Q3_K", {
        "attn_v": (_r("index_lt_2", "Q5_K", "attn_v of the first 2 layers"), _r("", "Q4_K", "attn_v")),
        "ffn_down": (_r("first_16", "Q5_K", "ffn_down of the first n/16 layers"),
                     _r("not_falcon", "Q4_K", "ffn_down"), _r("more_bits", "Q4_K", f"ffn_down, {_MORE}")),
        "attn_output": (_AO8, _AO8_KEEP, _r("not_falcon", "Q4_K", "attn_output"))}),
    Mix("Q3_K_L", 13, "Q3_K", {
        "attn_v": (_r("", "Q5_K", "attn_v"),),
        "ffn_down": (_r("falcon", "Q4_K", "ffn_down (falcon)"), _r("", "Q5_K", "ffn_down")),
        "attn_output": (_AO8_KEEP, _r("not_falcon", "Q5_K", "attn_output"),
                        _r("falcon", "Q4_K", "attn_output (falcon)"))}),
    Mix("Q4_K_S", 14, "Q4_K", {
        "attn_v": (_r("index_lt_4", "Q5_K", "attn_v of the first 4 layers"),),
        "ffn_down": (_r("not_falcon first_8", "Q5_K", "ffn_down of the first n/8 layers"),),
        "attn_output": (_AO8,)}),
    Mix("Q4_K_M", 15, "Q4_K", {
        "attn_v": (_r("more_bits", "Q6_K", f"attn_v, {_MORE}"),),
        "ffn_down": (_r("falcon first_16", "Q6_K", "ffn_down of the first n/16 layers (falcon)"),
                     _r("falcon more_bits", "Q5_K", f"ffn_down, {_MORE} (falcon)"),
                     _r("not_falcon more_bits", "Q6_K", f"ffn_down, {_MORE}")),
        "attn_output": (_AO8,)}),
    Mix("Q5_K_S", 16, "Q5_K"),
    Mix("Q5_K_M", 17, "Q5_K", {
        "attn_v": (_r("more_bits", "Q6_K", f"attn_v, {_MORE}"),),
        "ffn_down": (_r("more_bits", "Q6_K", f"ffn_down, {_MORE}"),)}),
    Mix("Q6_K", 18, "Q6_K"),
)}

MIX_NAMES = tuple(MIXES)

#: the output head and a tied token_embd (every mix here): llama.cpp's first branch of llama_tensor_get_type_impl
OUTPUT_RULES = (
    _r("falcon", "Q8_0", "output (falcon)"),
    _r("row_misfit", "Q8_0", "output: the row length is not a multiple of the default type's block"),
    _r("default_q8_0", "Q8_0", "output"),
    _r("", "Q6_K", "output"),
)

#: after the role's rule (every mix): the 70B and 8-expert bumps
POST_RULES = {
    "attn_v": (_r("model_70b type_q3_k_or_q4_k", "Q5_K", "attn_v of a 70B model (8 heads share it)"),
               _r("experts_8", "Q8_0", "attn_v of an 8-expert model")),
    "attn_k": (_r("experts_8", "Q8_0", "attn_k of an 8-expert model"),),
}

#: substrings (and exact names) of 2-D weights llama.cpp never quantizes (``tensor_allows_quantization``)
SKIPPED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
           "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
           "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
           "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
           "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
           "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
           "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
           "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")
_SKIPPED_EXACT = ("position_embd.weight", "token_types.weight")

#: llama.cpp's roles, in its matching order (substring of the name -> role)
_ROLES = (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
          ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
          ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"))


@dataclass(frozen=True)
class Choice:
    """The type llama.cpp gives one tensor: ``type`` (what the file holds), ``wanted`` (the mix's rule, before
    the fallback for a row length the type's block does not divide), ``reason`` (the rule, in words),
    ``quantized`` (False: kept as it is)."""

    type: str
    wanted: str
    reason: str
    quantized: bool = True

    @property
    def fallback(self) -> bool:
        return self.type != self.wanted


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_name(mix: str) -> str:
    """llama.cpp's spelling of a mix name (``"q4_k_m"`` -> ``"Q4_K_M"``); ValueError listing the names."""
    if not isinstance(mix, str):
        raise TypeError(f"mix must be a str (one of {', '.join(MIX_NAMES)}), got {type(mix).__name__}")
    m = mix.strip().upper()
    if m not in MIXES:
        import difflib
        close = difflib.get_close_matches(m, MIX_NAMES, n=3)
        raise ValueError(f"unknown llama.cpp mix {mix!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
                         + f"; the mixes: {', '.join(MIX_NAMES)}")
    return m


def tensor_role(name: str) -> Optional[str]:
    """llama.cpp's role (category) of a tensor name: ``"output"``, ``"token_embd"``, ``"attn_v"`` (also
    ``attn_qkv`` / ``attn_kv_b``), ``"attn_k"``, ``"attn_q"``, ``"attn_output"``, ``"ffn_up"``, ``"ffn_gate"``,
    ``"ffn_down"``, or None (other)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    return next((r for s, r in _ROLES if s in name), None)


def _kept_reason(name: str, shape: tuple) -> Optional[str]:
    """Why llama.cpp keeps the tensor as it is (None: it quantizes it)."""
    dims = len(shape)
    while dims > 1 and shape[len(shape) - dims] == 1:  # ggml_n_dims: trailing ne of 1 do not count
        dims -= 1
    if dims < 2:
        return f"{dims}-D"
    if not name.endswith("weight"):
        return "not a weight"
    if name in _SKIPPED_EXACT:
        return "llama.cpp keeps it"
    hit = next((s for s in SKIPPED if s in name), None)
    return None if hit is None else ("a norm" if hit == "_norm.weight" else "the MoE router" if hit ==
                                     "ffn_gate_inp.weight" else "llama.cpp keeps it")


def _layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _order(names) -> list:
    """llama.cpp's tensor order (``weight_name_comparer``): by layer (``blk.N.``; others first), then by name."""
    return sorted(names, key=lambda n: (_layer_of(n), n))


def _check_int(v, what: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
    return v


def _check_shape(name, shape) -> tuple:
    if not isinstance(name, str) or not name:
        raise TypeError(f"tensors: keys must be GGUF tensor names (str), got {name!r}")
    try:
        s = tuple(shape)
    except TypeError:
        s = None
    if s is None or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in s):
        raise ValueError(f"tensors[{name!r}]: expected a shape (a tuple of positive ints, the input features "
                         f"last), got {shape!r}")
    return s


def tensor_types(mix: str, tensors: Mapping[str, Sequence[int]], *, arch: str, n_layer: int, n_expert: int = 0,
                 n_head: int = 1, n_head_kv: Optional[int] = None, imatrix: bool = False,
                 source_types: Optional[Mapping[str, str]] = None) -> dict:
    """``{GGUF tensor name: Choice}``: the type llama.cpp's quantizer gives each tensor of a float GGUF file in
    ``mix`` (``"Q4_K_M"``, ...; ``MIX_NAMES``), and why. Pure.

    tensors: ``{name: shape}`` of every tensor of the file (``"blk.3.attn_v.weight"``: ``(out, in)``; experts
        ``(E, out, in)``; numpy order, the row length ``ne0`` last), as ``export_gguf`` would write it: whether
        ``output.weight`` is there decides whether ``token_embd`` is treated as the (tied) output.
    arch: llama.cpp's ``general.architecture`` (``"llama"``, ``"qwen2"``, ...; ``"falcon"`` has rules of its own).
    n_layer: the block count; n_expert: experts per MoE layer (0: dense); n_head / n_head_kv: attention heads
        and key/value heads of layer 0 (``n_head / n_head_kv`` is llama.cpp's ``n_gqa``; n_head_kv default
        n_head).
    imatrix: llama.cpp is given an importance matrix (only Q4_0 / Q5_0's first ffn_down layers change).
    source_types: the type each kept tensor has in the file (default F32); kept tensors keep it.
    """
    mix = mix_name(mix)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict {{GGUF tensor name: shape}}, got {type(tensors).__name__}")
    if not isinstance(arch, str) or not arch:
        raise TypeError(f"arch must be llama.cpp's architecture name (a str such as 'llama'), got {arch!r}")
    _check_int(n_layer, "n_layer", 1)
    _check_int(n_expert, "n_expert", 0)
    _check_int(n_head, "n_head", 1)
    n_head_kv = n_head if n_head_kv is None else _check_int(n_head_kv, "n_head_kv", 1)
    if not isinstance(imatrix, bool):
        raise TypeError(f"imatrix must be a bool, got {imatrix!r}")
    shapes = {n: _check_shape(n, s) for n, s in tensors.items()}
    src = dict(source_types or {})
    spec = MIXES[mix]
    tied = "output.weight" not in shapes
    n_wv = sum(tensor_role(n) == "attn_v" for n in shapes)
    counters = {"attn_v": 0, "ffn_down": 0, "ffn_gate": 0, "ffn_up": 0}
    env = {"falcon": arch == "falcon", "imatrix": imatrix, "gqa_ge_4": n_head // n_head_kv >= 4,
           "experts_8": n_expert == 8, "default_q8_0": spec.default == "Q8_0",
           "model_70b": arch == "llama" and n_layer == 80 and n_head != n_head_kv}
    out: dict = {}
    for name in _order(shapes):
        shape = shapes[name]
        kept = _kept_reason(name, shape)
        if kept is not None:
            t = src.get(name, "F32")
            out[name] = Choice(t, t, f"kept {t} ({kept})", quantized=False)
            continue
        role = tensor_role(name)
        ncols = shape[-1]
        if role == "output" or (tied and role == "token_embd"):
            rules, what = OUTPUT_RULES, "output" if role == "output" else "token_embd (tied: the output head)"
        else:
            rules, what = spec.rules.get(role, ()) if role != "token_embd" else (), role or "other"
        idx = None
        if role in counters:
            if role in ("ffn_down", "ffn_gate", "ffn_up") and max(1, n_expert) > 1:
                idx = _layer_of(name)
                if not 0 <= idx < n_layer:
                    raise ValueError(f"tensors[{name!r}]: llama.cpp reads the layer of an expert model's {role} "
                                     f"from its name (blk.N. with N < n_layer={n_layer})")
            else:
                idx = counters[role]
            n = n_wv if role == "attn_v" else n_layer
        else:
            n = n_layer
        local = dict(env, row_misfit=ncols % BLOCK_SIZES[spec.default] != 0)
        if idx is not None:
            local.update(more_bits=use_more_bits(idx, n), first_8=idx < n // 8, first_16=idx < n // 16,
                         index_lt_2=idx < 2, index_lt_4=idx < 4)
        wanted, why = spec.default, f"{what}: the default"
        for rule in rules:
            if all(_holds(c, local) for c in rule.when):
                wanted, why = (rule.type or spec.default), rule.why
                if rules is OUTPUT_RULES and role == "token_embd":
                    why = "token_embd (tied: the output head)" + why[len("output"):]
                break
        for rule in POST_RULES.get(role, ()):
            local["type_q3_k_or_q4_k"] = wanted in ("Q3_K", "Q4_K")
            if all(_holds(c, local) for c in rule.when):
                wanted, why = rule.type, rule.why
        if idx is not None and role in ("attn_v", "ffn_down"):
            why += f" (index {idx} of {n})" if role == "attn_v" else f" (layer {idx} of {n})"
        if role in counters:
            counters[role] += 1
        typ = wanted
        if ncols % BLOCK_SIZES[wanted]:
            typ = FALLBACK.get(wanted, "F16")
            if ncols % BLOCK_SIZES[typ]:
                typ = "F16"
            why += f"; {ncols} columns not a multiple of {BLOCK_SIZES[wanted]}: {wanted} -> {typ}"
        out[name] = Choice(typ, wanted, why)
    return out


def _holds(cond: str, env: dict) -> bool:
    if cond.startswith("not_"):
        return not env[cond[4:]]
    return bool(env[cond])


def type_counts(choices: Mapping[str, Choice]) -> dict:
    """``{type: number of quantized tensors}``, most common first."""
    counts: dict = {}
    for c in choices.values():
        if c.quantized:
            counts[c.type] = counts.get(c.type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

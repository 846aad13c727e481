"""GGUF weight specs (k-quants and the 32-element GGUF types) on fused MoE experts (issue 25): ``QuantExperts``
with ``qcore.make_spec("q4_k")`` fake-quantizes each expert's ``[out, in]`` slice as the core does, freezes to
ggml's block bytes exactly, is written by ``export_gguf`` as ``ffn_{gate,up,down}_exps`` of its own type byte for
byte, and such files (qcore's and llama.cpp's own k-quant MoE files) import as codes; GPTQ on such experts works.
llama.cpp (marker ``gguf_client``) loads the export with the qcore model's logits."""

import functools

import numpy as np
import pytest
import torch

import qcore

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.gguf import export_gguf, from_gguf  # noqa: E402
from qcore.adapters.modules import QuantExperts  # noqa: E402

from test_export_gguf import _ids, _router_margins, _tiny_specs, tiny_tokenizer  # noqa: E402

MOE = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# 256-wide rows everywhere a k-quant goes (hidden, heads * head_dim, expert and shared-expert intermediate)
_WIDE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
_EDITS = {"qwen2_moe": dict(shared_expert_intermediate_size=256)}


def tiny_moe(fam, *, layers=1, seed=0):
    """The family's tiny MoE model (conftest's TINY_SPECS) with 256-wide rows, 1-D parameters moved off their
    init values."""
    cfg_cls, kw, model_cls = _tiny_specs()[fam]
    kw = dict(kw, **_WIDE, **_EDITS.get(fam, {}), num_hidden_layers=layers)
    if fam == "mixtral":
        kw.pop("moe_intermediate_size")
    torch.manual_seed(seed)
    m = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def experts_of(m):
    return [(n, x) for n, x in m.named_modules() if isinstance(x, QuantExperts)]


def _tensors(path):
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data))) for t in gguf.GGUFReader(path).tensors}


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits[0]

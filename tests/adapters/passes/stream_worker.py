"""Helpers for ``test_streaming.py``: write a synthetic Llama checkpoint piece by piece, and (run as a script)
measure the peak memory of ``quantize_checkpoint`` on it in a fresh process.

    python stream_worker.py SRC DST ALGO      # ALGO: rtn or gptq; prints one JSON line

The script first quantizes a tiny checkpoint (so lazy imports and first-call allocations are not counted), then
resets the process's peak resident memory (Linux ``/proc/self/clear_refs``) and reports how far the peak rises
above the resident memory before quantizing SRC.
"""

import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

VOCAB = 256


def write_llama(directory, *, hidden: int, intermediate: int, layers: int, seed: int = 0,
                dtype=torch.float32, tie: bool = False) -> int:
    """A random Llama checkpoint (config.json + one safetensors shard per decoder layer + an index), written
    one layer at a time without building the model; returns the bytes of its weights."""
    import transformers
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=128, tie_word_embeddings=tie, dtype=dtype)
    cfg.save_pretrained(d)
    with init_empty_weights():
        skeleton = transformers.LlamaForCausalLM(cfg)
    skeleton.tie_weights()
    g = torch.Generator().manual_seed(seed)
    files: dict = {}
    seen = set()
    for k, p in skeleton.state_dict(keep_vars=True).items():
        if id(p) in seen:  # a tied weight is stored once
            continue
        seen.add(id(p))
        f = f"layer-{int(k.split('.')[2]):05d}.safetensors" if k.startswith("model.layers.") else "outer.safetensors"
        files.setdefault(f, []).append((k, tuple(p.shape)))
    weight_map, total = {}, 0
    for f, items in files.items():
        tensors = {k: (torch.ones(s) if "norm" in k else torch.randn(s, generator=g) * 0.05).to(dtype)
                   for k, s in items}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({k: f for k in tensors})
        save_file(tensors, str(d / f), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    return total


def config(algo: str):
    from qcore.adapters import preset
    c = preset("uint4_wo_64")
    return c.replace(algorithms=({"name": "gptq"},)) if algo == "gptq" else c


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (1, 64), generator=g) for _ in range(4)]


def _status(key: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: resident now; VmHWM: peak resident)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main(src: str, dst: str, algo: str) -> None:
    torch.set_num_threads(1)
    import gc
    from qcore.adapters.jobs.checkpoint import quantize_checkpoint

    warm = pathlib.Path(tempfile.mkdtemp())
    write_llama(warm / "src", hidden=64, intermediate=64, layers=2)
    quantize_checkpoint(warm / "src", warm / "dst", config(algo), batches(), progress=False)
    gc.collect()
    # reset the peak (Linux: "5" > clear_refs resets VmHWM), so that a higher peak met while importing cannot hide
    # the peak of the run. ru_maxrss is no measure here: it also keeps the parent's peak from before the exec
    # (the kernel carries it over to the new program), e.g. a pytest process that loaded real models.
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    t0 = time.perf_counter()
    quantize_checkpoint(src, dst, config(algo), batches(), progress=False)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    print(json.dumps({"before": before, "peak": peak, "growth": peak - before, "seconds": seconds}))

if __name__ == "__main__":
    main(*sys.argv[1:4])

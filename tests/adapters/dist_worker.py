"""One rank of the 2-process gloo test in ``test_distributed.py`` (run as a script; also imported by the test for
the shared model, data and configs).

    python dist_worker.py RANK WORLD INIT_FILE OUT_FILE

Each rank builds the same tiny Llama (fixed seed), takes its share of the calibration batches (interleaved:
batches[rank::world]) and runs ``quantize_model(..., distributed=Distributed())`` for every scenario; it saves
every tensor of the quantized models (and the error messages of the refused runs) to OUT_FILE.
"""

import os
import sys
from datetime import timedelta

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

N_BATCHES = 4


def tiny_llama():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 8), generator=g) for _ in range(N_BATCHES)]


def configs() -> dict:
    """Scenario name -> ModelConfig: GPTQ uint4 g16 weights; the same with static activation scales (MinMax on
    every input, Percentile on down_proj's input, fp8 KV cache)."""
    from qcore.adapters import LayerConfig, Percentile, TensorConfig, preset
    gptq = preset("w_uint4_per_group_asym", group_size=16).replace(algorithms=({"name": "gptq"},))
    w = gptq.layer.weight
    inp = TensorConfig("int8", dynamic=False)
    static = preset("w_uint4_per_group_asym", group_size=16, kv_cache="fp8").replace(
        layer=LayerConfig(weight=w, input=inp),
        by_name={"*.down_proj": LayerConfig(weight=w, input=TensorConfig("int8", observer=Percentile(99.0)))},
        algorithms=({"name": "gptq"},))
    return {"gptq": gptq, "gptq_static": static}


def tensors(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    from qcore.adapters import quantize_model
    from qcore.adapters.distributed import Distributed

    d = Distributed()
    mine = batches()[rank::world]
    result = {}
    for name, cfg in configs().items():
        m = tiny_llama()
        quantize_model(m, cfg, mine, progress=False, distributed=d)
        result[name] = tensors(m)
    # refused before any work, on every rank: a rank without batches
    m = tiny_llama()
    try:
        quantize_model(m, configs()["gptq"], mine if rank == 0 else [], progress=False, distributed=d)
        result["empty_rank"] = None
    except ValueError as e:
        result["empty_rank"] = str(e)
    result["empty_rank_untouched"] = all(torch.equal(a, b) for a, b in zip(tensors(m).values(),
                                                                           tensors(tiny_llama()).values()))
    torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

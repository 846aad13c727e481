"""One rank of the 2-process gloo test of GPTQ on fused MoE experts in ``test_moe_gptq.py`` (run as a script):

    python moe_dist_worker.py RANK WORLD INIT_FILE OUT_FILE

Each rank builds the same tiny Qwen3-MoE (``conftest.tiny_family``, fixed seed), takes its share of the
calibration batches (interleaved: batches[rank::world]), runs ``quantize_model(..., distributed=Distributed())``
with GPTQ and saves the quantized model's state_dict to OUT_FILE.
"""

import os
import sys
from datetime import timedelta

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

FAMILY = "qwen3_moe"
N_BATCHES = 4


def _conftest():
    """tests/adapters/conftest.py, next to this file, loaded by path (``import conftest`` may find another)."""
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location("_adapters_conftest", pathlib.Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model():
    return _conftest().tiny_family(FAMILY)


def batches():
    return _conftest().token_batches(N_BATCHES, seed=1)


def config():
    from qcore.adapters import preset
    return preset("uint4_wo_32").replace(algorithms=({"name": "gptq"},))


def main(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    from qcore.adapters import quantize_model
    from qcore.adapters.distributed import Distributed

    m = model()
    quantize_model(m, config(), batches()[rank::world], progress=False, distributed=Distributed())
    torch.save({k: v.detach().clone() for k, v in m.state_dict().items()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

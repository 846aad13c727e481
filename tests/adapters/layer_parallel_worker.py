"""One rank of the 2-process gloo test in ``test_layer_parallel.py`` (run as a script; also imported by the test
for the shared model, data and configs).

    python layer_parallel_worker.py RANK WORLD INIT_FILE OUT_FILE SRC_CHECKPOINT DST_CHECKPOINT

Each rank builds the same tiny Llama (``dist_worker.tiny_llama``), takes its share of the calibration batches
(``batches[rank::world]``) and runs ``quantize_model(..., distributed=Distributed(layer_parallel=True))`` for
every scenario, counting the GPTQ runs it made itself; then ``quantize_checkpoint`` on SRC_CHECKPOINT with the
same option (rank 0 writes DST_CHECKPOINT); then a run where the ranks disagree on ``layer_parallel``. It saves
every tensor of the quantized models, the counts and the error messages to OUT_FILE.
"""

import os
import sys
from datetime import timedelta

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

import dist_worker  # noqa: E402  (tests/adapters, next to this file)


def configs() -> dict:
    """Scenario name -> ModelConfig: GPTQ uint4 g16 (the Linear groups of a stage: q/k/v, o, gate/up, down);
    the same with an MSE weight observer (the modules of a group each run GPTQ on their own); with
    ``true_sequential`` (one group per stage: nothing to split, the broadcast still runs)."""
    import dataclasses

    from qcore.adapters import MSE
    base = dist_worker.configs()["gptq"]
    mse = base.replace(layer=dataclasses.replace(base.layer, weight=dataclasses.replace(base.layer.weight,
                                                                                        observer=MSE())))
    seq = base.replace(algorithms=({"name": "gptq", "true_sequential": True},))
    return {"gptq": base, "gptq_mse": mse, "gptq_sequential": seq}


def main(rank: int, world: int, init_file: str, out: str, src: str, dst: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    import qcore.adapters.passes.gptq as gptq_binding
    from qcore.adapters import quantize_model
    from qcore.adapters.distributed import Distributed
    from qcore.adapters.jobs.checkpoint import quantize_checkpoint

    runs = []
    real = gptq_binding.gptq

    def counting(w, *a, **k):
        runs.append(tuple(w.shape))
        return real(w, *a, **k)
    gptq_binding.gptq = counting
    d = Distributed(layer_parallel=True)
    mine = dist_worker.batches()[rank::world]
    result = {"runs": {}}
    for name, cfg in configs().items():
        runs.clear()
        m = dist_worker.tiny_llama()
        quantize_model(m, cfg, mine, progress=False, distributed=d)
        result[name] = dist_worker.tensors(m)
        result["runs"][name] = list(runs)
    runs.clear()
    info = quantize_checkpoint(src, dst, configs()["gptq"], mine, progress=False, distributed=d)
    result["checkpoint_info"] = info is not None
    result["runs"]["checkpoint"] = list(runs)
    # rank 0's destination now exists: refused on every rank (rank 1 does not wait in a collective)
    try:
        quantize_checkpoint(src, dst, configs()["gptq"], mine, progress=False, distributed=d)
        result["dst_exists"] = None
    except ValueError as e:
        result["dst_exists"] = str(e)
    # refused before any work, on every rank: the ranks disagree on layer_parallel
    try:
        quantize_model(dist_worker.tiny_llama(), configs()["gptq"], mine, progress=False,
                       distributed=Distributed(layer_parallel=rank == 0))
        result["mismatch"] = None
    except ValueError as e:
        result["mismatch"] = str(e)
    torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7])

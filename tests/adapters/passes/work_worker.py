"""Helper for ``test_work_dir.py``: a layer-by-layer run killed with SIGKILL right after decoder layer K is saved
in its work directory (the process dies mid-run, as on a power cut or the OOM killer).

    python work_worker.py model WORK K          # quantize_model (AWQ then GPTQ) on the tiny Llama of conftest.py
    python work_worker.py stream SRC DST WORK K # quantize_checkpoint (GPTQ, static scales) on the checkpoint SRC
    python work_worker.py both WORK K SRC DST WORK2 K2   # the first in a forked child, then the second (one import)
"""

import os
import signal
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

import conftest  # noqa: E402  (tests/adapters: the tiny models)
import qcore.adapters as A  # noqa: E402
from qcore.adapters.passes import checkpointing as K  # noqa: E402

MODEL_CFG = {"preset": "w_uint4_per_group_asym", "group_size": 16, "algorithms": ({"name": "awq"}, {"name": "gptq"})}
STREAM_CFG = {"preset": "w_int8_a_int8_per_tensor_sym", "algorithms": ({"name": "gptq"},)}


def model_config():
    return A.preset(MODEL_CFG["preset"], group_size=MODEL_CFG["group_size"]).replace(
        algorithms=MODEL_CFG["algorithms"])


def stream_config():
    return A.preset(STREAM_CFG["preset"], kv_cache="fp8").replace(algorithms=STREAM_CFG["algorithms"])


def batches(vocab: int, n: int = 3):
    return [torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(10 + i)) for i in range(n)]


def _kill_after(k: int) -> None:
    real = K.WorkDir.save_layer

    def save_layer(self, i, *a, **kw):
        real(self, i, *a, **kw)
        if i == k:
            os.kill(os.getpid(), signal.SIGKILL)
    K.WorkDir.save_layer = save_layer


def _model(work: str, k: int) -> None:
    _kill_after(k)
    A.quantize_model(conftest.tiny_llama(0), model_config(), batches(conftest.VOCAB), progress=False, work_dir=work)


def _stream(src: str, dst: str, work: str, k: int) -> None:
    from qcore.adapters.jobs.checkpoint import quantize_checkpoint
    _kill_after(k)
    quantize_checkpoint(src, dst, stream_config(), batches(256), max_shard_size="60KB", progress=False,
                        work_dir=work)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "both":  # python work_worker.py both WORK_MODEL K_MODEL SRC DST WORK_STREAM K_STREAM
        _, _, wm, km, src, dst, ws, ks = sys.argv
        import transformers  # noqa: F401  (imported once, before the fork)
        pid = os.fork()  # the in-memory run in a child (imports shared), the streamed one here
        if pid == 0:
            try:
                _model(wm, int(km))
            finally:
                os._exit(3)  # not killed: the parent reports it
        _, status = os.waitpid(pid, 0)
        print(f"child: {'killed by signal ' + str(os.WTERMSIG(status)) if os.WIFSIGNALED(status) else 'exited'}",
              flush=True)
        _stream(src, dst, ws, int(ks))
    elif sys.argv[1] == "model":
        _model(sys.argv[2], int(sys.argv[3]))
    else:
        _stream(*sys.argv[2:5], int(sys.argv[5]))
    sys.exit(3)  # not killed: the test fails on the exit code

"""Layer-parallel GPTQ (``Distributed(layer_parallel=True)``, docs/distributed.md): 2 gloo ranks on CPU, each
holding half of the calibration batches and running GPTQ on its share of each layer's Linear groups, give bit for
bit the weights of one process holding every batch (``quantize_model``) and the same checkpoint files
(``quantize_checkpoint``, rank 0 writing)."""

import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dist_worker  # noqa: E402  (tests/adapters, next to this file)
import layer_parallel_worker as worker  # noqa: E402
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "passes"))  # stream_worker, whichever test ran first
import stream_worker  # noqa: E402  (tests/adapters/passes)

import qcore.adapters.passes.gptq as seq  # noqa: E402  (the GPTQ binding: where gptq() is looked up)
from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.distributed import Distributed, owners  # noqa: E402
from qcore.adapters.jobs.checkpoint import quantize_checkpoint  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORLD = 2


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The 2 ranks (subprocesses, gloo, file:// rendezvous) on the tiny model and a tiny checkpoint."""
    d = tmp_path_factory.mktemp("lp")
    src = d / "src"
    stream_worker.write_llama(src, hidden=64, intermediate=128, layers=2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "layer_parallel_worker.py"), str(r), str(WORLD),
                               str(d / "init"), str(d / f"rank{r}.pt"), str(src), str(d / "dst")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(WORLD)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{o[-4000:]}"
    return d, [torch.load(d / f"rank{r}.pt") for r in range(WORLD)]


def _counted(fn):
    runs = []
    real = seq.gptq

    def counting(w, *a, **k):
        runs.append(tuple(w.shape))
        return real(w, *a, **k)
    seq.gptq = counting
    try:
        fn()
    finally:
        seq.gptq = real
    return runs


@pytest.mark.parametrize("scenario", list(worker.configs()))
def test_two_ranks_layer_parallel_equal_one_process(run, scenario):
    _, ranks = run
    m = dist_worker.tiny_llama()
    one = _counted(lambda: quantize_model(m, worker.configs()[scenario], dist_worker.batches(), progress=False))
    ref = dist_worker.tensors(m)
    for r, res in enumerate(ranks):
        got = res[scenario]
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(_bits(got[k]), _bits(ref[k])), f"rank {r}, {scenario}: {k} differs"
    # the work was shared: together the ranks ran each GPTQ of one process exactly once
    per_rank = [res["runs"][scenario] for res in ranks]
    assert sorted(per_rank[0] + per_rank[1]) == sorted(one)
    if scenario != "gptq_sequential":  # one group per stage: no split possible, rank 0 owns each
        assert per_rank[0] and per_rank[1]
    assert not torch.equal(ref["model.layers.1.mlp.down_proj.weight"],
                           dist_worker.tensors(dist_worker.tiny_llama())["model.layers.1.mlp.down_proj.weight"])


def test_checkpoint_layer_parallel_equals_one_process(run, tmp_path):
    d, ranks = run
    one = tmp_path / "one"
    quantize_checkpoint(d / "src", one, worker.configs()["gptq"], dist_worker.batches(), progress=False)
    assert [res["checkpoint_info"] for res in ranks] == [True, False]  # rank 0 writes, rank 1 returns None
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in (d / "dst").iterdir())
    for n in names:
        assert (one / n).read_bytes() == (d / "dst" / n).read_bytes(), n
    assert ranks[0]["runs"]["checkpoint"] and ranks[1]["runs"]["checkpoint"]


def test_layer_parallel_mismatch_refused_on_every_rank(run):
    _, ranks = run
    for res in ranks:
        assert res["mismatch"] is not None and "layer_parallel differs between the ranks" in res["mismatch"]


def test_checkpoint_destination_refused_on_every_rank(run):
    d, ranks = run
    for res in ranks:
        assert res["dst_exists"] is not None and "rank 0 refused the run before any work: dst_dir" in res["dst_exists"]
    assert (d / "dst" / "config.json").is_file()  # left as it was


def test_owners_balance_and_validation():
    # longest first to the least loaded rank; deterministic
    assert owners([1.0, 5.0, 3.0, 3.0], 2) == [0, 0, 1, 1]  # 5 -> 0, 3 -> 1, 3 -> 1, 1 -> 0: loads 6 and 6
    assert owners([2.0, 2.0], 1) == [0, 0]
    assert owners([], 3) == []
    with pytest.raises(ValueError, match="world_size"):
        owners([1.0], 0)
    with pytest.raises(ValueError, match="costs"):
        owners([-1.0], 2)
    with pytest.raises(TypeError, match="layer_parallel"):
        Distributed(layer_parallel="yes")
    with pytest.raises(TypeError):
        Distributed(None, True)  # keyword-only

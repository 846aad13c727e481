"""Beyond one process: distributed calibration (``qcore.adapters.distributed``: 2 gloo ranks on CPU, each holding
half of the calibration batches, give bit for bit the weights and scales of one process holding all of them) and
models placed on several devices with accelerate (the hooks ``device_map`` installs, exercised on CPU)."""

import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import dist_worker  # noqa: E402  (tests/adapters, next to this file)

from qcore.adapters import preset, quantize_model  # noqa: E402
from qcore.adapters.distributed import Distributed, reduce_hessian  # noqa: E402
from qcore.algorithms.gptq import HessianStats, merge_hessians, update_hessian  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORLD = 2


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the 2 ranks (subprocesses, gloo, file:// rendezvous); their saved results."""
    d = tmp_path_factory.mktemp("dist")
    init = d / "init"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "dist_worker.py"), str(r), str(WORLD), str(init),
                               str(d / f"rank{r}.pt")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(WORLD)]
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
    return [torch.load(d / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("scenario", ["gptq", "gptq_static"])
def test_two_ranks_equal_one_process(ranks, scenario):
    m = dist_worker.tiny_llama()
    quantize_model(m, dist_worker.configs()[scenario], dist_worker.batches(), progress=False)
    ref = dist_worker.tensors(m)
    float_model = dist_worker.tensors(dist_worker.tiny_llama())
    for r, res in enumerate(ranks):
        got = res[scenario]
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(_bits(got[k]), _bits(ref[k])), f"rank {r}, {scenario}: {k} differs"
    # the comparison can fail: GPTQ changed the weights away from round-to-nearest of the float weights, and
    # the static scales exist and were calibrated
    q = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(ref[q], float_model[q])
    if scenario == "gptq_static":
        assert torch.isfinite(ref["model.layers.0.self_attn.q_proj.input_scale"]).all()
        assert torch.isfinite(ref["model.layers.1.self_attn.k_proj.output_scale"]).all()
        # rank 0 alone (half of the batches) gives other scales: the reduction is what makes them equal
        alone = dist_worker.tiny_llama()
        quantize_model(alone, dist_worker.configs()[scenario], dist_worker.batches()[0::WORLD], progress=False)
        a = dist_worker.tensors(alone)
        assert any(not torch.equal(a[k], ref[k]) for k in ref if k.endswith(("input_scale", "output_scale")))


def test_rank_without_batches_refused_on_every_rank(ranks):
    for res in ranks:
        assert res["empty_rank"] is not None and "ranks [1] have no calibration batches" in res["empty_rank"]
        assert res["empty_rank_untouched"]


def test_hessian_sums_of_the_test_are_exact():
    """Why the equality above holds: every float64 addition of the per-batch x^T x is exact here, so any order
    gives the same sum (docs: qcore.adapters.distributed). Checked on the first layer's q/k/v input."""
    m = dist_worker.tiny_llama()
    xs = []
    layer = m.model.layers[0].self_attn.q_proj
    h = layer.register_forward_pre_hook(lambda mod, args: xs.append(args[0].detach()))
    with torch.no_grad():
        for b in dist_worker.batches():
            m(b)
    h.remove()
    n = xs[0].shape[-1]
    one = HessianStats.empty(n, like=xs[0])
    for x in xs:
        one = update_hessian(one, x)
    parts = [HessianStats.empty(n, like=xs[0]) for _ in range(WORLD)]
    for i, x in enumerate(xs):
        parts[i % WORLD] = update_hessian(parts[i % WORLD], x)
    two = merge_hessians(*parts)
    assert torch.equal(one.sum, two.sum) and one.count == two.count
    prods = [(x.reshape(-1, n).float().T @ x.reshape(-1, n).float()).double() for x in xs]
    lo = torch.stack([p.abs().masked_fill(p == 0, float("inf")) for p in prods]).amin(0)
    hi = torch.stack([p.abs() for p in prods]).amax(0)
    assert bool(((hi / lo) < 2.0 ** (29 - 2)).all())  # B = 4 batches: 29 - log2(4) bits


def test_not_initialised_refused_before_work():
    m = dist_worker.tiny_llama()
    before = dist_worker.tensors(m)
    with pytest.raises(ValueError, match="init_process_group"):
        quantize_model(m, dist_worker.configs()["gptq"], dist_worker.batches(), progress=False,
                       distributed=Distributed())
    with pytest.raises(TypeError, match="distributed must be"):
        quantize_model(m, dist_worker.configs()["gptq"], dist_worker.batches(), progress=False, distributed=True)
    assert all(torch.equal(a, b) for a, b in zip(before.values(), dist_worker.tensors(m).values()))
    with pytest.raises(TypeError, match="HessianStats"):
        reduce_hessian(torch.zeros(2, 2))


# ---------------------------------------------------------------------------------------------------------------
# several devices: placement with accelerate (device_map), exercised on CPU
# ---------------------------------------------------------------------------------------------------------------

DEVICE_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
              "model.norm": "cpu", "lm_head": "cpu"}


@pytest.mark.parametrize("scenario", ["ptpc_fp8", "gptq_static"])
def test_model_placed_with_accelerate_hooks(scenario):
    """``dispatch_model`` (what ``from_pretrained(device_map=...)`` does with several GPUs) puts an accelerate hook
    on every module holding weights, replacing its ``forward`` on the instance. The wrappers take the hook over:
    the result equals the unplaced model's (before, the wrappers ran the float module's forward: dynamic
    activations were silently left unquantized and static ones never calibrated)."""
    accelerate = pytest.importorskip("accelerate")
    cfg = preset("ptpc_fp8") if scenario == "ptpc_fp8" else dist_worker.configs()["gptq_static"]
    ref = dist_worker.tiny_llama()
    quantize_model(ref, cfg, dist_worker.batches(), progress=False)
    placed = accelerate.dispatch_model(dist_worker.tiny_llama(), device_map=DEVICE_MAP, force_hooks=True)
    q = placed.model.layers[0].self_attn.q_proj
    assert "_hf_hook" in q.__dict__ and "forward" in q.__dict__  # the hooks are really there
    quantize_model(placed, cfg, dist_worker.batches(), progress=False)
    q = placed.model.layers[0].self_attn.q_proj
    assert q.__dict__["forward"].args[0] is q  # the hook now calls the wrapper
    x = dist_worker.batches()[0]
    with torch.no_grad():
        assert torch.equal(placed(x).logits, ref(x).logits)


def test_offloaded_weights_are_refused():
    accelerate = pytest.importorskip("accelerate")
    m = dist_worker.tiny_llama()
    accelerate.cpu_offload(m, execution_device=torch.device("cpu"))  # weights on meta, loaded at each forward
    with pytest.raises(ValueError, match="meta device.*quantize_checkpoint"):
        quantize_model(m, "uint4_wo_64", progress=False)
    assert not any(type(x).__name__.startswith("Quant") for x in m.modules())


def test_instance_patched_forward_is_refused():
    m = dist_worker.tiny_llama()
    lin = m.model.layers[0].mlp.up_proj
    lin.forward = lambda x: x
    with pytest.raises(TypeError, match="up_proj.*forward is replaced on the instance"):
        quantize_model(m, "uint4_wo_64", progress=False)

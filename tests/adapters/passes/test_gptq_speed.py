"""``quantize_model`` with GPTQ on a tiny Llama: the fast paths of issue 23 (the CPU column loop, the blocked
``x^T x`` accumulated in place) give the same bits as the landed code path, reproduced here by putting the kept
reference functions back (``_reference_gptq``, one full product per batch added into a new sum)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from qcore import ScaleMode  # noqa: E402
from qcore.adapters import preset, quantize_model  # noqa: E402
from qcore.adapters.passes import gptq as gptq_binding  # noqa: E402
from qcore.algorithms import gptq as G  # noqa: E402
from qcore.algorithms import gptq_core  # noqa: E402


def _landed(monkeypatch):
    def add(self, x):
        st = G.update_hessian(self.stats(), x)
        self.sum, self.count = st.sum, st.count

    monkeypatch.setattr(gptq_core, "gram", lambda rows: rows.T @ rows)
    monkeypatch.setattr(gptq_core.HessianSum, "add", add)
    monkeypatch.setattr(gptq_binding, "gptq", G._reference_gptq)


CONFIGS = {
    "uint4 g32 asym, act-order": (preset("w_uint4_per_group_asym", group_size=32), {"name": "gptq"}),
    "uint4 g32 asym, no act-order": (preset("w_uint4_per_group_asym", group_size=32),
                                     {"name": "gptq", "act_order": False}),
    "uint4 g32 asym, static groups": (preset("w_uint4_per_group_asym", group_size=32),
                                      {"name": "gptq", "static_groups": True, "true_sequential": True}),
    "int8 per-channel sym": (preset("w_int8_per_channel_sym"), {"name": "gptq"}),
    "mxfp4": (preset("mxfp4_weight_only", scale_mode=ScaleMode.EVEN), {"name": "gptq"}),
}


@pytest.fixture(scope="module")
def llama(zoo):
    return zoo.tiny_llama(0), zoo.token_batches(3, seed=1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantize_model_gptq_has_the_landed_bits(llama, name, monkeypatch):
    model, data = llama
    config, algo = CONFIGS[name]
    config = config.replace(algorithms=(algo,))
    fast = copy.deepcopy(model)
    quantize_model(fast, config, data, progress=False)
    with monkeypatch.context() as m:
        _landed(m)
        ref = copy.deepcopy(model)
        quantize_model(ref, config, data, progress=False)
    a, b = fast.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    changed = [k for k in a if not torch.equal(a[k], model.state_dict().get(k, a[k]))]
    assert any("layers.0.mlp.down_proj" in k for k in changed)  # GPTQ did quantize the layers
    assert [k for k in a if not torch.equal(a[k], b[k])] == []

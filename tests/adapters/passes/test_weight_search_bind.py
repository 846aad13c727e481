"""GPTQ (and Qronos) with the searched-scale weight observers: a group's scales are decided at its first touch by
the observer's search (``targets.scale_fn``), and a two-level spec's tensor scale is four over six's
``amax / (6 * 256)`` of the whole weight (``gptq``'s ``scale_fn`` protocol)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import qcore  # noqa: E402
import qcore.adapters as A  # noqa: E402
from qcore.stats import exponent_search, four_over_six  # noqa: E402

NV = qcore.make_spec("nvfp4", axis=1)
MX = qcore.make_spec("mxfp4", axis=1, scale_mode=qcore.ScaleMode.EVEN)


@pytest.mark.parametrize("algo", ["gptq", "qronos"])
@pytest.mark.parametrize("spec,obs,width", [(NV, A.FourOverSix(), 16), (MX, A.ExponentSearch(), 32)])
def test_first_touch_group_scales_come_from_the_search(zoo, algo, spec, obs, width):
    model = zoo.tiny_llama()
    data = zoo.token_batches(2, seed=1, batch=2, seq=16)
    floats = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # act_order off: group 0 is then the first group touched, before any column moved
    cfg = A.ModelConfig(A.LayerConfig(weight=A.TensorConfig(spec, observer=obs)),
                        algorithms=({"name": algo, "act_order": False},))
    q = A.quantize_model(copy.deepcopy(model), cfg, data, progress=False)
    mods = {n: m for n, m in q.named_modules() if isinstance(m, A.QuantLinear)}
    assert len(mods) == 14
    for n, m in mods.items():
        w = floats[n]
        if isinstance(obs, A.FourOverSix):
            g = np.float32(w.abs().max().item()) / np.float32(6 * 256)
            # the whole weight's, before the loop (Qronos: of the weight after its first-column step, which GPTQ's
            # loop is given): the block scales keep room for "max -> 4" (<= 1.5 * 256)
            assert float(m.weight_scale.max()) <= 384.0, n
            if algo == "gptq":  # group 0's first touch sees the float values
                assert float(m.weight_tensor_scale) == float(g), n
                p = four_over_six(w[:, :width], spec, tensor_scale=float(g))
                assert torch.equal(m.weight_scale[:, :1], p.scale), n
        elif algo == "gptq":
            assert torch.equal(m.weight_scale[:, :1], exponent_search(w[:, :width], spec).scale), n
        # the stored scales are what the weight is on the grid of
        kw = {"scale": m.weight_scale}
        if spec.two_level:
            kw["tensor_scale"] = m.weight_tensor_scale
        assert torch.equal(qcore.fake_quantize(m.weight.detach(), spec, **kw), m.weight.detach())

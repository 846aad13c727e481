"""Round-to-nearest weights with the searched-scale observers (FourOverSix on NVFP4, ExponentSearch on MX): every
quantized Linear's stored scales and fake-quantized weight are exactly ``qcore.stats``'s search on its float
weight; the model config with them round-trips."""

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


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, A.QuantLinear)}


@pytest.mark.parametrize("spec,obs", [(NV, A.FourOverSix()), (MX, A.ExponentSearch())])
def test_rtn_weights_take_the_searched_scales(zoo, spec, obs):
    model = zoo.tiny_llama()
    floats = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    cfg = A.ModelConfig(A.LayerConfig(weight=A.TensorConfig(spec, observer=obs)))
    q = A.quantize_model(copy.deepcopy(model), cfg, progress=False)
    own = A.quantize_model(copy.deepcopy(model), A.ModelConfig(A.LayerConfig(weight=spec)), progress=False)
    mods = _linears(q)
    assert len(mods) == 14
    changed = 0
    for n, m in mods.items():
        w = floats[n]
        p = four_over_six(w, spec) if isinstance(obs, A.FourOverSix) else exponent_search(w, spec)
        assert torch.equal(m.weight_scale, p.scale)
        if isinstance(obs, A.FourOverSix):
            assert float(m.weight_tensor_scale) == float(np.float32(w.abs().max().item()) / np.float32(6 * 256))
        assert torch.equal(m.weight.detach(), qcore.fake_quantize(w, spec, **p.kwargs()))
        changed += int(not torch.equal(m.weight_scale, _linears(own)[n].weight_scale))
    assert changed == len(mods)
    assert q.qcore_config == cfg and A.ModelConfig.from_json(cfg.to_json()) == cfg

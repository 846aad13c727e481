"""The adapters pick the kernels: ``available`` (QCORE_TRITON, devices), and a quantized model whose forward runs
through the kernels (fake-quantized activations, the fused matmul for frozen int4 / MXFP4 weights) gives the core
path's outputs: bit for bit where only quantization differs, within the matmul's tolerance for the fused product."""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from qcore.adapters import freeze, preset, quantize_model  # noqa: E402

qt = pytest.importorskip("qcore.adapters.triton")
import qcore.adapters.triton._launch as launch  # noqa: E402


def test_available_follows_the_environment_and_the_device(monkeypatch):
    cpu = torch.zeros(2)
    monkeypatch.setenv("QCORE_TRITON", "1")
    assert qt.available(cpu) is True  # forced, and the interpreter is on (tests/kernels/conftest.py)
    assert qt.available(cpu, force=False) is False
    assert qt.available(None) is False and qt.available(cpu.numpy()) is False
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert qt.available(cpu) is False  # a CPU tensor needs the interpreter
    monkeypatch.setenv("QCORE_TRITON", "0")
    assert qt.available(cpu, force=True) is False
    monkeypatch.delenv("QCORE_TRITON")
    assert qt.available(cpu) is False  # automatic: GPU tensors only
    monkeypatch.setenv("QCORE_TRITON", "yes")
    with pytest.raises(ValueError, match="QCORE_TRITON"):
        qt.available(cpu)
    with pytest.raises(TypeError, match="force"):
        qt.available(cpu, force=1)


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 40)).to(dtype)


class _Spy:
    def __init__(self, monkeypatch):
        self.calls = {"fake_quantize": 0, "linear_w4": 0}
        for name in self.calls:
            fn = getattr(launch, name)

            def wrapped(*a, _fn=fn, _name=name, **kw):
                self.calls[_name] += 1
                return _fn(*a, **kw)
            monkeypatch.setattr(launch, name, wrapped)


@pytest.mark.parametrize("scheme,fused", [("w_mxfp4_a_mxfp4", True), ("int4_wo_32", True), ("uint4_wo_64", True),
                                          ("w_fp8_a_fp8", False), ("nvfp4", False),
                                          ("w_int8_a_int8_per_token_dynamic", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_kernels_give_the_core_outputs(scheme, fused, dtype, monkeypatch):
    model = _model(dtype)
    calib = [torch.randn(8, 64).to(dtype) for _ in range(2)]
    monkeypatch.setenv("QCORE_TRITON", "0")
    quantize_model(model, preset(scheme), calib, progress=False)
    x = torch.randn(5, 64).to(dtype)
    with torch.no_grad():
        fq_core = model(x)
    frozen = copy.deepcopy(model)
    freeze(frozen)
    with torch.no_grad():
        frozen_core = frozen(x)
    spy = _Spy(monkeypatch)
    monkeypatch.setenv("QCORE_TRITON", "1")
    with torch.no_grad():
        fq_kernel = model(x)
        frozen_kernel = frozen(x)
    has_act = preset(scheme).layer.input is not None
    assert spy.calls["fake_quantize"] > 0 or not has_act
    assert torch.equal(fq_kernel, fq_core)  # activations through the kernels: the same bits
    if fused:
        assert spy.calls["linear_w4"] == 2
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(frozen_kernel, frozen_core, rtol=tol, atol=tol)
    else:
        assert spy.calls["linear_w4"] == 0
        assert torch.equal(frozen_kernel, frozen_core)
    with torch.no_grad():  # and with the kernels off again, nothing was changed
        monkeypatch.setenv("QCORE_TRITON", "0")
        assert torch.equal(model(x), fq_core)


@pytest.mark.parametrize("size,key", [(64, None), (48, 3)])
def test_online_rotation_uses_the_fwht_kernel(size, key, monkeypatch):
    from qcore.adapters.passes.rotation import InputRotation

    calls = []
    real = launch.fwht
    monkeypatch.setattr(launch, "fwht", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rot = InputRotation(size, key=key)
    x = torch.randn(2, 5, size).to(torch.bfloat16)
    monkeypatch.setenv("QCORE_TRITON", "0")
    core = rot.apply(x)
    monkeypatch.setenv("QCORE_TRITON", "1")
    with torch.no_grad():
        assert torch.equal(rot.apply(x), core)
    assert calls == [1]


def test_gradients_keep_the_core_path(monkeypatch):
    model = _model(torch.float32)
    monkeypatch.setenv("QCORE_TRITON", "0")
    quantize_model(model, preset("w_mxfp4_a_mxfp4"), [torch.randn(8, 64)], progress=False)
    spy = _Spy(monkeypatch)
    monkeypatch.setenv("QCORE_TRITON", "1")
    x = torch.randn(3, 64, requires_grad=True)
    model(x).sum().backward()
    assert spy.calls["fake_quantize"] == 0 and x.grad is not None  # straight-through gradients: the core's


def test_import_qcore_adapters_without_triton_loaded():
    """Importing the package loads no kernels; the kernels module is loaded by the first kernel call only."""
    import subprocess
    import sys

    code = ("import sys, qcore.adapters.triton as t; assert 'qcore.adapters.triton._kernels' not in sys.modules; "
            "assert t.why_not('mxfp4') is None; assert 'qcore.adapters.triton._kernels' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)

"""Real files qcore writes, built once per session from a tiny random Llama (hidden 64, 2 layers, vocab 128, as
tests/adapters/conftest.py's ``tiny_llama``), for the fuzz targets to mutate (tests/fuzz/fuzz_kit.py).

Each fixture is a folder the tests copy before they change anything: ``quark_int8`` / ``quark_uint4`` (export_hf
of int8 per-channel and asymmetric uint4 groups of 32: Quark's ``int8`` and ``int4_group`` layouts),
``quark_sharded`` (the int8 export in shards, with model.safetensors.index.json), ``ct_uint4``
(export_compressed_tensors: pack-quantized asymmetric int4 groups of 32),
``imatrix_files`` (an importance matrix collected on the model, as imatrix.gguf and imatrix.dat), ``onnx_files``
(the decoder graph with QDQ int4 weights and with MatMulNBits), ``work_run`` (a finished GPTQ run's work
directory). ``batches`` are the token batches every model is run on.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fuzz_kit  # noqa: E402

VOCAB, HIDDEN = 128, 64


def tiny_llama(seed: int = 0):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def token_batches(n: int = 2, *, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(n)]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def batches():
    return token_batches()


def _quantized(scheme: str, **kw):
    import qcore.adapters as A
    m = tiny_llama(0)
    A.quantize_model(m, A.preset(scheme) if isinstance(scheme, str) else scheme, token_batches(), progress=False,
                     **kw)
    A.freeze(m)
    return m


@pytest.fixture(scope="session")
def quark_int8(tmp_path_factory):
    import qcore.adapters as A
    d = tmp_path_factory.mktemp("fuzz_src") / "quark_int8"
    A.export_hf(_quantized("w_int8_per_channel_sym"), d)
    return d


@pytest.fixture(scope="session")
def quark_uint4(tmp_path_factory):
    import qcore.adapters as A
    d = tmp_path_factory.mktemp("fuzz_src") / "quark_uint4"
    A.export_hf(_quantized("uint4_wo_32"), d)
    return d


@pytest.fixture(scope="session")
def quark_sharded(tmp_path_factory):
    import qcore.adapters as A
    d = tmp_path_factory.mktemp("fuzz_src") / "quark_sharded"
    A.export_hf(_quantized("w_int8_per_channel_sym"), d, max_shard_size=40_000)
    assert (d / "model.safetensors.index.json").is_file()
    return d


@pytest.fixture(scope="session")
def ct_uint4(tmp_path_factory):
    from qcore.adapters.io.compressed_tensors import export_compressed_tensors
    d = tmp_path_factory.mktemp("fuzz_src") / "ct_uint4"
    export_compressed_tensors(_quantized("uint4_wo_32"), d)
    return d


@pytest.fixture(scope="session")
def imatrix_files(tmp_path_factory):
    from qcore.adapters.imatrix import collect_imatrix, save_imatrix
    d = tmp_path_factory.mktemp("fuzz_src")
    stats = collect_imatrix(tiny_llama(0), token_batches(3), progress=False)
    save_imatrix(stats, d / "imatrix.gguf", datasets=("calibration.txt",), chunk_size=8)
    save_imatrix(stats, d / "imatrix.dat", datasets=("calibration.txt",), chunk_size=8)
    return d


@pytest.fixture(scope="session")
def onnx_files(tmp_path_factory):
    pytest.importorskip("onnx")
    from qcore.adapters.io.onnx import export_onnx
    d = tmp_path_factory.mktemp("fuzz_src")
    m = _quantized("int4_wo_32")
    export_onnx(m, d / "qdq.onnx")
    export_onnx(m, d / "nbits.onnx", weight_format="matmulnbits")
    return d


def gptq_config():
    import qcore.adapters as A
    return A.preset("uint4_wo_32").replace(algorithms=({"name": "gptq"},))


@pytest.fixture(scope="session")
def work_job():
    """A fresh (model, batches, config) of the ``work_run`` job, to resume it with."""
    return lambda: (tiny_llama(0), token_batches(3), gptq_config())


@pytest.fixture(scope="session")
def work_run(tmp_path_factory):
    """(work directory of a finished 2-layer GPTQ run, the state dict that run ended with)."""
    import qcore.adapters as A
    d = tmp_path_factory.mktemp("fuzz_src") / "work"
    m = A.quantize_model(tiny_llama(0), gptq_config(), token_batches(3), progress=False, work_dir=d)
    return d, {k: v.clone() for k, v in m.state_dict().items()}


def pytest_terminal_summary(terminalreporter):
    if not fuzz_kit.STATS:
        return
    terminalreporter.section("fuzz targets: examples run and what the readers did")
    for target, c in sorted(fuzz_kit.STATS.items()):
        rest = ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k != "examples")
        terminalreporter.write_line(f"{target}: {c['examples']} examples ({rest})")

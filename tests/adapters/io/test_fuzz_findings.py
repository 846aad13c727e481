"""The minimal failing inputs the fuzz targets (tests/fuzz/) found in the HF-checkpoint loaders, each now a
one-line ``CorruptCheckpointError`` (a ValueError) naming the file and the field or tensor."""

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import qcore.adapters as A  # noqa: E402
from qcore.adapters.io.common import check_hyperparameters  # noqa: E402
from qcore.formats.safetensors_io import CorruptCheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, zoo):
    """int8 per-channel and uint4 groups of 32 (qcore's Quark layouts), the int8 one also in shards."""
    root = tmp_path_factory.mktemp("fuzz_findings")
    for name, scheme, kw in [("int8", "w_int8_per_channel_sym", {}), ("uint4", "uint4_wo_32", {}),
                             ("sharded", "w_int8_per_channel_sym", dict(max_shard_size=40_000))]:
        m = zoo.tiny_llama(0)
        A.quantize_model(m, A.preset(scheme), zoo.token_batches(2, seed=1), progress=False)
        A.freeze(m)
        A.export_hf(m, root / name, **kw)
    return root


def _copy(ckpts, name, tmp_path):
    import shutil
    shutil.copytree(ckpts / name, tmp_path / name)
    return tmp_path / name


def _edit_json(path, fn):
    j = json.loads(path.read_text())
    fn(j)
    path.write_text(json.dumps(j))


HYPERPARAMETERS = [  # (config.json key, value, what the message says)
    ("vocab_size", 2 ** 40, r"vocab_size is 1099511627776; expected at most the checkpoint's size in bytes"),
    ("intermediate_size", 0, r"intermediate_size is 0; expected a positive int"),
    ("hidden_size", True, r"hidden_size is True; expected a positive int"),
    ("num_hidden_layers", 10 ** 6, r"num_hidden_layers is 1000000; expected at most the checkpoint's tensor count"),
    ("max_position_embeddings", 2 ** 40, r"max_position_embeddings is 1099511627776; expected at most 2\*\*31 - 1"),
    ("rms_norm_eps", 0.0, r"rms_norm_eps is 0\.0; expected a positive finite number"),
    ("rms_norm_eps", -1e-6, r"rms_norm_eps is -1e-06; expected a positive finite number"),
    ("rope_theta", math.inf, r"rope_theta is inf; expected a positive finite number"),
    ("architectures", "LlamaForCausalLM", r"architectures is 'LlamaForCausalLM'; expected a list of class names"),
    ("torch_dtype", "int8", r"torch_dtype is 'int8'; expected a float dtype name"),
]


@pytest.mark.parametrize("key, value, match", HYPERPARAMETERS, ids=[f"{k}={v!r}" for k, v, _ in HYPERPARAMETERS])
def test_hyperparameters_are_range_checked(ckpts, tmp_path, key, value, match):
    d = _copy(ckpts, "int8", tmp_path)
    _edit_json(d / "config.json", lambda c: c.__setitem__(key, value))
    with pytest.raises(CorruptCheckpointError, match=r"config\.json'?: " + match):
        A.from_pretrained(d)


def test_nested_hyperparameters_name_their_path():
    with pytest.raises(CorruptCheckpointError, match=r"'c\.json': rope_scaling\.factor is -2; expected a positive"):
        check_hyperparameters({"rope_scaling": {"factor": -2}}, "'c.json'")
    check_hyperparameters({"rope_scaling": {"factor": 2.0}, "vocab_size": None, "hidden_size": 64}, "'c.json'",
                          tensor_bytes=10 ** 6, tensor_count=30)


def test_a_group_size_qcore_does_not_take_names_the_config(ckpts, tmp_path):
    """TensorConfig's own check (group larger than qcore takes) was raised without the file and field."""
    d = _copy(ckpts, "uint4", tmp_path)
    _edit_json(d / "config.json",
               lambda c: c["quantization_config"]["global_quant_config"]["weight"].__setitem__("group_size", 2 ** 40))
    with pytest.raises(ValueError, match=r"config\.json.*global_quant_config.*group / block size 1099511627776"):
        A.from_pretrained(d)


def test_an_index_without_metadata_is_refused(ckpts, tmp_path):
    """transformers reads the index's metadata (a KeyError traceback when it is missing)."""
    d = _copy(ckpts, "sharded", tmp_path)
    _edit_json(d / "model.safetensors.index.json", lambda j: j.pop("metadata"))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors\.index\.json'?: metadata is missing"):
        A.from_pretrained(d)


def test_an_index_naming_a_corrupt_shard_names_the_entry(ckpts, tmp_path):
    d = _copy(ckpts, "sharded", tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[0]
    (d / shard).write_bytes((d / shard).read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError,
                       match=rf"index\.json'?: weight_map\[.*\] names '{shard}', which is not a valid safetensors"):
        from qcore.formats.safetensors_io import index_shards
        index_shards(d)

"""A hypothesis fuzz target for GGUF: real GGUF files (qcore's tiny Llama and GPT-2 exports, under ``slow`` also
Qwen3-MoE, Gemma2 and Phi-3; the embedded SmolLM2 Q4_1 file's header under ``real_model``) mutated (bytes of the
header flipped, the file truncated, metadata values and value types changed, keys given twice or dropped, tensor
dims / types / offsets changed, tensors dropped, the header's counts changed), then read by every GGUF loader: the
``formats.gguf`` readers (``read_header``, ``check_file``, ``check_model_file``), the gate (``check_gguf_file``),
``from_gguf`` (qcore's reader) and ``load_model``'s transformers path. Each either refuses with one line
(``ValueError`` / ``CommandError``) naming the file, or loads a model whose logits equal the independent reader's
(transformers' GGUF loader called directly: gguf-py's dequantize and transformers' float model; given the config
qcore read where transformers reads the metadata otherwise), which must then report no parameter left randomly
initialised. Never another exception, a hang (each call under a 30 s alarm), a write (the folder and the file
unchanged), nor memory beyond the bounds below:

- the header readers: Python's allocations (``tracemalloc``) peak below 4x the file's size + 64 KiB;
- every loader: the process's peak RSS (``ru_maxrss``) grows, over the whole run, by less than 4x the file's size
  plus 64 MiB (the models qcore and transformers build and the libraries' caches), and the address space is
  capped (``RLIMIT_AS``: what the process has mapped + 4 GiB) while the fuzz runs, so an allocation a header number
  asks for is a ``MemoryError`` (a failure) rather than the machine's OOM killer.

Examples: ``FUZZ_EXAMPLES`` per source by default (seconds), ``SLOW_EXAMPLES`` under ``-m slow``."""

import contextlib
import math
import os
import resource
import shutil
import struct
import sys
import tempfile
import tracemalloc
import pathlib

import pytest
import torch

from qcore.formats import gguf as G

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import qcore  # noqa: E402
from gguf_bytes import Parts, value_bytes  # noqa: E402
from gguf_kit import tiny_tokenizer, token_ids  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "fuzz"))  # the fuzz targets' kit
from fuzz_kit import deadline  # noqa: E402

from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.gguf import check_gguf_file, export_gguf, from_gguf  # noqa: E402
from qcore.adapters.jobs.common import CommandError, load_model  # noqa: E402

FUZZ_EXAMPLES = 40
SLOW_EXAMPLES = 400
TIMEOUT_S = 30
SLACK = 64 << 20
HEADER_FLOOR = 64 << 10  # a reader's fixed cost (an exception, its message, the path)
INTS = [0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 63, 64, 65, 127, 128, 129, 255, 256, 4096, 1 << 31, (1 << 32) - 1,
        1 << 40, (1 << 63) - 1]
FLOATS = [0.0, -0.0, -1.0, 1e-6, 0.5, 1.0, 10000.0, 1e38, math.nan, math.inf, -math.inf]
STRINGS = ["", "llama", "gpt2", "falcon", "qwen3moe", "linear", "yarn", "\u00e9", "x" * 300]
RANGES = {0: (0, 255), 1: (-128, 127), 2: (0, 65535), 3: (-32768, 32767), 4: (0, (1 << 32) - 1),
          5: (-(1 << 31), (1 << 31) - 1), 10: (0, (1 << 64) - 1), 11: (-(1 << 63), (1 << 63) - 1)}


# ---------------------------------------------------------------------------------------------------------------
# the sources
# ---------------------------------------------------------------------------------------------------------------

def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2():
    # n_positions 1024: transformers' GGUF reader builds GPT-2 with its default (it does not read context_length)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=1024, bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


SPECS = {"q8_0": qcore.make_spec("int8", granularity=qcore.PerGroup(32, axis=-1), scale_dtype="float16"),
         "q4_1": qcore.make_spec("uint4", granularity=qcore.PerGroup(32, axis=-1), scale_dtype="float16",
                                 symmetric=True)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``{name: path}``: the tiny Llama (Q8_0, tied head) and GPT-2 (Q4_1) exports with the tiny tokenizer; each
    read once by every loader (warming their caches before the memory baseline)."""
    d = tmp_path_factory.mktemp("fuzz_sources")
    out = {}
    for name, build, spec in (("llama", _llama, "q8_0"), ("gpt2", _gpt2, "q4_1")):
        m = build()
        quantize_model(m, ModelConfig(LayerConfig(weight=SPECS[spec])), [torch.randint(0, 128, (1, 8))],
                       progress=False)
        out[name] = d / f"{name}.gguf"
        export_gguf(m, out[name], tokenizer=tiny_tokenizer())
        _read_all(out[name])
    return out


# ---------------------------------------------------------------------------------------------------------------
# mutations
# ---------------------------------------------------------------------------------------------------------------

def _scalar(vtype, draw) -> bytes:
    if vtype == 8:
        return value_bytes(8, draw(st.sampled_from(STRINGS)))
    if vtype == 7:
        return value_bytes(7, draw(st.booleans()))
    if vtype in (6, 12):
        v = draw(st.sampled_from(FLOATS))
        return value_bytes(vtype, v) if vtype == 12 or abs(v) < 3e38 or not math.isfinite(v) else value_bytes(6, 1.0)
    lo, hi = RANGES[vtype]
    v = draw(st.sampled_from(INTS + [-1, -(1 << 31)]))
    return value_bytes(vtype, min(max(v, lo), hi))


def _mutate(p: Parts, draw) -> list:
    """One structural mutation of ``p`` (in place); returns a short description (hypothesis prints the draws)."""
    kinds = ["count"] + (["value", "nudge", "nudge", "retype", "key_twice", "drop_key", "array_item"] if p.kvs
                         else []) + (
        ["dims", "ndims", "type", "offset", "drop_tensor", "cut_tensor", "rename_tensor"] if p.tensors else [])
    kind = draw(st.sampled_from(kinds))
    if kind in ("value", "nudge", "retype", "key_twice", "drop_key", "array_item"):
        i = draw(st.integers(0, len(p.kvs) - 1))
        key, vtype, raw = p.kvs[i]
        if kind == "nudge":  # a plausible value: a number doubled, halved or one more, a string one letter longer
            if vtype in (6, 12):
                v = struct.unpack("<f" if vtype == 6 else "<d", raw)[0] * draw(st.sampled_from([0.5, 2.0]))
                p.kvs[i] = [key, vtype, value_bytes(vtype, v)]
            elif vtype in RANGES:
                lo, hi = RANGES[vtype]
                v = int.from_bytes(raw, "little", signed=lo < 0) + draw(st.sampled_from([-1, 1]))
                p.kvs[i] = [key, vtype, value_bytes(vtype, min(max(v, lo), hi))]
            elif vtype == 8:
                p.kvs[i] = [key, vtype, value_bytes(8, raw[8:] + b"x")]
        elif kind == "value":
            t = draw(st.sampled_from(([vtype] if vtype != 9 else []) + [4, 5, 6, 7, 8, 10, 11, 12]))
            p.kvs[i] = [key, t, _scalar(t, draw)]
        elif kind == "retype":  # the same stored bytes read as another type (an unknown one too)
            p.kvs[i] = [key, draw(st.integers(0, 13)), raw]
        elif kind == "key_twice":
            p.kvs.insert(draw(st.integers(0, len(p.kvs))), list(p.kvs[i]))
        elif kind == "drop_key":
            del p.kvs[i]
        elif vtype == 9 and len(raw) > 12:  # an array: its element type or its length
            item, n = struct.unpack_from("<IQ", raw)
            if draw(st.booleans()):
                item = draw(st.integers(0, 13))
            else:
                n = draw(st.sampled_from([0, 1, max(n - 1, 0), n + 1, 1 << 40]))
            p.kvs[i] = [key, vtype, struct.pack("<IQ", item, n) + raw[12:]]
        return [kind, key]
    if kind == "count":
        which = draw(st.sampled_from(["tensor_count", "kv_count"]))
        setattr(p, which, draw(st.sampled_from([0, 1, len(p.tensors) - 1, len(p.kvs) + 1, 1 << 40, (1 << 64) - 1])))
        return [kind, which]
    j = draw(st.integers(0, len(p.tensors) - 1))
    t = p.tensors[j]
    if kind == "dims" and not t[1]:
        t[1] = [draw(st.sampled_from(INTS))]
    elif kind == "dims":
        k = draw(st.integers(0, len(t[1]) - 1))
        t[1][k] = draw(st.sampled_from(INTS + [t[1][k] * 2, t[1][k] // 2 or 1]))
    elif kind == "ndims":
        t[1] = draw(st.sampled_from([[], t[1][:1], t[1] + [1], [math.prod(t[1])], list(reversed(t[1])), [1] * 5]))
    elif kind == "type":
        t[2] = draw(st.sampled_from(sorted(G.GGML_SIZES) + [4, 5, 36, 99]))
    elif kind == "offset":
        offs = [x[3] for x in p.tensors]
        t[3] = draw(st.sampled_from(offs + [t[3] + 32, t[3] + 1, max(t[3] - 32, 0), len(p.data), 1 << 40]))
    elif kind == "drop_tensor":
        p.drop(t[0])
    elif kind == "cut_tensor":  # the record gone, its data left
        del p.tensors[j]
    elif kind == "rename_tensor":
        t[0] = draw(st.sampled_from(["blk.2.attn_q.weight", "blk.0.attn_q.bias", "output.weight", "x",
                                     p.tensors[(j + 1) % len(p.tensors)][0], "blk.1." + t[0]]))
    return [kind, t[0]]


def _mutated(src: pathlib.Path, draw, *, header_only: bool = False) -> tuple:
    """The bytes of ``src`` with one structural mutation (half the examples: many of them load), or 0 to 3 of them
    and then 0 to 3 byte flips in the header and maybe a cut."""
    p = Parts.of(src)
    one = draw(st.booleans())
    done = [_mutate(p, draw) for _ in range(1 if one else draw(st.integers(0 if not header_only else 1, 3)))]
    data = bytearray(p.bytes())
    head = len(data) - len(p.data)
    for _ in range(0 if one else draw(st.integers(0, 3))):
        i = draw(st.integers(0, head - 1))
        data[i] ^= draw(st.integers(1, 255))
        done.append(["flip", i])
    if not header_only and not one and draw(st.integers(0, 4)) == 0:
        n = draw(st.integers(0, len(data) - 1))
        del data[n:]
        done.append(["truncate", n])
    if not done:
        done.append(["none"])
    return bytes(data), done


# ---------------------------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------------------------

def _outcome(path: pathlib.Path, fn):
    """``(value, None)`` or ``(None, message)`` for a one-line ValueError / CommandError naming the file; any
    other exception (a hang's too) propagates."""
    try:
        with deadline(TIMEOUT_S):  # a BaseException: no reader's `except Exception` can swallow a hang
            return fn(path), None
    except (ValueError, CommandError) as e:
        msg = str(e)
        assert "\n" not in msg.strip(), f"{fn}: a message of more than one line: {msg!r}"
        assert str(path) in msg, f"{fn}: the message does not name the file: {msg!r}"
        return None, msg


def _independent(path: pathlib.Path):
    """transformers' GGUF loader, called directly (gguf-py's dequantize, transformers' float model), with no
    parameter left unloaded. Where transformers reads the metadata otherwise than qcore (GPT-2 without
    gpt2.vocab_size: transformers' default 50257 rows), the same loader given the config qcore read
    (``check_gguf_file(...).config``): the tensors still gguf-py's, placed by transformers' own name map."""
    def load(**kw):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, output_loading_info=True,
            ignore_mismatched_sizes=True, **kw)
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        return model.eval()
    try:
        return load()
    except (AssertionError, RuntimeError, ValueError, KeyError):
        return load(config=check_gguf_file(path, reader="transformers").config)


def _logits(model):
    with torch.no_grad():
        return model(token_ids()).logits


HEADER_READERS = {"read_header": G.read_header, "check_file": G.check_file, "check_model_file": G.check_model_file}


def _read_all(path: pathlib.Path) -> dict:
    """Every loader on ``path``; their outcomes. Asserts the oracle (see the module docstring)."""
    size = max(path.stat().st_size, 1)
    out = {}
    for name, fn in HEADER_READERS.items():
        tracemalloc.start()
        try:
            out[name] = _outcome(path, fn)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * size + HEADER_FLOOR, f"{name}: {peak} bytes traced for a file of {size}"
    gate = _outcome(path, lambda p: check_gguf_file(p, reader="transformers"))
    ours = _outcome(path, from_gguf)
    theirs = _outcome(path, lambda p: load_model(str(p), dtype=torch.float32, device="cpu")[0])
    if out["check_model_file"][1] is not None:  # the header gate refused: so do all
        assert gate[1] is not None and ours[1] is not None and theirs[1] is not None, (gate, ours, theirs)
    if gate[1] is not None:
        assert ours[1] is not None and theirs[1] is not None, (gate, ours, theirs)
    if ours[0] is not None or theirs[0] is not None:
        want = _logits(_independent(path))
        for model in (ours[0], theirs[0]):
            if model is not None:
                got = _logits(model)
                assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    return dict(out, gate=gate, from_gguf=ours, load_model=theirs)


@contextlib.contextmanager
def _address_space_cap(extra: int = 4 << 30):
    """RLIMIT_AS at what the process maps now + ``extra``: a runaway allocation is a MemoryError."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _fuzz(src: pathlib.Path, data, counts: dict, *, header_only: bool = False):
    raw, done = _mutated(src, data.draw, header_only=header_only)
    data.draw(st.just(done), label="mutations")
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "m.gguf"
        path.write_bytes(raw)
        res = _read_all(path)
        assert os.listdir(d) == ["m.gguf"] and path.read_bytes() == raw  # nothing written
    loaded = res["from_gguf"][0] is not None or res["load_model"][0] is not None
    counts["examples"] += 1
    counts["loaded"] += loaded


def _run(sources, n: int):
    counts = {"examples": 0, "loaded": 0}
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = max(p.stat().st_size for p in sources.values())

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.sampled_from(sorted(sources)), st.data())
    def fuzz(name, data):
        _fuzz(sources[name], data, counts)

    with _address_space_cap():
        fuzz()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    assert grown < 4 * size + SLACK, f"peak RSS grew by {grown} bytes"
    print(f"gguf fuzz: {counts['examples']} examples, {counts['loaded']} loaded, peak RSS +{grown >> 20} MiB")
    return counts


def test_the_sources_load_and_agree(sources):
    for path in sources.values():
        res = _read_all(path)
        assert all(v[1] is None for v in res.values()), res


def test_gguf_fuzz(sources):
    counts = _run(sources, FUZZ_EXAMPLES)
    assert counts["examples"] >= FUZZ_EXAMPLES // 2


@pytest.fixture(scope="module")
def more_sources(sources, zoo, tmp_path_factory):
    """``sources`` and Q8_0 exports of the tiny Qwen3-MoE (fused experts), Gemma2 and Phi-3 (fused attn_qkv)."""
    d = tmp_path_factory.mktemp("fuzz_more")
    out = dict(sources)
    for fam in ("qwen3_moe", "gemma2", "phi3"):
        m = zoo.tiny_family(fam)
        quantize_model(m, ModelConfig(LayerConfig(weight=SPECS["q8_0"])), [torch.randint(0, 128, (1, 8))],
                       progress=False)
        out[fam] = d / f"{fam}.gguf"
        export_gguf(m, out[fam], tokenizer=tiny_tokenizer())
        _read_all(out[fam])
    return out


@pytest.mark.slow
def test_gguf_fuzz_many(more_sources):
    counts = _run(more_sources, SLOW_EXAMPLES)
    assert counts["examples"] >= SLOW_EXAMPLES // 2


@pytest.mark.real_model
@pytest.mark.slow
def test_gguf_fuzz_smollm2_header(tmp_path):
    """The embedded SmolLM2 Q4_1 file, its header mutated (the data region kept): the header readers and the gate
    (``check_gguf_file``: the skeleton on the meta device), each a refusal in one line or a pass."""
    from qcore.adapters.eval.models import smollm2_path
    src = tmp_path / "smol.gguf"
    shutil.copyfile(smollm2_path(), src)
    counts = {"examples": 0}

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(st.data())
    def fuzz(data):
        raw, done = _mutated(src, data.draw, header_only=True)
        data.draw(st.just(done), label="mutations")
        path = tmp_path / "m.gguf"
        path.write_bytes(raw)
        outs = [_outcome(path, fn) for fn in list(HEADER_READERS.values()) + [check_gguf_file]]
        if outs[2][1] is not None:
            assert outs[3][1] is not None
        counts["examples"] += 1

    with _address_space_cap():
        fuzz()
    print(f"gguf fuzz (SmolLM2 header): {counts['examples']} examples")

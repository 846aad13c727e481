"""SVDQuant's algo_config against amd-quark 0.13: Quark builds its SVDQuantConfig from qcore's ``to_quark()`` and
gives the same values back; a checkpoint carrying SVDQuant's branch says quant_method "qcore" (Quark has no
export layout for it), so Quark's loaders refuse rather than mis-load it (docs/export.md)."""

import json
import subprocess

from qcore.algorithms.config import SVDQuantConfig, parse_algorithm

SNIPPET = """
import dataclasses, json, sys
from quark.torch.quantization.config.config import SVDQuantConfig
c = SVDQuantConfig(**json.loads(sys.argv[1]))
print("RESULT " + json.dumps(dataclasses.asdict(c)))
"""


def test_quark_builds_our_svdquant_config(quark_python):
    ours = SVDQuantConfig(rank=16, alpha=0.3, search_alpha=False, alpha_candidates=[0.2, 0.4], search_samples=4,
                          use_gptq=True, block_size=64, damp=0.05, act_order=True)
    r = subprocess.run([str(quark_python), "-c", SNIPPET, json.dumps(ours.to_quark())], capture_output=True,
                       text=True, timeout=900, env={"PATH": "/usr/bin:/bin", "HOME": str(__import__("pathlib").Path.home())})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for k, v in ours.to_quark().items():
        assert got[k] == v, k
    assert parse_algorithm(got) == ours  # Quark's full dict (with its own extra keys) reads back

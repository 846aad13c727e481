"""AWQ on SmolLM2-135M, the landed scale search against the two-pass one, alternating in one process.

    python bench/bench_awq_ab.py [--layers 4] [--batches 8] [--rounds 2] [--threads 2] [--md PATH]

Runs ``quantize_model(model, uint4 g64 asym + AWQ, data)`` ``--rounds`` times with
``qcore.algorithms.awq._reference_awq_search`` (the landed one-pass float64 search: old) and ``awq_search``
(new) alternately (old, new, old, new, ...: the alternation cancels most of a shared machine's load drift), times
the whole call and the search calls, and checks that every quantized tensor of the two models is identical.
The reference is one float forward of the same (reduced) model over the same tokens, measured in the same
process. Prints a markdown table (and writes it with ``--md``).
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="first N decoder layers (0: all)")
    p.add_argument("--batches", type=int, default=8, help="calibration windows of 512 tokens (protocol: 32)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--md", default=None)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from qcore.adapters import preset, quantize_model
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.eval import models
    from qcore.adapters.passes import scaling_bind
    from qcore.algorithms import awq

    torch.set_num_threads(args.threads)
    model, tok = models.load_smollm2()
    if args.layers:
        model.model.layers = model.model.layers[:args.layers]
        model.config.num_hidden_layers = args.layers
    ids = E.protocol_token_ids(tok, text=E.pydoc_text())
    data = E.calibration_batches(None, token_ids=ids, n=args.batches)
    config = preset("w_uint4_per_group_asym", group_size=64).replace(algorithms=({"name": "awq"},))
    load0 = os.getloadavg()
    with torch.no_grad():
        model(data[0])
        t0 = time.perf_counter()
        for b in data:
            model(b)
        float_s = time.perf_counter() - t0

    times = {"old": [], "new": []}
    search = {"old": [], "new": []}
    states = {}
    for _ in range(args.rounds):
        for name, fn in (("old", awq._reference_awq_search), ("new", awq.awq_search)):
            spent = [0.0]

            def timed(*a, _fn=fn, _spent=spent, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    _spent[0] += time.perf_counter() - t

            scaling_bind.awq_search = timed
            try:
                m = copy.deepcopy(model)
                t0 = time.perf_counter()
                quantize_model(m, config, data, progress=False)
                times[name].append(time.perf_counter() - t0)
            finally:
                scaling_bind.awq_search = awq.awq_search
            search[name].append(spent[0])
            sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
            if name in states:
                same_self = all(torch.equal(sd[k], states[name][k]) for k in sd)
                if not same_self:
                    raise SystemExit(f"{name}: two runs gave different weights")
            states[name] = sd
            del m
            print(f"{name}: {times[name][-1]:.2f} s (search {spent[0]:.2f} s)", flush=True)
    same = states["old"].keys() == states["new"].keys() and all(
        torch.equal(states["old"][k], states["new"][k]) for k in states["old"])
    load1 = os.getloadavg()
    lo, ln = min(times["old"]), min(times["new"])
    so, sn = min(search["old"]), min(search["new"])
    md = "\n".join([
        f"Machine: {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), Python "
        f"{platform.python_version()}; load average {tuple(round(v, 2) for v in load0)} -> "
        f"{tuple(round(v, 2) for v in load1)}. SmolLM2-135M, {args.layers or 'all'} decoder layers, "
        f"{args.batches} x 512 calibration tokens, uint4 g64 asym + AWQ; float forward over the same tokens in the "
        f"same process: **{float_s:.2f} s**. Old = `_reference_awq_search` (the landed search), new = "
        f"`awq_search`, alternating, {args.rounds} rounds each (best of the rounds in the ratios).",
        "",
        "```",
        "python bench/bench_awq_ab.py " + " ".join(sys.argv[1:]),
        "```",
        "",
        "| | quantize_model s (rounds) | x float fwd | awq_search s (rounds) | search share |",
        "|---|---|---|---|---|",
        f"| old | {[round(v, 2) for v in times['old']]} | {lo / float_s:.2f} | "
        f"{[round(v, 2) for v in search['old']]} | {100 * so / lo:.0f} % |",
        f"| new | {[round(v, 2) for v in times['new']]} | {ln / float_s:.2f} | "
        f"{[round(v, 2) for v in search['new']]} | {100 * sn / ln:.0f} % |",
        "",
        f"Speed-up: search {so / sn:.2f}x, whole run {lo / ln:.2f}x (best rounds). Every quantized tensor of the "
        f"two models identical: **{same}**.",
        "",
    ])
    print(md)
    if args.md:
        pathlib.Path(args.md).write_text(md)
    if not same:
        raise SystemExit("old and new weights differ")


if __name__ == "__main__":
    main()

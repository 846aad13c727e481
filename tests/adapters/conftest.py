"""Adapters tests run offline: nothing may reach a model hub (the loaders also pass local_files_only=True).

``OMP_WAIT_POLICY=PASSIVE`` (unless set already; effective only if torch is not imported yet, which holds
when these tests are collected first, as in the default run): torch's OpenMP threads sleep instead of spinning
while they wait. On this shared 2-core machine a model forward with 2 threads then costs the same as without it
on an idle machine, and about 2.7 s instead of 4-11 s per 512-token SmolLM2 window when another process keeps a
core busy (measured; see bench/bench_quality.py).
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

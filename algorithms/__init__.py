"""qcore.algorithms: reserved for quantization algorithms as pure functions over weights and statistics.
Depends on qcore only. Empty so far: the algorithms are planned."""

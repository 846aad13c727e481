"""qcore.algorithms: reserved for quantization algorithms as pure functions over weights and statistics.
Depends on qcore only. So far: ``metrics`` (perplexity math, MSE, SQNR, cosine); GPTQ, AWQ, SmoothQuant and rotations are planned."""

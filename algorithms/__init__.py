"""qcore.algorithms: reserved for quantization algorithms as pure functions over weights and statistics.
Depends on qcore only. So far: ``metrics`` (perplexity math, MSE, SQNR, cosine), ``awq`` (AWQ scale and clipping
search), ``smoothquant`` (SmoothQuant scales, AutoSmoothQuant); GPTQ and rotations are planned. Scales are folded
into models by ``qcore.adapters.scaling``."""

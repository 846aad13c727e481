"""qcore.algorithms: quantization algorithms as pure functions over weights and statistics (numpy or torch).

Depends on qcore only: ``metrics`` (perplexity math, MSE, SQNR, cosine), ``gptq`` (GPTQ; ``gptq_core``: the Hessian
statistics and the pieces every GPTQ flavour shares; ``gptq_gguf``, ``gptaq``, ``qronos``, ``paired``),
``awq`` (AWQ scale and clipping search), ``smoothquant`` (SmoothQuant scales, AutoSmoothQuant), ``hadamard``
(Hadamard matrices of many orders, the fast transform, orthogonal rotations of every size), ``mixed_precision``
(one scheme per layer within a bit or loss budget, from measured sensitivities), ``config`` (their
settings, qcore's and Quark's ``algo_config`` keys). Bound to models one decoder layer at a time by
``qcore.adapters.passes.sequential``; scales are folded into models by ``qcore.adapters.passes.scaling``."""

"""qcore.algorithms: quantization algorithms (GPTQ, AWQ, SmoothQuant, rotations, observers) as pure functions
over weights and statistics. Depends on qcore only. Empty until the algorithm issues land."""

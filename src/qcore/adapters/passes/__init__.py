"""Passes over a model: the one layer runner and what runs on it (GPTQ, AWQ, SmoothQuant, rotations,
AMP sensitivities, streaming quantization of checkpoints larger than memory)."""

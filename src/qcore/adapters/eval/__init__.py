"""Evaluation: perplexity and sentence embeddings, lm-eval tasks, the embedded real models, and the
per-layer report."""

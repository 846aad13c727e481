"""``QuantEmbedding`` and ``QuantEmbeddingBag``: a quantized table (rows are the canonical output axis) and an
optional output quantization (their input is indices)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import QuantModule

__all__ = ["QuantEmbedding", "QuantEmbeddingBag"]


class QuantEmbedding(QuantModule, nn.Embedding):
    """``nn.Embedding`` with a quantized table (rows = canonical output axis) and optional output quantization."""

    _index_input = True

    def _features(self, role):
        return self.embedding_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.embedding(x, self._w(), self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                        self.sparse)
        return self._qact(y, "output")


class QuantEmbeddingBag(QuantModule, nn.EmbeddingBag):
    """``nn.EmbeddingBag`` with a quantized table and optional output quantization."""

    _index_input = True

    def _features(self, role):
        return self.embedding_dim

    def forward(self, x: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = F.embedding_bag(x, self._w(), offsets, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                            self.mode, self.sparse, per_sample_weights, self.include_last_offset, self.padding_idx)
        return self._qact(y, "output")

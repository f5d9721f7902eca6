"""Recurrent models: an LSTM language model, a GRU classifier."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precondfx import demo
from tests.zoo.registry import HAS_TRANSFORMERS, _register, _seeded


# ---------------------------------------------------------------------------
# 13/14. recurrent models
# ---------------------------------------------------------------------------


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 32, num_layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=num_layers, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.embedding.weight  # tied weights

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embedding(tokens))
        return self.decoder(h)


@_register("lstm_lm", "recurrent", "embedding", "tied")
def lstm_lm(seed: int = 0, *, vocab: int = 100, dim: int = 32, seq: int = 12, batch: int = 4) -> tuple[nn.Module, Any]:
    """LSTM language model: Embedding + LSTM + Linear decoder tied to the embedding weight."""

    def make() -> tuple[nn.Module, Any]:
        return LSTMLM(vocab, dim), torch.randint(0, vocab, (batch, seq))

    return _seeded(make, seed)


class GRUClassifier(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.embedding(tokens))
        return self.fc(h[:, -1])


@_register("gru_classifier", "recurrent", "embedding")
def gru_classifier(seed: int = 0, *, vocab: int = 100, seq: int = 12, batch: int = 4, num_classes: int = 4) -> tuple[nn.Module, Any]:
    """Embedding + GRU(batch_first) + Linear on the last time step."""

    def make() -> tuple[nn.Module, Any]:
        return GRUClassifier(vocab, num_classes=num_classes), torch.randint(0, vocab, (batch, seq))

    return _seeded(make, seed)

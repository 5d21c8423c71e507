"""The models of PyTorch's word-language-model example (``examples/word_language_model/model.py``),
tiny: an LSTM language model and an ``nn.Transformer``-based one. Imports torch only, so that a
process where tblog_hooks cannot be imported loads the checkpoints of their classes."""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn

TOKENS = 40


class RNNModel(nn.Module):
    """Encoder, recurrent module and decoder, as the example's."""

    def __init__(self, ntoken: int = TOKENS, ninp: int = 12, nhid: int = 12, nlayers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers

    def forward(self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, object]:
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 64):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pe[: x.size(0), :])


class TransformerModel(nn.Transformer):
    """The example's: an ``nn.Transformer`` whose encoder is used, its ``decoder`` replaced by a Linear."""

    def __init__(self, ntoken: int = TOKENS, ninp: int = 16, nhead: int = 2, nhid: int = 24, nlayers: int = 2):
        super().__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid, num_encoder_layers=nlayers, dropout=0.2)
        self.src_mask: torch.Tensor | None = None
        self.pos_encoder = PositionalEncoding(ninp, 0.2)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)  # type: ignore[assignment]

    def forward(self, src: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.src_mask is None or self.src_mask.size(0) != len(src):
            self.src_mask = torch.log(torch.tril(torch.ones(len(src), len(src))))
        src = self.pos_encoder(self.input_emb(src) * math.sqrt(self.ninp))
        output = self.decoder(self.encoder(src, mask=self.src_mask))
        return F.log_softmax(output, dim=-1)


def outputs(model: nn.Module, data: torch.Tensor) -> torch.Tensor:
    """The example's ``evaluate``: the model's log-probabilities for ``data`` (sequence x batch) in
    eval mode, without gradients."""
    model.eval()
    with torch.no_grad():
        if isinstance(model, RNNModel):
            return model(data, model.init_hidden(data.size(1)))[0]
        return model(data)


def resolve(names: list[str]) -> list[object]:
    """The globals named ``module.name`` (as ``torch.serialization.get_unsafe_globals_in_checkpoint``
    lists them), for ``torch.serialization.safe_globals``."""
    found = []
    for name in names:
        module, _, attribute = name.rpartition(".")
        found.append(getattr(importlib.import_module(module), attribute))
    return found

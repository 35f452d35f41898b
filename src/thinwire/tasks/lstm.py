"""A multi-layer LSTM language model over a small vocabulary (bytes by default)."""

from __future__ import annotations

from torch import Tensor, nn


class LSTMLanguageModel(nn.Module):
    """Embedding -> ``layers`` stacked LSTM layers -> linear decoder to next-token logits.

    ``tie_weights`` shares the embedding matrix with the decoder (Press & Wolf, 2017),
    which needs ``embed_size == hidden_size``. Every forward starts from a zero state.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        embed_size: int = 128,
        hidden_size: int = 512,
        layers: int = 2,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        if tie_weights and embed_size != hidden_size:
            raise ValueError(
                f"tie_weights needs embed_size == hidden_size, got {embed_size} and {hidden_size}"
            )
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.lstm = nn.LSTM(embed_size, hidden_size, num_layers=layers, batch_first=True)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if tie_weights:
            self.decoder.weight = self.embedding.weight
        else:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits (batch, time, vocab) predicting each next token of ``tokens`` (batch, time)."""
        hidden, _ = self.lstm(self.embedding(tokens))
        return self.decoder(hidden)

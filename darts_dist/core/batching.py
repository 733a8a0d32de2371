"""Batches of sequences of different lengths: padded into one tensor, and each token's position in its own row."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from darts_dist.errors import DartsError

Side = Literal["right", "left"]


def pad_rows(rows: Sequence[Tensor | np.ndarray | Sequence[int]], value: float = 0, side: Side = "right") -> Tensor:
    """Rows [L_i, ...] padded with `value` into one [B, max L_i, ...] tensor, on the right or on the left."""
    # Arrays are copied: rows from Ray Data are read-only views into the object store.
    tensors = [row if isinstance(row, Tensor) else torch.tensor(np.asarray(row)) for row in rows]
    return pad_sequence(tensors, batch_first=True, padding_value=value, padding_side=side)


def token_batch(sequences: Sequence[Sequence[int]], pad_id: int, side: Side = "right") -> tuple[Tensor, Tensor]:
    """input_ids and attention_mask [B, max L_i] of token-id lists.

    Right padding keeps every row's tokens at positions 0..n−1 (training, scoring, routing);
    left padding puts every row's next token in the same column (generation).
    """
    ids = pad_rows([torch.as_tensor(s, dtype=torch.long) for s in sequences], pad_id, side)
    mask = pad_rows([torch.ones(len(s), dtype=torch.long) for s in sequences], 0, side)
    return ids, mask


@dataclass(frozen=True)
class TokenizedSet:
    """One task's tokenised samples, right-padded to the longest row.

    `num_truncated` is derived from the per-row `truncated` flags so that `subset` keeps it right.
    """

    task: str
    input_ids: torch.LongTensor  # [N, L], right-padded with the pad token
    attention_mask: torch.LongTensor  # [N, L], 1 on real tokens
    response_mask: torch.BoolTensor  # [N, L], True on response tokens (all real tokens for plain text)
    has_boundary: bool  # whether the data marked a prompt/response boundary
    truncated: torch.BoolTensor  # [N], True where the sample was cut to max_length

    @property
    def num_truncated(self) -> int:
        return int(self.truncated.sum())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batches(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Consecutive batches in order, each trimmed to its own longest row."""
        if batch_size < 1:
            raise DartsError(f"batch_size must be at least 1, got {batch_size}")
        for start in range(0, len(self), batch_size):
            rows = slice(start, start + batch_size)
            length = int(self.attention_mask[rows].sum(dim=1).max())
            yield {
                "input_ids": self.input_ids[rows, :length],
                "attention_mask": self.attention_mask[rows, :length],
                "response_mask": self.response_mask[rows, :length],
            }

    @classmethod
    def from_rows(
        cls, task: str, rows: Sequence[tuple[Sequence[int], Sequence[bool]]], pad_id: int, has_boundary: bool,
        truncated: Sequence[bool] | None = None,
    ) -> TokenizedSet:
        """Token ids with their response masks, right-padded into one set."""
        input_ids, attention_mask = token_batch([ids for ids, _ in rows], pad_id)
        response_mask = pad_rows([torch.as_tensor(mask, dtype=torch.bool) for _, mask in rows], False)
        cut = torch.zeros(len(rows), dtype=torch.bool) if truncated is None else torch.as_tensor(truncated)
        return cls(task=task, input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                   has_boundary=has_boundary, truncated=cut.bool())

    def subset(self, indices: Sequence[int] | torch.Tensor) -> TokenizedSet:
        """The rows at `indices`, in that order, trimmed to their longest row."""
        index = torch.as_tensor(indices, dtype=torch.long)
        if index.numel() == 0:
            raise DartsError(f"an empty subset of the {self.task!r} set was asked for", "pass at least one index")
        length = int(self.attention_mask[index].sum(dim=1).max())
        return TokenizedSet(
            task=self.task,
            input_ids=self.input_ids[index, :length],
            attention_mask=self.attention_mask[index, :length],
            response_mask=self.response_mask[index, :length],
            has_boundary=self.has_boundary,
            truncated=self.truncated[index],
        )

"""The next token of each sequence of a batch, each by its own settings and its own random generator.

A sequence's draws come from a `torch.Generator` of its own, seeded by its request, so a seeded
request gives the same text whatever it is batched with (the logits of a row do not depend on
its companions beyond float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# Below this a temperature is greedy decoding: its distribution is the argmax up to rounding, and dividing the
# logits by it would overflow to inf (then NaN), failing the draw of every sequence in the batch.
GREEDY_BELOW = 1e-4


def new_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A sequence's generator: seeded by its request, else from fresh entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def top_p_probabilities(logits: Tensor, temperature: float | Tensor, top_p: float | Tensor) -> Tensor:
    """softmax(logits / T) over the nucleus: the most likely tokens whose mass first reaches top_p (at least one).

    Rows of [..., V] logits, each with its own temperature and top_p ([...] tensors, or one float for all), in one
    pass on the logits' device: no per-row loop and no host sync (a boolean index would be one per row)."""
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device)
    probs = torch.softmax(logits.float() / temperature[..., None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # The mass before a token is still short of top_p; a row with top_p 1 keeps every token (rounding in the sum
    # could otherwise cut its tail).
    keep = (sorted_probs.cumsum(-1) - sorted_probs < top_p[..., None]) | (top_p[..., None] >= 1.0)
    # The most likely token always: a top_p below fp32's smallest positive value compares as 0 against the probs.
    keep[..., 0] = True
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)


def next_tokens(
    logits: Tensor, temperatures: Sequence[float], top_ps: Sequence[float], generators: Sequence[torch.Generator]
) -> list[int]:
    """[B, V] last-position logits -> one token per row: the argmax where the temperature is 0 (below
    GREEDY_BELOW), else a draw from the row's nucleus with the row's generator.

    The sampled rows' nuclei are computed together, and each row draws by an exponential race (the argmax of
    p / E, E ~ Exp(1) from the row's own generator: a draw from p), so the only host sync is the tokens' list."""
    tokens = logits.argmax(-1)
    sampled = [row for row, temperature in enumerate(temperatures) if temperature >= GREEDY_BELOW]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        probs = top_p_probabilities(logits[rows], torch.tensor([temperatures[row] for row in sampled]),
                                    torch.tensor([top_ps[row] for row in sampled]))
        race = torch.stack([torch.empty_like(probs[0]).exponential_(generator=generators[row]) for row in sampled])
        tokens[rows] = (probs / race).argmax(-1)
    return tokens.tolist()

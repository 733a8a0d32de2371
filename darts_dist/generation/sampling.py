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


def top_p_probabilities(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """softmax(logits / T) over the nucleus: the most likely tokens whose mass first reaches top_p (at least one)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the mass before a token is still short of top_p
    # The most likely token always: a top_p below fp32's smallest positive value compares as 0 against the probs.
    keep[..., 0] = True
    return torch.zeros_like(probs).scatter_(-1, order[keep], sorted_probs[keep])


def next_tokens(
    logits: Tensor, temperatures: Sequence[float], top_ps: Sequence[float], generators: Sequence[torch.Generator]
) -> list[int]:
    """[B, V] last-position logits -> one token per row: the argmax where the temperature is 0 (below
    GREEDY_BELOW), else a draw from the row's nucleus with the row's generator."""
    tokens = logits.argmax(-1)
    for row, (temperature, top_p, generator) in enumerate(zip(temperatures, top_ps, generators)):
        if temperature >= GREEDY_BELOW:
            probs = top_p_probabilities(logits[row], temperature, top_p)
            tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens.tolist()

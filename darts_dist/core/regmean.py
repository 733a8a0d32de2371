"""RegMean (Jin et al. 2023, arXiv 2212.09849): the linear layer closest to every expert's on its own inputs.

For a linear layer y = x Wᵀ and experts k with inputs X_k (their task's real tokens), the merge minimises
Σ_k ‖X_k W − X_k W_k‖² / n_k, whose solution is W*ᵀ = (Σ_k G_k)⁻¹ Σ_k G_k W_kᵀ with G_k = X_kᵀX_k / n_k.
RegMean's reduction scales each G_k's off-diagonal entries by α: α = 1 is the plain least-squares merge, α = 0
weighs each input feature by its mean square (a diagonal-weighted average), and α between trades the two.
Grams are token means so every expert counts alike whatever its number of tokens (FusionBench's RegMean
averages the same way).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from darts_dist.core.hooks import decoder_layers


def reduced(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    """G̃ = α·G + (1 − α)·diag(G): the off-diagonal entries scaled by α, the diagonal kept."""
    return alpha * gram + (1.0 - alpha) * torch.diag_embed(torch.diagonal(gram))


def contribution(gram: torch.Tensor, weight: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's share of a layer's normal equations, in float64: G̃_k [in, in] and G̃_k W_kᵀ [in, out]."""
    g = reduced(gram.double(), alpha)
    return g, g @ weight.double().T


def solve(gram_sum: torch.Tensor, product_sum: torch.Tensor) -> torch.Tensor:
    """W* [out, in] from Σ G̃_k and Σ G̃_k W_kᵀ, in float64: Cholesky where the sum is positive definite, else
    the least-squares solution (an input feature no expert ever used has a zero row and column)."""
    factor, info = torch.linalg.cholesky_ex(gram_sum)
    if int(info) == 0:
        return torch.cholesky_solve(product_sum, factor).T
    return torch.linalg.lstsq(gram_sum, product_sum, driver="gelsd" if gram_sum.device.type == "cpu" else None).solution.T


def merge_linear(grams: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """The RegMean merge of one linear layer's weights [out, in] given each expert's Gram, in float64."""
    parts = [contribution(g, w, alpha) for g, w in zip(grams, weights, strict=True)]
    return solve(sum(g for g, _ in parts), sum(p for _, p in parts))


class GramRecorder:
    """Each decoder-layer linear's input Gram matrix X_kᵀX_k over the real tokens of the batches run inside
    `recording(model)`, in fp32 on the model's device.

    Linears fed the same tensor one after another (q, k and v; gate and up) share one Gram: `owner[name]` is the
    module whose Gram a module uses. `mask` is the batch's attention mask; padded positions add nothing."""

    def __init__(self) -> None:
        self.grams: dict[str, torch.Tensor] = {}
        self.tokens = 0
        self.owner: dict[str, str] = {}
        self.mask: torch.Tensor | None = None
        # The last linear's input and its owner: compared by identity, since a freed tensor's memory (and so its
        # address) may come back as another input of the same shape later in the forward.
        self._last: tuple[torch.Tensor, str] | None = None

    @staticmethod
    def linears(model: nn.Module, layer: int | None = None) -> dict[str, nn.Linear]:
        """Every nn.Linear inside the decoder layers (or decoder layer `layer` alone), by its name in the model (the
        weight is NAME.weight)."""
        layers = {id(module) for module in decoder_layers(model)} if layer is None else {id(decoder_layers(model)[layer])}
        found = {}
        for name, module in model.named_modules():
            if id(module) in layers:
                prefix = name + "."
                found |= {prefix + child: sub for child, sub in module.named_modules()
                          if isinstance(sub, nn.Linear)}
        return found

    def _hook(self, name: str):
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0]
            if self._last is not None and self._last[0] is x:  # fed what the linear before it was
                self.owner.setdefault(name, self._last[1])
                return
            self._last = (x, name)
            self.owner.setdefault(name, name)
            rows = x[self.mask.bool()] if self.mask is not None else x.reshape(-1, x.shape[-1])
            rows = rows.float()
            gram = rows.T @ rows
            self.grams[name] = self.grams[name] + gram if name in self.grams else gram
        return record

    @contextmanager
    def recording(self, model: nn.Module, layer: int | None = None) -> Iterator[GramRecorder]:
        """Record the linears of every decoder layer (or of layer `layer` alone) inside the block."""
        handles = [module.register_forward_pre_hook(self._hook(name))
                   for name, module in self.linears(model, layer).items()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def observing(self, attention_mask: torch.Tensor) -> Iterator[None]:
        """One batch's forward runs inside the block: its real tokens (the mask's) are what the Grams count."""
        self.mask = attention_mask
        try:
            yield
        finally:
            self._last = None
        self.tokens += int(attention_mask.sum())

    @torch.no_grad()
    def run(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """One batch through the decoder (no LM head: its input is not a decoder-layer linear's)."""
        with self.observing(attention_mask):
            model.model(input_ids=input_ids, attention_mask=attention_mask)

    def gram(self, name: str) -> torch.Tensor:
        """The token-mean Gram G = XᵀX / n of a linear's inputs."""
        return self.grams[self.owner[name]] / max(self.tokens, 1)

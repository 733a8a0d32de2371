"""Learned merge coefficients: θ(c)_p = θ_base,p + Σ_k c[g(p), k]·τ_k,p, with τ_k = θ_k − θ_base.

One coefficient per expert k and layer group g: g(p) is the decoder layer tensor p belongs to, or
OTHER (index L, after the L decoder layers) for every tensor outside them: embeddings, final norm, LM
head. This is task arithmetic with a weight per layer (Expert Merging, ProDistill); with every
c[g, k] = w_k it is mergekit's task_arithmetic at weights w_k, the merge it starts from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Decoder layers are `<prefix>.layers.<i>.` (Llama), `.h.<i>.` (GPT-2) or `.blocks.<i>.`.
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def layer_group(name: str, num_layers: int) -> int:
    """The group of tensor `name`: its decoder layer's index, or `num_layers` (OTHER) outside the layers."""
    found = _LAYER_INDEX.search(name)
    return int(found.group(1)) if found else num_layers


def layer_prefix(name: str) -> str | None:
    """The name's part up to and including its decoder layer index and dot ("model.layers.3."): a string that
    is in the names of that layer's tensors and of no other layer's (mergekit's parameter filters match on it)."""
    found = _LAYER_INDEX.search(name)
    return None if found is None else name[: found.end()]


@dataclass(frozen=True)
class TaskVectors:
    """τ_k of every tensor some expert changed, stacked over experts, with the base values they start from.

    Tensors no expert changed are left out: their merged value is the base's whatever the coefficients.
    """

    experts: tuple[str, ...]  # K names; the order is the coefficients' column order
    base: dict[str, Tensor]  # name -> θ_base (fp32)
    deltas: dict[str, Tensor]  # name -> [K, *shape] fp32: τ_k, zero where expert k left the tensor alone
    num_layers: int  # L: decoder layers of the architecture

    def __post_init__(self) -> None:
        if set(self.base) != set(self.deltas):
            raise ValueError("TaskVectors.base and .deltas must name the same tensors")
        for name, delta in self.deltas.items():
            if delta.shape != (len(self.experts), *self.base[name].shape):
                raise ValueError(f"task vector of {name} has shape {list(delta.shape)}, expected "
                                 f"[{len(self.experts)}, *{list(self.base[name].shape)}]")

    @classmethod
    def from_weights(cls, base: Mapping[str, Tensor], experts: Mapping[str, Mapping[str, Tensor]],
                     num_layers: int) -> TaskVectors:
        """From the base's and each expert's tensors by name (an expert may lack a tensor: unchanged)."""
        names = tuple(experts)
        deltas: dict[str, Tensor] = {}
        bases: dict[str, Tensor] = {}
        for name, value in base.items():
            base_value = value.float()
            rows = [experts[e][name].float() - base_value if name in experts[e] else torch.zeros_like(base_value)
                    for e in names]
            if any(row.any() for row in rows):
                bases[name] = base_value
                deltas[name] = torch.stack(rows)
        return cls(names, bases, deltas, num_layers)

    @property
    def num_groups(self) -> int:
        return self.num_layers + 1

    def group(self, name: str) -> int:
        return layer_group(name, self.num_layers)

    def changed_layers(self) -> list[int]:
        """The decoder layers some expert changed, in order."""
        return sorted({g for g in map(self.group, self.deltas) if g < self.num_layers})

    def to(self, device: torch.device | str) -> TaskVectors:
        return TaskVectors(self.experts, {n: t.to(device) for n, t in self.base.items()},
                           {n: t.to(device) for n, t in self.deltas.items()}, self.num_layers)

    def nbytes(self) -> int:
        """Memory the task vectors take: K × the changed tensors, fp32 (the base values add 1× more)."""
        return sum(d.numel() * d.element_size() for d in self.deltas.values())


class LayerwiseMerge(nn.Module):
    """The trainable coefficients c [L + 1, K] over fixed task vectors; its forward is θ(c) of every changed
    tensor, base + Σ_k c[g, k]·τ_k, differentiable in c.

    The base values and task vectors are frozen parameters, not buffers: ZeRO-3 partitions parameters, so
    between steps each worker keeps 1/N of them; a forward gathers them all (θ(c) needs every one).
    """

    def __init__(self, vectors: TaskVectors, init: Sequence[float], expert_tensors: Sequence[str] = ()) -> None:
        super().__init__()
        if len(init) != len(vectors.experts):
            raise ValueError(f"one initial coefficient per expert: {len(vectors.experts)} experts, {len(init)} values")
        self.experts = vectors.experts
        self.num_layers = vectors.num_layers
        self.names = tuple(vectors.deltas)
        self.groups = tuple(vectors.group(name) for name in self.names)
        # `expert_tensors`: changed tensors whose value in each expert the forward also returns ("NAME@k").
        self.expert_tensors = tuple(name for name in expert_tensors if name in vectors.deltas)
        self.base = nn.ParameterList([nn.Parameter(vectors.base[n], requires_grad=False) for n in self.names])
        self.deltas = nn.ParameterList([nn.Parameter(vectors.deltas[n], requires_grad=False) for n in self.names])
        start = torch.tensor([float(w) for w in init])
        self.coefficients = nn.Parameter(start.repeat(vectors.num_groups, 1))
        self.task_vector_bytes = vectors.nbytes()  # all of them, before any partitioning

    def forward(self) -> dict[str, Tensor]:
        out = {}
        for name, group, base, delta in zip(self.names, self.groups, self.base, self.deltas):
            out[name] = base + torch.tensordot(self.coefficients[group].to(delta.device), delta, dims=1)
            if name in self.expert_tensors:
                out |= {f"{name}@{k}": (base + delta[k]).detach() for k in range(len(self.experts))}
        return out


def coefficient_table(coefficients: Tensor, experts: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each expert's coefficient per group: {"0": {expert: c}, ..., "other": {...}} for c [L + 1, K]."""
    rows = coefficients.detach().cpu().tolist()
    label = [str(g) for g in range(len(rows) - 1)] + ["other"]
    return {label[g]: dict(zip(experts, row)) for g, row in enumerate(rows)}

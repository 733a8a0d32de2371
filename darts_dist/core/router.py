"""The task router's math: which task's correction a prompt needs, from the merged model's own hidden states.

DARTS needs a task per request; the router removes that need (DESIGN.md §1, Inference). It is a
multinomial logistic regression on the mean-pooled hidden state of the prompt at the surgery layer,
features standardised: p = softmax(W·(h − mean)/scale + b). Its probability of the top task is the
confidence: at or above the threshold the request gets that task's correction, below it none.

A softmax is confident far from every task too (a general instruction gets one task's correction, which pulls it
toward that task's expert), so the router also keeps each task's envelope, where that task's calibration prompts
lie, and abstains on a prompt outside its top task's (`Envelope`).
Fitting it is calibration's business (`darts_dist.calibrate.router`); here it is applied and stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from darts_dist.core.batching import token_batch
from darts_dist.core.correction import LayerKey
from darts_dist.core.hooks import merged_hidden
from darts_dist.core.io import read_tagged_header, read_tagged_tensors, write_tagged
from darts_dist.errors import DartsError

# The task a request names to be routed; config.RESERVED_TASKS keeps it from being a real task's name.
ROUTED = "auto"
ROUTER_FILE = "router.safetensors"
FORMAT = "darts-dist-router"
FORMAT_VERSION = 2  # 2: with the tasks' envelopes; a version 1 file (none) still loads
_HEADER_KEYS = ("tasks", "layer", "hidden_size", "threshold", "metadata")
_ENVELOPE_TENSORS = ("envelope_center", "envelope_spread", "envelope_radius")
# The least variance a standardised feature has within a task's envelope: a feature that never varies among a task's
# calibration prompts must not put every other prompt infinitely far.
_VARIANCE_FLOOR = 1e-3


class Routing(NamedTuple):
    """The router's decision for a batch: task index per sequence (−1: below the threshold, or outside the top
    task's envelope where the router abstains there), its confidence, every task's probability, and whether the
    prompt lies outside its top task's envelope."""

    task: Tensor  # [B] long
    confidence: Tensor  # [B]
    probabilities: Tensor  # [B, K]
    outside: Tensor  # [B] bool


class Envelope(NamedTuple):
    """Where each task's calibration prompts lie in the router's standardised features z: a diagonal Gaussian per
    task, and how far from it a prompt of the task may be.

    distance_k(z) = mean_j ((z_j − center_kj) / spread_kj)², the per-feature Mahalanobis distance to task k. A
    task's radius is the largest of its calibration prompts' distances, each to the envelope fit without it (leave
    one out: a prompt's distance to a fit that includes it is biased low, the more so the fewer the prompts), so
    it bounds what the task's unseen prompts reach; a task with a single prompt has no bound (radius inf).
    """

    center: Tensor  # [K, d]
    spread: Tensor  # [K, d]
    radius: Tensor  # [K]

    def distance(self, z: Tensor, task: Tensor) -> Tensor:
        """[B, d] standardised features -> [B] each one's distance to its `task`'s envelope."""
        return (((z - self.center[task]) / self.spread[task]) ** 2).mean(dim=-1)


def fit_envelope(z: Tensor, labels: Tensor, tasks: int) -> Envelope:
    """Each task's envelope from its calibration prompts' standardised features z [N, d] (labels [N]), in fp64."""
    z = z.double()
    centers, spreads, radii = [], [], []
    for task in range(tasks):
        own = z[labels == task]
        n = len(own)
        center = own.mean(dim=0)
        centers.append(center)
        spreads.append(own.var(dim=0, unbiased=False).clamp_min(_VARIANCE_FLOOR).sqrt())
        if n < 2:
            radii.append(torch.tensor(float("inf"), dtype=torch.float64))
            continue
        # Each prompt against the mean and variance of the other n − 1, from the sums, without n refits.
        others = (own.sum(dim=0) - own) / (n - 1)
        variance = ((own ** 2).sum(dim=0) - own ** 2) / (n - 1) - others ** 2
        radii.append((((own - others) ** 2) / variance.clamp_min(_VARIANCE_FLOOR)).mean(dim=-1).max())
    return Envelope(*(torch.stack(part).float() for part in (centers, spreads, radii)))


class TaskRouter:
    """softmax(W·(h − mean)/scale + b) over the tasks, for pooled prompt features h ∈ R^d."""

    def __init__(
        self,
        tasks: Sequence[str],
        layer: LayerKey,
        mean: Tensor,
        scale: Tensor,
        weight: Tensor,
        bias: Tensor,
        threshold: float = 0.5,
        envelope: Envelope | None = None,
        abstain_outside: bool = True,
    ) -> None:
        """`envelope`: the tasks' (a router without one never finds a prompt outside); `abstain_outside`: whether
        `route` gives a prompt outside its top task's envelope no task, as one below the threshold."""
        if not 0.0 <= threshold <= 1.0:
            raise DartsError(f"the router threshold must be in [0, 1], got {threshold}")
        self.tasks = tuple(tasks)
        self.layer = layer
        # Contiguous, as a loaded file's are: scikit-learn's coefficients come column-major, and a matmul over
        # another layout sums in another order, so a fitted router would route unlike its saved copy.
        self.mean, self.scale, self.weight, self.bias = (t.float().contiguous() for t in (mean, scale, weight, bias))
        self.threshold = threshold
        self.envelope = None if envelope is None else Envelope(*(t.float().contiguous() for t in envelope))
        self.abstain_outside = abstain_outside

    @property
    def hidden_size(self) -> int:
        return self.mean.shape[0]

    def standardised(self, hidden: Tensor) -> Tensor:
        """[B, d] pooled features -> the router's input (h − mean)/scale, fp32 on the CPU."""
        return (hidden.float().cpu() - self.mean) / self.scale

    def probabilities(self, hidden: Tensor) -> Tensor:
        """[B, d] pooled features -> [B, K] task probabilities."""
        return torch.softmax(self.standardised(hidden) @ self.weight.T + self.bias, dim=-1)

    def outside(self, hidden: Tensor, task: Tensor) -> Tensor:
        """[B] bool: whether each prompt lies beyond the radius of `task`'s envelope (never, without one)."""
        if self.envelope is None:
            return torch.zeros(len(task), dtype=torch.bool)
        # Not `>`: a NaN distance is outside, as the exported folder's `<=` test finds it.
        return ~(self.envelope.distance(self.standardised(hidden), task) <= self.envelope.radius[task])

    def route(self, hidden: Tensor, threshold: float | None = None, abstain_outside: bool | None = None) -> Routing:
        """The top task of each sequence, or −1 where its probability is below the threshold or, abstaining
        outside (the router's own setting unless given), where the prompt lies outside that task's envelope."""
        probabilities = self.probabilities(hidden)
        confidence, task = probabilities.max(dim=-1)
        cut = self.threshold if threshold is None else threshold
        outside = self.outside(hidden, task)
        abstain = self.abstain_outside if abstain_outside is None else abstain_outside
        # Not `<`: a NaN confidence gets no correction, as in the exported folder.
        uncorrected = ~(confidence >= cut) | (outside & abstain)
        return Routing(task.masked_fill(uncorrected, -1), confidence, probabilities, outside)

    def accuracy(self, hidden: Tensor, labels: Tensor) -> float:
        """The share of sequences whose top task is their label, whatever the confidence."""
        return float((self.probabilities(hidden).argmax(dim=-1) == labels).float().mean())

    def save(self, path: Path, metadata: dict[str, Any] | None = None) -> Path:
        """The router as safetensors with a JSON header (tasks, layer, threshold, whether it has an envelope and
        abstains outside it), written atomically."""
        header = {"format": FORMAT, "version": FORMAT_VERSION, "tasks": list(self.tasks), "layer": self.layer,
                  "hidden_size": self.hidden_size, "threshold": self.threshold, "envelope": self.envelope is not None,
                  "abstain_outside": self.abstain_outside, "metadata": metadata or {}}
        tensors = {"mean": self.mean, "scale": self.scale, "weight": self.weight, "bias": self.bias}
        if self.envelope is not None:
            tensors |= dict(zip(_ENVELOPE_TENSORS, self.envelope))
        return write_tagged(path, tensors, header, "router")

    @classmethod
    def load(cls, path: Path) -> TaskRouter:
        """Read a router file, refusing one whose tensors do not fit its header. A version 1 file (from before
        envelopes) routes as it did: a router without one, which finds no prompt outside (calibrate again for
        envelopes)."""
        path = Path(path)
        header = read_tagged_header(path, FORMAT, (1, FORMAT_VERSION), _HEADER_KEYS, "router")
        K, d = len(header["tasks"]), header["hidden_size"]
        expected = {"mean": [d], "scale": [d], "weight": [K, d], "bias": [K]}
        if header.get("envelope"):
            expected |= dict(zip(_ENVELOPE_TENSORS, ([K, d], [K, d], [K])))
        tensors = read_tagged_tensors(path, expected, "router")
        envelope = Envelope(*(tensors.pop(name) for name in _ENVELOPE_TENSORS)) if header.get("envelope") else None
        return cls(header["tasks"], header["layer"], threshold=header["threshold"], envelope=envelope,
                   abstain_outside=header.get("abstain_outside", True), **tensors)


@torch.no_grad()
def pool_prompts(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Each prompt's mean hidden state over its real tokens: [B, S, d] and [B, S] -> [B, d] fp32 (NaN for a row
    without any). One contraction: no masked copy of the states, which may be a whole calibration set's."""
    weights = attention_mask.to(hidden.device).float()
    return torch.einsum("bs,bsd->bd", weights, hidden.float()) / weights.sum(dim=1, keepdim=True)


class PromptPool:
    """A prompt routed in its own prefill: its router-layer states summed so far (a long prompt's chunks one after
    another) and how many tokens they are."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, states: torch.Tensor, mask: torch.Tensor) -> None:
        """One forward's states [S, d] of this prompt, its real tokens where `mask` [S] is set."""
        total = torch.einsum("s,sd->d", mask.to(states.device).float(), states.float())
        self.total = total if self.total is None else self.total + total
        self.count += int(mask.sum())

    def mean(self) -> torch.Tensor:
        """Its features: the mean state over its tokens (`pool_prompts` of the whole prompt), fp32 on the CPU."""
        return (self.total / self.count).cpu()


def prompt_mask(attention_mask: Tensor, response_mask: Tensor) -> Tensor:
    """A calibration row's prompt: its real tokens before the first response token, [B, S] bool.

    A causal model's states there do not depend on the response, so pooling them gives the row's prompt
    features without a pass over the prompt alone. Rows with no prompt (plain text, captured traffic) get none.
    """
    return attention_mask.bool() & (response_mask.long().cumsum(dim=1) == 0)


@torch.no_grad()
def prompt_features(
    model: nn.Module, prompts: Sequence[Sequence[int]], layer: LayerKey, pad_id: int, batch_size: int = 8
) -> torch.Tensor:
    """Each prompt's mean hidden state over its tokens at `layer`, [N, d] fp32 on the CPU (the router's input).

    Right padding: every prompt keeps positions 0..n−1 and its causal attention never sees the pads,
    so a prompt's features do not depend on what it was batched with.
    """
    device = next(model.parameters()).device
    pooled = []
    for start in range(0, len(prompts), batch_size):
        input_ids, mask = token_batch(prompts[start:start + batch_size], pad_id)
        hidden = merged_hidden(model, input_ids.to(device), mask.to(device), [layer])[layer].cpu()
        pooled.append(pool_prompts(hidden, mask))
    return torch.cat(pooled)


def row_prompt_features(
    hidden: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's features of calibration rows, from the merged states calibration computes anyway: each
    row's mean state over its prompt part (core.prompt_mask), [n, d] fp32 on the CPU, and which of the B rows
    have a prompt part ([B] bool). For a row with a prompt/response boundary these are `prompt_features` of
    its prompt (the same tokens, and causal attention never sees the response)."""
    mask = prompt_mask(attention_mask.to(hidden.device), response_mask.to(hidden.device))
    has_prompt = mask.any(dim=1)
    return pool_prompts(hidden, mask)[has_prompt].cpu(), has_prompt.cpu()

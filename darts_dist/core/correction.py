"""The DARTS correction: ĥ_t = h_t − U_k·ReLU(D_k·h_t) + P_k[min(t, T−1)], per task k and surgery layer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch
from torch import Tensor, nn

PositionBias = Literal["per_task", "shared", "none"]
POSITION_BIAS_CHOICES: tuple[str, ...] = ("per_task", "shared", "none")


@dataclass(frozen=True)
class CorrectionSpec:
    """Shape of the corrections: which tasks, how wide, which position bias."""

    tasks: tuple[str, ...]  # K task names; the order is the task index
    hidden_size: int  # d
    rank: int = 16  # r
    max_positions: int = 512  # T
    position_bias: PositionBias = "per_task"
    # q: when set, P = A·B with A [T, q] (random init) and B [q, d] (zero init), so P still starts at 0.
    # Ignored when position_bias is "none", so one config can switch the bias off for an ablation.
    position_rank: int | None = None

    def __post_init__(self) -> None:
        # A list is accepted for convenience; a tuple keeps the spec hashable and comparable.
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if not self.tasks:
            raise ValueError("CorrectionSpec.tasks is empty: name at least one task")
        for task in self.tasks:
            if not isinstance(task, str) or not task:
                raise ValueError(f"CorrectionSpec.tasks must be non-empty strings, got {task!r}")
        if len(set(self.tasks)) != len(self.tasks):
            duplicates = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
            raise ValueError(f"CorrectionSpec.tasks must be unique, repeated: {duplicates}")
        for name in ("hidden_size", "rank", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"CorrectionSpec.{name} must be a positive integer, got {value!r}")
        if self.position_bias not in POSITION_BIAS_CHOICES:
            raise ValueError(
                f"CorrectionSpec.position_bias must be one of {POSITION_BIAS_CHOICES}, got {self.position_bias!r}"
            )
        q = self.position_rank
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q <= 0):
            raise ValueError(f"CorrectionSpec.position_rank must be a positive integer or None, got {q!r}")

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def position_tables(self) -> int:
        """How many P tables there are: K per task, 1 shared, 0 without a position bias."""
        return {"per_task": self.num_tasks, "shared": 1, "none": 0}[self.position_bias]

    @property
    def low_rank(self) -> bool:
        return self.position_rank is not None and self.position_bias != "none"

    def task_index(self, task: str) -> int:
        if task not in self.tasks:
            raise ValueError(f"unknown task {task!r}; the corrections know {list(self.tasks)}")
        return self.tasks.index(task)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tasks"] = list(self.tasks)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CorrectionSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown CorrectionSpec fields {unknown}; expected some of {sorted(known)}")
        if "tasks" not in d or "hidden_size" not in d:
            raise ValueError(f"CorrectionSpec needs 'tasks' and 'hidden_size', got fields {sorted(d)}")
        return cls(**d)


LayerKey = str | int  # a surgery layer: "final" or a decoder layer index


def parse_layer(layer: LayerKey) -> LayerKey:
    """A surgery layer key: "final" (the final norm's output) or a decoder layer index i ≥ 0 (also as "i")."""
    if isinstance(layer, str) and layer.isdigit():
        return int(layer)
    if layer == "final" or (isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0):
        return layer
    raise ValueError(f"surgery layer must be 'final' or a decoder layer index >= 0, got {layer!r}")


class Correction(nn.Module):
    """One surgery layer's correction for all K tasks: ĥ_t = h_t − U_k·ReLU(D_k·h_t) + P_k[min(t, T−1)]."""

    def __init__(self, spec: CorrectionSpec) -> None:
        super().__init__()
        self.spec = spec
        K, r, d, T = spec.num_tasks, spec.rank, spec.hidden_size, spec.max_positions
        self.down = nn.Parameter(torch.empty(K, r, d))  # D_k
        self.up = nn.Parameter(torch.empty(K, d, r))  # U_k
        n = spec.position_tables
        if n and spec.low_rank:
            q = spec.position_rank
            self.position_a = nn.Parameter(torch.empty(n, T, q))  # A
            self.position_b = nn.Parameter(torch.empty(n, q, d))  # B
        elif n:
            self.position = nn.Parameter(torch.empty(n, T, d))  # P_k
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """D_k as nn.Linear(d, r) inits its weight; U_k = 0 and P = 0, so the correction starts as the identity."""
        for k in range(self.down.shape[0]):
            nn.init.kaiming_uniform_(self.down[k], a=math.sqrt(5))
        nn.init.zeros_(self.up)
        if hasattr(self, "position"):
            nn.init.zeros_(self.position)
        if hasattr(self, "position_a"):
            # Rows of A with unit expected norm, so B's gradient has the scale a full P's would.
            nn.init.normal_(self.position_a, std=1.0 / math.sqrt(self.position_a.shape[-1]))
            nn.init.zeros_(self.position_b)

    def position_rows(self, table: int, positions: Tensor, device: torch.device) -> Tensor:
        """P_table[min(max(t, 0), T−1)] in fp32: [B, S] positions -> [B, S, d]."""
        t = positions.to(device).clamp(0, self.spec.max_positions - 1)
        # An embedding lookup, not P[t]: indexing's backward accumulates with atomic adds on CPU past
        # 32768 elements, so its sums (and the trained corrections) would depend on the thread count.
        if hasattr(self, "position_a"):
            a = self.position_a[table].to(device, torch.float32)
            b = self.position_b[table].to(device, torch.float32)
            return nn.functional.embedding(t, a) @ b
        return nn.functional.embedding(t, self.position[table].to(device, torch.float32))

    def delta(self, h: Tensor, positions: Tensor, task_weights: Tensor, active: Sequence[int] | None = None) -> Tensor:
        """ĥ − h = Σ_k w_bk·(−U_k·ReLU(D_k·h_t) + P_k[min(t, T−1)]), fp32 [B, S, d].

        h [B, S, d] any float dtype; positions [B, S] (padding may be negative: it reads row 0);
        task_weights [B, K]: one-hot picks a task, a zero row means no correction, soft rows mix linearly;
        `active`: the tasks with a nonzero weight, if the caller knows them (`active_tasks` of a host copy of the
        weights), else found here from the weights, one host sync per call where they live on a GPU.
        """
        B, S, d = h.shape
        K = self.spec.num_tasks
        if d != self.spec.hidden_size:
            raise ValueError(f"hidden states have size {d}, the corrections expect {self.spec.hidden_size}")
        if task_weights.shape != (B, K):
            raise ValueError(f"task_weights must be [batch={B}, tasks={K}], got {list(task_weights.shape)}")
        if positions.shape != (B, S):
            raise ValueError(f"positions must be [batch={B}, seq={S}], got {list(positions.shape)}")
        x = h.float()
        w = task_weights.to(x.device, torch.float32)
        delta = torch.zeros_like(x)
        # Only tasks someone in the batch uses cost compute.
        active = active_tasks(w) if active is None else active
        for k in active:
            D = self.down[k].to(x.device, torch.float32)
            U = self.up[k].to(x.device, torch.float32)
            task_delta = -(torch.relu(x @ D.T) @ U.T)
            if self.spec.position_bias == "per_task":
                task_delta = task_delta + self.position_rows(k, positions, x.device)
            delta = delta + w[:, k, None, None] * task_delta
        if self.spec.position_bias == "shared" and active:
            # One P for every task: Σ_k w_bk·P[t] = (Σ_k w_bk)·P[t], gathered once.
            delta = delta + w.sum(1)[:, None, None] * self.position_rows(0, positions, x.device)
        return delta

    def forward(self, h: Tensor, positions: Tensor, task_weights: Tensor, active: Sequence[int] | None = None) -> Tensor:
        """ĥ = h + delta, added in fp32 and returned in h's dtype."""
        return (h.float() + self.delta(h, positions, task_weights, active)).to(h.dtype)


class DartsCorrections(nn.Module):
    """Corrections at every surgery layer."""

    def __init__(self, spec: CorrectionSpec, layers: Sequence[str | int]) -> None:
        super().__init__()
        keys = tuple(parse_layer(layer) for layer in layers)
        if not keys:
            raise ValueError("DartsCorrections needs at least one surgery layer, e.g. ['final']")
        if len(set(keys)) != len(keys):
            raise ValueError(f"surgery layers must be unique, got {list(keys)}")
        self.spec = spec
        self.layer_keys: tuple[str | int, ...] = keys
        self.layers = nn.ModuleDict({str(k): Correction(spec) for k in keys})

    def __getitem__(self, layer: str | int) -> Correction:
        key = str(parse_layer(layer))
        if key not in self.layers:
            raise KeyError(f"no correction at layer {layer!r}; layers are {list(self.layer_keys)}")
        return self.layers[key]


def active_tasks(task_weights: Tensor) -> list[int]:
    """The tasks some row of [B, K] weights uses (a host sync where the weights live on a GPU)."""
    return torch.nonzero(task_weights.ne(0).any(0)).flatten().tolist()


def mask_positions(attention_mask: Tensor) -> Tensor:
    """t = cumsum(mask) − 1 on real tokens, 0 on padding: each token's position counted from its row's
    first real token, as `position_ids` are (DESIGN.md §1), so left padding does not shift it."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def one_hot_tasks(task_ids: Tensor, num_tasks: int) -> Tensor:
    """Per-sequence task index [B] -> task weights [B, K] fp32; −1 gives an all-zero row (no correction)."""
    ids = torch.as_tensor(task_ids, dtype=torch.long)
    if ids.ndim != 1:
        raise ValueError(f"task ids must be one per sequence, shape [B], got {list(ids.shape)}")
    if ((ids < -1) | (ids >= num_tasks)).any():
        raise ValueError(f"task ids must be in [-1, {num_tasks - 1}] (-1 = no correction), got {ids.tolist()}")
    weights = torch.zeros(ids.shape[0], num_tasks, dtype=torch.float32, device=ids.device)
    rows = torch.nonzero(ids >= 0).flatten()
    weights[rows, ids[rows]] = 1.0
    return weights


def expected_parameter_count(spec: CorrectionSpec, num_layers: int) -> int:
    """Trainable parameters: per layer K·2rd for (D_k, U_k) plus the position bias.

    per_task: K·T·d (low-rank: K·(T·q + q·d)); shared: T·d (low-rank: T·q + q·d); none: 0.
    So the default is K·(2rd + Td) per layer.
    """
    K, r, d, T = spec.num_tasks, spec.rank, spec.hidden_size, spec.max_positions
    if spec.low_rank:
        q = spec.position_rank
        per_table = T * q + q * d
    else:
        per_table = T * d
    return num_layers * (K * 2 * r * d + spec.position_tables * per_table)


def features_only(layers: Sequence[LayerKey]) -> bool:
    """With surgery only at the final representation, training never needs the merged model again."""
    return list(layers) == ["final"]


def first_decoder_layer(layers: Sequence[LayerKey]) -> int:
    """The lowest corrected decoder layer (training runs the model from there); 0 with none."""
    return min((k for k in layers if isinstance(k, int)), default=0)

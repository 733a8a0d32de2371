"""The correction module: identity at init, position rows, task mixing, parameter counts, spec validation."""

from __future__ import annotations

import pytest
import torch

from darts_dist.core.correction import (
    Correction,
    CorrectionSpec,
    DartsCorrections,
    active_tasks,
    expected_parameter_count,
    one_hot_tasks,
)

K, D, R, T, Q = 3, 16, 4, 8, 2
VARIANTS = [
    dict(position_bias="per_task"),
    dict(position_bias="shared"),
    dict(position_bias="none"),
    dict(position_bias="per_task", position_rank=Q),
    dict(position_bias="shared", position_rank=Q),
]


def make_spec(**kw) -> CorrectionSpec:
    return CorrectionSpec(tasks=("math", "code", "chat"), hidden_size=D, rank=R, max_positions=T, **kw)


def randomize(c: Correction) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in c.parameters():
            p.normal_()


def positions(B: int, S: int) -> torch.Tensor:
    return torch.arange(S).expand(B, S)


@pytest.mark.parametrize("kw", VARIANTS)
def test_identity_at_init(kw):
    torch.manual_seed(0)
    c = Correction(make_spec(**kw))
    h = torch.randn(3, 5, D)
    w = one_hot_tasks(torch.tensor([0, 1, 2]), K)
    assert torch.equal(c(h, positions(3, 5), w), h)
    hb = h.bfloat16()
    out = c(hb, positions(3, 5), w)
    assert out.dtype == torch.bfloat16 and torch.equal(out, hb)
    # All fp32, D_k not zero (else nothing could learn), U_k zero.
    assert all(p.dtype == torch.float32 for p in c.parameters())
    assert c.down.abs().sum() > 0 and c.up.abs().sum() == 0


def test_down_init_matches_linear_bound():
    c = Correction(make_spec())
    bound = 1 / D**0.5  # nn.Linear(d, r) weight: kaiming_uniform(a=√5) -> U(−1/√d, 1/√d)
    assert c.down.abs().max() <= bound
    assert c.down.abs().max() > 0.8 * bound
    assert not torch.equal(c.down[0], c.down[1])


def test_formula_by_hand():
    c = Correction(make_spec())
    randomize(c)
    h = torch.randn(2, 4, D)
    pos = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    w = one_hot_tasks(torch.tensor([2, 0]), K)
    out = c(h, pos, w)
    for b, k in [(0, 2), (1, 0)]:
        t = pos[b].clamp(max=T - 1)
        expected = h[b] - torch.relu(h[b] @ c.down[k].T) @ c.up[k].T + c.position[k][t]
        torch.testing.assert_close(out[b], expected)


@pytest.mark.parametrize("kw", VARIANTS)
def test_soft_weights_mix_linearly_and_zero_row_is_identity(kw):
    c = Correction(make_spec(**kw))
    randomize(c)
    h = torch.randn(1, 6, D)
    pos = positions(1, 6)
    d0 = c.delta(h, pos, torch.tensor([[1.0, 0, 0]]))
    d2 = c.delta(h, pos, torch.tensor([[0, 0, 1.0]]))
    mixed = c.delta(h, pos, torch.tensor([[0.25, 0, 0.75]]))
    torch.testing.assert_close(mixed, 0.25 * d0 + 0.75 * d2)
    assert torch.equal(c(h, pos, torch.zeros(1, K)), h)
    assert d0.abs().sum() > 0


def test_only_active_tasks_are_computed():
    c = Correction(make_spec())
    randomize(c)
    with torch.no_grad():
        c.down[1] = float("nan")  # task 1 unused in this batch: its NaNs must not leak in
    out = c(torch.randn(2, 3, D), positions(2, 3), one_hot_tasks(torch.tensor([0, 2]), K))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kw", VARIANTS)
def test_given_active_tasks_compute_what_finding_them_does(kw):
    """A caller that knows the batch's tasks (the hooks, from weights kept on the host) passes them, and the
    correction finds nothing itself: the same result, the shared position row included."""
    c = Correction(make_spec(**kw))
    randomize(c)
    h, weights = torch.randn(3, 4, D), torch.tensor([[0.0, 0.3, 0.7], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert active_tasks(weights) == [1, 2]
    torch.testing.assert_close(c(h, positions(3, 4), weights, active=[1, 2]), c(h, positions(3, 4), weights))


def test_hooks_tell_the_correction_its_active_tasks_from_host_weights(tiny_family, monkeypatch):
    from darts_dist.core import attach_corrections
    from darts_dist.sources.models import load_causal_lm

    model = load_causal_lm(tiny_family.base)
    corrections = DartsCorrections(CorrectionSpec(tasks=("math", "code", "chat"), hidden_size=model.config.hidden_size,
                                                  rank=R, max_positions=T), ["final"])
    seen = []
    real = Correction.delta
    monkeypatch.setattr(Correction, "delta", lambda self, *a: (seen.append(a[3]), real(self, *a))[1])
    with attach_corrections(model, corrections) as handle, handle.tasks([2, -1]):
        model(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]))
    assert seen == [[2]]


@pytest.mark.parametrize("kw", [v for v in VARIANTS if v["position_bias"] != "none"])
def test_position_rows_clamp(kw):
    c = Correction(make_spec(**kw))
    with torch.no_grad():
        if hasattr(c, "position"):
            c.position.copy_(torch.arange(T, dtype=torch.float32)[None, :, None].expand_as(c.position))
        else:
            c.position_b.normal_()
    table = c.position_rows(0, torch.arange(T)[None], torch.device("cpu"))[0]  # [T, d]
    assert len({tuple(row.tolist()) for row in table}) == T  # rows are distinct
    h = torch.zeros(1, 5, D)
    pos = torch.tensor([[0, T - 1, T, T + 5, -1]])
    out = c(h, pos, one_hot_tasks(torch.tensor([0]), K))[0]
    for i, row in enumerate([0, T - 1, T - 1, T - 1, 0]):
        torch.testing.assert_close(out[i], table[row])


def test_shared_position_is_one_table():
    c = Correction(make_spec(position_bias="shared"))
    with torch.no_grad():
        c.position.normal_()
    h = torch.zeros(2, 3, D)
    out = c(h, positions(2, 3), one_hot_tasks(torch.tensor([0, 2]), K))
    torch.testing.assert_close(out[0], out[1])
    torch.testing.assert_close(out[0], c.position[0, :3])


@pytest.mark.parametrize(
    "kw, per_layer",
    [
        (dict(position_bias="per_task"), K * (2 * R * D + T * D)),
        (dict(position_bias="shared"), K * 2 * R * D + T * D),
        (dict(position_bias="none"), K * 2 * R * D),
        (dict(position_bias="per_task", position_rank=Q), K * (2 * R * D + T * Q + Q * D)),
        (dict(position_bias="shared", position_rank=Q), K * 2 * R * D + T * Q + Q * D),
        (dict(position_bias="none", position_rank=Q), K * 2 * R * D),
    ],
)
def test_parameter_count(kw, per_layer):
    spec = make_spec(**kw)
    corrections = DartsCorrections(spec, ["final", 0])
    assert sum(p.numel() for p in corrections.parameters()) == 2 * per_layer
    assert expected_parameter_count(spec, 2) == 2 * per_layer


def test_paper_overhead_llama2_7b():
    spec = CorrectionSpec(tasks=("a", "b", "c"), hidden_size=4096)
    assert expected_parameter_count(spec, 1) == 3 * (2 * 16 * 4096 + 512 * 4096)


def test_one_hot_tasks():
    w = one_hot_tasks(torch.tensor([1, -1, 0]), 3)
    assert torch.equal(w, torch.tensor([[0.0, 1, 0], [0, 0, 0], [1, 0, 0]]))
    with pytest.raises(ValueError, match="task ids"):
        one_hot_tasks(torch.tensor([3]), 3)


def test_darts_corrections_keys():
    corrections = DartsCorrections(make_spec(), ["final", 2, "5"])
    assert corrections.layer_keys == ("final", 2, 5)
    assert corrections[5] is corrections["5"]
    assert set(dict(corrections.named_parameters())) >= {"layers.final.down", "layers.2.up", "layers.5.position"}
    with pytest.raises(KeyError):
        corrections[1]
    for bad in ([], ["final", "final"], [-1], ["last"], [True]):
        with pytest.raises(ValueError):
            DartsCorrections(make_spec(), bad)


def test_spec_validation_and_dict_roundtrip():
    spec = make_spec(position_rank=Q)
    assert CorrectionSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["tasks"] == ["math", "code", "chat"]
    assert CorrectionSpec(tasks=["a"], hidden_size=4).tasks == ("a",)
    bad = [
        dict(tasks=(), hidden_size=4),
        dict(tasks=("a", "a"), hidden_size=4),
        dict(tasks=("",), hidden_size=4),
        dict(tasks=("a",), hidden_size=0),
        dict(tasks=("a",), hidden_size=4, rank=-1),
        dict(tasks=("a",), hidden_size=4, max_positions=0),
        dict(tasks=("a",), hidden_size=4, position_bias="global"),
        dict(tasks=("a",), hidden_size=4, position_rank=0),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            CorrectionSpec(**kw)
    with pytest.raises(ValueError, match="unknown"):
        CorrectionSpec.from_dict({**spec.to_dict(), "colour": 1})


@pytest.mark.parametrize("kw", [VARIANTS[0], VARIANTS[3]])
def test_position_gradient_does_not_depend_on_the_thread_count(kw):
    """[8, 64, 64] position rows: past 32768 elements an indexing backward sums with atomic adds in
    thread order, which made Ray's one-thread workers and a two-thread reference loop train apart."""
    spec = CorrectionSpec(tasks=("math", "code", "chat"), hidden_size=64, rank=R, max_positions=64, **kw)
    c = Correction(spec)
    randomize(c)
    pos = torch.arange(64).expand(8, 64)
    weights = torch.randn(8, 64, 64, generator=torch.Generator().manual_seed(0))

    def grads(threads: int) -> list[torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            c.zero_grad()
            (c.position_rows(0, pos, torch.device("cpu")) * weights).sum().backward()
        finally:
            torch.set_num_threads(before)
        return [p.grad.clone() for p in c.parameters() if p.grad is not None]

    for one, many in zip(grads(1), grads(4)):
        assert torch.equal(one, many)

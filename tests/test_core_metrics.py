"""Per-token bias, next-token NLL, and means by position bucket."""

from __future__ import annotations

import math

import torch

from darts_dist.core.metrics import BUCKET_LABELS, BucketMeans, token_bias, token_nll


def test_labels():
    assert BUCKET_LABELS == ("0-15", "16-31", "32-63", "64-127", "128-255", "256+")


def test_token_bias():
    a = torch.tensor([[[1.0, -1.0], [2.0, 2.0]]])
    b = torch.zeros(1, 2, 2, dtype=torch.bfloat16)
    torch.testing.assert_close(token_bias(a, b), torch.tensor([[1.0, 2.0]]))


def test_token_nll_by_hand():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    ids = torch.tensor([[1, 2, 3, 4], [0, 1, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]).bool()
    nll, m = token_nll(logits, ids, mask)
    assert torch.equal(m, torch.tensor([[True, True, True], [False, True, True]]))
    for b in range(2):
        for t in range(3):
            expected = -torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]].item() if m[b, t] else 0.0
            assert abs(nll[b, t].item() - expected) < 1e-5


def test_bucket_means():
    bm = BucketMeans()
    S = 300
    pos = torch.arange(S)[None]
    values = (pos >= 64).float()[0][None] * 2.0  # 0 before position 64, 2 from it on
    mask = torch.ones(1, S, dtype=torch.bool)
    mask[0, 20] = False
    values[0, 20] = float("nan")  # masked: must not count
    bm.add(values, pos, mask)
    means = bm.means()
    assert means["0-15"] == 0.0 and means["64-127"] == 2.0 and means["256+"] == 2.0
    assert bm.late(64) == 2.0 and bm.late() == 2.0
    assert abs(bm.overall() - 2.0 * (S - 64) / (S - 1)) < 1e-9
    # Accumulates over batches, weighted.
    bm2 = BucketMeans()
    bm2.add(torch.tensor([[1.0, 3.0]]), torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool))
    bm2.add(torch.tensor([[5.0]]), torch.tensor([[20]]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([[3.0]]))
    assert bm2.means() == {"0-15": 2.0, "16-31": 5.0}
    assert abs(bm2.overall() - (1 + 3 + 15) / 5) < 1e-12
    assert math.isnan(bm2.late(64)) and math.isnan(BucketMeans().overall())

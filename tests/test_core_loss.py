"""Entropy, entropy weights and the weighted L1 loss, each against a by-hand computation."""

from __future__ import annotations

import math

import torch

from darts_dist.core.loss import entropy_weights, next_token_entropy, top_k_kl, top_k_log_probs, weighted_l1_loss


def test_entropy_by_hand():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    H = next_token_entropy(logits)
    assert H.shape == (2, 3) and H.dtype == torch.float32
    for b in range(2):
        for t in range(3):
            p = [math.exp(x) for x in logits[b, t].tolist()]
            z = sum(p)
            expected = -sum(pi / z * math.log(pi / z) for pi in p)
            assert abs(H[b, t].item() - expected) < 1e-5


def test_entropy_uniform_masked_and_bf16():
    V = 50
    torch.testing.assert_close(next_token_entropy(torch.zeros(1, 2, V)), torch.full((1, 2), math.log(V)))
    # Entries masked to −inf are impossible tokens: the entropy is over the 10 left, not NaN.
    logits = torch.full((1, 1, V), float("-inf"))
    logits[..., :10] = 0.0
    torch.testing.assert_close(next_token_entropy(logits), torch.full((1, 1), math.log(10)))
    H = next_token_entropy(torch.zeros(1, 2, V, dtype=torch.bfloat16))
    assert H.dtype == torch.float32


def test_entropy_weights_by_hand():
    H = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 7.0, -3.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    beta = 0.6
    mean = (1 + 2 + 3 + 4 + 5) / 5
    expected = torch.tensor(
        [
            [(1 - beta) + beta * 1 / mean, (1 - beta) + beta * 2 / mean, (1 - beta) + beta * 3 / mean, 0.0],
            [(1 - beta) + beta * 4 / mean, (1 - beta) + beta * 5 / mean, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(entropy_weights(H, mask, beta), expected)
    # β = 0: uniform weights on real tokens, 0 on padding.
    torch.testing.assert_close(entropy_weights(H, mask, 0.0), mask.float())
    # β = 1: w = H / mean(H), so the real tokens' weights average to 1.
    assert abs(entropy_weights(H, mask, 1.0)[mask].mean().item() - 1) < 1e-6


def test_entropy_weights_per_sequence_beta_and_nan_padding():
    H = torch.tensor([[1.0, 3.0, float("nan")], [2.0, 2.0, float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]]).bool()
    w = entropy_weights(H, mask, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 0.0], [1.0, 1.0, 0.0]]))


def test_entropy_weights_weight_mask():
    H = torch.tensor([[10.0, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]]).bool()
    response = torch.tensor([[0, 1, 1, 1]]).bool()  # token 0 is prompt: weight 1, H out of the mean
    w = entropy_weights(H, mask, 1.0, weight_mask=response)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.5, 1.5, 0.0]]))


def test_entropy_weights_zero_entropy_is_uniform():
    mask = torch.tensor([[1, 1, 0]]).bool()
    w = entropy_weights(torch.zeros(1, 3), mask, 1.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0]]))


def test_uniform_loss_is_masked_l1_mean():
    torch.manual_seed(0)
    a, b = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]).bool()
    total, count = 0.0, 0
    for i in range(2):
        for t in range(4):
            if mask[i, t]:
                total += sum(abs(x - y) for x, y in zip(a[i, t].tolist(), b[i, t].tolist()))
                count += 6
    assert abs(weighted_l1_loss(a, b, mask).item() - total / count) < 1e-6
    # β = 0 weights are the same as no weights.
    w0 = entropy_weights(torch.rand(2, 4), mask, 0.0)
    assert abs(weighted_l1_loss(a, b, mask, w0).item() - total / count) < 1e-6


def test_weighted_loss_by_hand():
    a = torch.tensor([[[1.0, 1.0], [0.0, 4.0]]])
    b = torch.zeros(1, 2, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    w = torch.tensor([[3.0, 1.0]])
    expected = (3 * 2 + 1 * 4) / (2 * (3 + 1))
    assert abs(weighted_l1_loss(a, b, mask, w).item() - expected) < 1e-6


def test_padding_never_changes_the_loss():
    torch.manual_seed(0)
    a, b = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    H = torch.rand(2, 5)
    for beta in (0.0, 0.5, 1.0):
        ref = weighted_l1_loss(a, b, mask, entropy_weights(H, mask, beta))
        # Three more padding tokens with garbage hidden states and entropies.
        pad_a = torch.cat([a, torch.full((2, 3, 8), float("nan"))], 1)
        pad_b = torch.cat([b, torch.randn(2, 3, 8) * 1e6], 1)
        pad_H = torch.cat([H, torch.tensor([[float("inf")] * 3, [1e9] * 3])], 1)
        pad_mask = torch.cat([mask, torch.zeros(2, 3, dtype=torch.bool)], 1)
        loss = weighted_l1_loss(pad_a, pad_b, pad_mask, entropy_weights(pad_H, pad_mask, beta))
        torch.testing.assert_close(loss, ref)


def test_loss_grad_and_dtype():
    a = torch.randn(1, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    loss = weighted_l1_loss(a, torch.zeros(1, 3, 4), torch.ones(1, 3, dtype=torch.bool))
    assert loss.dtype == torch.float32
    loss.backward()
    assert a.grad is not None and a.grad.abs().sum() > 0


def test_top_k_log_probs_are_the_likeliest_tokens_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    values, ids = top_k_log_probs(logits, 4)
    assert values.shape == ids.shape == (2, 3, 4) and values.dtype == torch.float32 and ids.dtype == torch.int32
    full = torch.log_softmax(logits, -1)
    torch.testing.assert_close(values, full.gather(-1, ids.long()))
    assert set(ids[1, 2].tolist()) == set(full[1, 2].argsort(descending=True)[:4].tolist())
    bf16_values, bf16_ids = top_k_log_probs(logits.bfloat16(), 4)  # a bf16 expert: fp32 log-probs of its logits
    assert bf16_values.dtype == torch.float32
    torch.testing.assert_close(bf16_values, torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, bf16_ids.long()))


def _kl_by_hand(expert_logits, logits, k):
    """Per token: KL over the expert's k likeliest tokens and one bucket for the rest, with plain Python numbers."""
    out = []
    for e_row, m_row in zip(expert_logits.tolist(), logits.tolist()):
        p = [math.exp(x) for x in e_row]
        p = [x / sum(p) for x in p]
        q = [math.exp(x) for x in m_row]
        q = [x / sum(q) for x in q]
        top = sorted(range(len(p)), key=lambda i: -p[i])[:k]
        kl = sum(p[i] * math.log(p[i] / q[i]) for i in top)
        p_rest, q_rest = 1 - sum(p[i] for i in top), 1 - sum(q[i] for i in top)
        out.append(kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0))
    return out


def test_top_k_kl_by_hand_weighted_and_masked():
    torch.manual_seed(1)
    expert, model = torch.randn(1, 5, 9) * 2, torch.randn(1, 5, 9)
    top = top_k_log_probs(expert, 3)
    per_token = _kl_by_hand(expert[0], model[0], 3)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    weights = torch.tensor([[0.5, 1.0, 2.0, 1.5, 9.0]])
    expected = sum(w * kl for w, kl in zip([0.5, 1.0, 2.0, 1.5], per_token)) / 5.0
    assert abs(top_k_kl(model, *top, mask, weights).item() - expected) < 1e-5
    assert abs(top_k_kl(model, *top, mask).item() - sum(per_token[:4]) / 4) < 1e-5


def test_top_k_kl_over_the_whole_vocabulary_is_the_kl_and_zero_at_the_target():
    torch.manual_seed(2)
    expert, model = torch.randn(2, 4, 7), torch.randn(2, 4, 7)
    mask = torch.ones(2, 4)
    full = torch.nn.functional.kl_div(torch.log_softmax(model, -1), torch.log_softmax(expert, -1), log_target=True,
                                      reduction="none").sum(-1).mean()
    torch.testing.assert_close(top_k_kl(model, *top_k_log_probs(expert, 7), mask), full, atol=1e-5, rtol=1e-4)
    assert abs(top_k_kl(expert, *top_k_log_probs(expert, 3), mask).item()) < 1e-6
    # Its gradient pulls the model's logits toward the expert's, finite even where the top k hold all of q.
    logits = model.clone().requires_grad_()
    top_k_kl(logits, *top_k_log_probs(expert, 7), mask).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    assert top_k_kl(model.bfloat16(), *top_k_log_probs(expert, 3), mask).dtype == torch.float32


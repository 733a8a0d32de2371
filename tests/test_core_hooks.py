"""Corrections hooked into a tiny random Llama: forward, training gradients, and generate() with a KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from darts_dist.core.correction import CorrectionSpec, DartsCorrections, one_hot_tasks
from darts_dist.core.hooks import attach_corrections, capture_hidden, surgery_module, token_positions
from darts_dist.core.loss import weighted_l1_loss

VOCAB, D, LAYERS, PAD = 96, 32, 3, 0


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=None,
        attn_implementation="eager",
    )
    m = LlamaForCausalLM(config).eval()
    m.requires_grad_(False)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = PAD
    return m


def random_corrections(layers, position_bias="per_task", seed=1) -> DartsCorrections:
    spec = CorrectionSpec(tasks=("a", "b"), hidden_size=D, rank=4, max_positions=16, position_bias=position_bias)
    corrections = DartsCorrections(spec, layers)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in corrections.parameters():
            p.normal_(std=0.5)
    return corrections


def left_padded_batch():
    """Three prompts of lengths 6, 4, 2 (left padding) with tasks a, none, b."""
    torch.manual_seed(2)
    ids = torch.randint(2, VOCAB, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :4] = 0
    ids[mask == 0] = PAD
    return ids, mask, [0, -1, 1]


def test_surgery_module(model):
    assert surgery_module(model, "final") is model.model.norm
    assert surgery_module(model, 2) is model.model.layers[2]
    assert surgery_module(model.model, 1) is model.model.layers[1]
    with pytest.raises(ValueError, match=r"0\.\.2"):
        surgery_module(model, 3)
    with pytest.raises(ValueError):
        surgery_module(model, -1)


def test_token_positions():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert token_positions(mask, None, 5, 0, 2, "cpu").tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    # With a KV cache, the mask covers past and current tokens: only the last columns are this step's.
    assert token_positions(mask, None, 1, 4, 2, "cpu").tolist() == [[2], [4]]
    assert token_positions(None, torch.tensor([[7, 8]]), 2, 0, 2, "cpu").tolist() == [[7, 8], [7, 8]]
    assert token_positions(None, None, 2, 3, 2, "cpu").tolist() == [[3, 4], [3, 4]]


@pytest.mark.parametrize("layer", ["final", 1])
def test_hooked_output_is_the_correction_by_hand(model, layer):
    ids, mask, tasks = left_padded_batch()
    corrections = random_corrections([layer])
    with capture_hidden(model, [layer]) as captured:
        plain_logits = model(input_ids=ids, attention_mask=mask).logits
        h = captured[layer].clone()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    by_hand = corrections[layer](h, positions, one_hot_tasks(torch.tensor(tasks), 2))

    with attach_corrections(model, corrections) as handle:
        handle.record = True
        handle.set_tasks(tasks)
        logits = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(handle.outputs[layer], by_hand)
        # The sequence with task −1 is untouched; the others are corrected.
        torch.testing.assert_close(handle.outputs[layer][1], h[1])
        assert not torch.allclose(handle.outputs[layer][0], h[0])
        if layer == "final":
            torch.testing.assert_close(logits, model.lm_head(by_hand))
        else:
            # Downstream layers see the corrected states: same logits as an independent hook that applies it.
            def replace(module, args, output):
                return by_hand

            handle.set_task_weights(None)
            hook = surgery_module(model, layer).register_forward_hook(replace)
            try:
                manual = model(input_ids=ids, attention_mask=mask).logits
            finally:
                hook.remove()
            torch.testing.assert_close(logits, manual)
            assert not torch.allclose(logits, plain_logits)
    # Removed on exit: the model is back to itself.
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, plain_logits)


def test_no_task_weights_pass_through_and_batch_mismatch(model):
    ids, mask, _ = left_padded_batch()
    plain = model(input_ids=ids, attention_mask=mask).logits
    with attach_corrections(model, random_corrections(["final", 0])) as handle:
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, plain)
        with handle.tasks([-1, -1, -1]):
            torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, plain)
        assert handle.task_weights is None
        handle.set_tasks([0, 1])
        with pytest.raises(ValueError, match="batch size 3"):
            model(input_ids=ids, attention_mask=mask)


def test_identity_at_step_0_then_only_corrections_train(model):
    ids, mask, tasks = left_padded_batch()
    spec = CorrectionSpec(tasks=("a", "b"), hidden_size=D, rank=4, max_positions=16)
    torch.manual_seed(3)
    corrections = DartsCorrections(spec, [0, "final"])
    with capture_hidden(model, [0, "final"]) as captured:
        plain = model(input_ids=ids, attention_mask=mask).logits
        plain_h = {k: v.clone() for k, v in captured.items()}
    targets = {k: v + torch.randn_like(v) for k, v in plain_h.items()}
    optimizer = torch.optim.Adam(corrections.parameters(), lr=1e-2)
    with attach_corrections(model, corrections) as handle:
        handle.record = True
        handle.set_tasks(tasks)
        logits = model(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(logits, plain)
        for k in plain_h:
            assert torch.equal(handle.outputs[k], plain_h[k])
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            model(input_ids=ids, attention_mask=mask)
            loss = sum(weighted_l1_loss(handle.outputs[k], targets[k], mask.bool()) for k in targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert all(p.grad is None for p in model.parameters())
    # U_k, P_k of the used tasks get gradients (D_k only once U_k ≠ 0); the loss moves.
    assert corrections[0].up.grad.abs().sum() > 0 and corrections["final"].position.grad.abs().sum() > 0
    assert corrections[0].down.grad.abs().sum() > 0
    assert losses[1] < losses[0]


def test_generate_with_cache_matches_full_forward(model):
    """Left-padded batch, two tasks, greedy generate with a KV cache: every step's logits equal a
    no-cache forward of prompt + tokens so far, corrections at a middle layer and the final norm."""
    torch.manual_seed(4)
    ids = torch.randint(2, VOCAB, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = PAD
    corrections = random_corrections([1, "final"], seed=5)
    new_tokens = 12  # the last positions run past T = 16 and reuse row T − 1
    with attach_corrections(model, corrections) as handle:
        handle.set_tasks([1, 0])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            return_dict_in_generate=True,
            output_logits=True,
        )
        assert len(out.logits) == new_tokens
        full_mask = torch.cat([mask, torch.ones(2, new_tokens, dtype=torch.long)], 1)
        for step, step_logits in enumerate(out.logits):
            n = ids.shape[1] + step
            with torch.no_grad():
                full = model(input_ids=out.sequences[:, :n], attention_mask=full_mask[:, :n], use_cache=False)
            torch.testing.assert_close(step_logits, full.logits[:, -1], atol=1e-4, rtol=1e-4)
    # The correction was really on: without it the first step's logits differ.
    off = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
        return_dict_in_generate=True, output_logits=True,
    )
    assert not torch.allclose(off.logits[0], out.logits[0], atol=1e-3)


def test_manual_cache_without_mask_or_position_ids(model):
    """A forward that passes only a KV cache: positions continue from the cache's length."""
    torch.manual_seed(8)
    ids = torch.randint(2, VOCAB, (2, 9))
    corrections = random_corrections([0, "final"], seed=9)
    with attach_corrections(model, corrections) as handle:
        handle.set_tasks([0, 1])
        full = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :5], use_cache=True)
        second = model(input_ids=ids[:, 5:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(second.logits, full[:, 5:], atol=1e-4, rtol=1e-4)


def test_decoder_called_alone_and_inputs_embeds(model):
    ids, mask, tasks = left_padded_batch()
    with attach_corrections(model, random_corrections(["final"])) as handle:
        handle.set_tasks(tasks)
        logits = model(input_ids=ids, attention_mask=mask).logits
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        embeds = model.model(inputs_embeds=model.model.embed_tokens(ids), attention_mask=mask).last_hidden_state
    torch.testing.assert_close(model.lm_head(hidden), logits)
    torch.testing.assert_close(embeds, hidden)


def test_left_padding_does_not_shift_positions(model):
    torch.manual_seed(6)
    prompt = torch.randint(2, VOCAB, (1, 5))
    other = torch.randint(2, VOCAB, (1, 8))
    batch = torch.cat([torch.cat([torch.full((1, 3), PAD), prompt], 1), other])
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    corrections = random_corrections([0, "final"], seed=7)
    with attach_corrections(model, corrections) as handle:
        handle.set_tasks([1])
        alone = model(input_ids=prompt).logits
        handle.set_tasks([1, 0])
        padded = model(input_ids=batch, attention_mask=mask).logits
    torch.testing.assert_close(padded[0, 3:], alone[0], atol=1e-4, rtol=1e-4)
    # It matters: reading P at the padded (shifted) positions would give other logits.
    shifted = random_corrections([0, "final"], seed=7)
    with torch.no_grad():
        for layer in shifted.layer_keys:
            shifted[layer].position.copy_(torch.roll(shifted[layer].position, -3, dims=1))
    with attach_corrections(model, shifted) as handle:
        handle.set_tasks([1])
        assert not torch.allclose(model(input_ids=prompt).logits, alone, atol=1e-3)

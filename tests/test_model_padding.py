"""Padded batches as Hugging Face builds them: left and right padding in
``forward``, left padding in ``generate``, caches built from padded batches, hidden states.

Oracle: every padded row must give what the same prompt gives when run alone, unpadded
(fp32 logits within 1e-5 relative, identical greedy tokens)."""

from __future__ import annotations

import pytest
import torch

from wiola import WiolaCache, WiolaConfig, WiolaForCausalLM
from wiola_kernels.testing import rel_err, tolerance

TOL = 1e-5  # padded rows vs the same prompt alone, fp32


pytestmark = pytest.mark.usefixtures("one_thread")  # small shapes: threads only add overhead


def model_for(mode: str = "causal", seed: int = 0, **overrides) -> WiolaForCausalLM:
    """Small fp32 model in eval mode with the gate at 0 (σ = 1/2), so the summaries matter."""
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, dsff_narrow_size=64,
              dsff_wide_size=128, gcla_summary=mode)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = WiolaForCausalLM(WiolaConfig.from_name("wiola-tiny", **kw)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.gate.fill_(0.0)
    return model


def prompts(lengths, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (n,), generator=g) for n in lengths]


def pad(rows, side: str, width: int | None = None, before: int = 0):
    """``(ids, mask)`` with pad id 0; ``side`` "left" or "right"; ``before`` extra left pads
    (with ``side="right"``: padding on both sides)."""
    width = width or max(len(r) for r in rows) + before
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        start = width - len(r) if side == "left" else before
        ids[b, start:start + len(r)] = r
        mask[b, start:start + len(r)] = 1
    return ids, mask


def real(mask_row: torch.Tensor) -> slice:
    idx = mask_row.nonzero().flatten()
    return slice(int(idx[0]), int(idx[-1]) + 1)


@pytest.mark.parametrize("mode", ["causal", "paper"])
@pytest.mark.parametrize("side, before", [("left", 0), ("right", 2)])
def test_padded_forward_rows_match_each_prompt_alone(mode, side, before):
    """Plain right padding is tests/test_model.py's (against the oracle); here left padding
    and padding on both sides."""
    model = model_for(mode)
    rows = prompts([11, 5, 1, 8], seed=1)
    ids, mask = pad(rows, side, before=before)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, use_cache=False).logits
        for b, r in enumerate(rows):
            alone = model(r[None], use_cache=False).logits[0]
            assert rel_err(got[b, real(mask[b])], alone) <= TOL, (b, len(r))


def test_left_padded_training_forward_with_atm_matches_each_prompt_alone():
    model = model_for(atm_threshold=0.0, kernel_backend="reference").train()  # merges plenty
    rows = prompts([12, 7, 3], seed=2)
    ids, mask = pad(rows, "left")
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        for b, r in enumerate(rows):
            assert rel_err(got[b, real(mask[b])], model(r[None]).logits[0]) <= TOL, b


def test_left_padded_loss_gradients_match_the_rows_alone():
    model = model_for()
    rows = prompts([9, 4], seed=3)
    ids, mask = pad(rows, "left")
    labels = ids.masked_fill(mask == 0, -100)
    for b, r in enumerate(rows):  # a row's first token has no real token before it
        labels[b, ids.shape[1] - len(r)] = -100
    model.zero_grad()
    model(ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    padded = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # the batch loss is the mean over the 8 + 3 real targets; alone: the sum of the rows' sums / 11
    model.zero_grad()
    total = sum(torch.nn.functional.cross_entropy(model(r[None], use_cache=False).logits[0, :-1], r[1:],
                                                  reduction="sum") for r in rows)
    (total / sum(len(r) - 1 for r in rows)).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert rel_err(padded[name], p.grad) <= tolerance(torch.float32, "attention"), name


def _greedy(model, ids, mask, n):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)  # (B, n), (B, n, V)


@pytest.mark.parametrize("mode", ["causal", "paper"])
def test_left_padded_generate_matches_each_prompt_alone(mode):
    model = model_for(mode, seed=4)
    rows = prompts([10, 3, 1, 6], seed=5)
    ids, mask = pad(rows, "left")
    with torch.no_grad():
        tokens, logits = _greedy(model, ids, mask, 7)
        for b, r in enumerate(rows):
            alone_tokens, alone_logits = _greedy(model, r[None], torch.ones(1, len(r), dtype=torch.long), 7)
            assert torch.equal(tokens[b], alone_tokens[0]), b
            assert rel_err(logits[b], alone_logits[0]) <= TOL, b


def test_generate_refuses_right_padding():
    model = model_for()
    ids, mask = pad(prompts([6, 3], seed=6), "right")
    with pytest.raises(ValueError, match="right-padded"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_cached_chunks_of_a_left_padded_batch_match_the_rows_alone():
    model = model_for(seed=7)
    rows = prompts([12, 6, 2], seed=8)
    ids, mask = pad(rows, "left")
    chunks, start, pieces, cache = (5, 1, 3, 1, 2), 0, [], WiolaCache()
    with torch.no_grad():
        for n in chunks:
            out = model(ids[:, start:start + n], attention_mask=mask[:, :start + n], cache=cache, use_cache=True)
            cache, start = out.cache, start + n
            pieces.append(out.logits)
        got = torch.cat(pieces, 1)
        for b, r in enumerate(rows):
            assert rel_err(got[b, real(mask[b])], model(r[None], use_cache=False).logits[0]) <= TOL, b


def test_a_padded_cache_needs_its_mask():
    model = model_for()
    ids, mask = pad(prompts([5, 2], seed=9), "left")
    nxt = torch.tensor([[7], [8]])
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
        with pytest.raises(ValueError, match="attention_mask is required"):
            model(nxt, cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="differ from the padding"):
            model(nxt, attention_mask=torch.ones(2, 6, dtype=torch.long), cache=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, (past|cached) \+ T\)"):
            model(nxt, attention_mask=mask, cache=cache, use_cache=True)
        unpadded = model(ids[:1], use_cache=True).cache  # nothing padded: no mask needed later
        assert model(nxt[:1], cache=unpadded, use_cache=True).logits.shape == (1, 1, 259)


def test_a_mask_with_a_hole_is_refused():
    model = model_for()
    ids = torch.randint(3, 259, (2, 6), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[1, 2] = 0
    with pytest.raises(ValueError, match="contiguous"):
        model(ids, attention_mask=mask, use_cache=False)


def test_output_hidden_states_follow_hugging_face():
    model = model_for()
    rows = prompts([7, 4], seed=11)
    ids, mask = pad(rows, "left")
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
        hs = out.hidden_states
        assert len(hs) == model.config.num_hidden_layers + 1
        assert all(h.shape == (2, 7, 64) for h in hs)
        # first: the embeddings; last: after the final norm (what the tied head reads)
        assert torch.equal(hs[0][mask.bool()], model.model.embed_tokens.weight[ids[mask.bool()]])
        assert rel_err(hs[-1] @ model.lm_head.weight.T, out.logits) <= tolerance(torch.float32)
        alone = model(rows[1][None], use_cache=False, output_hidden_states=True).hidden_states
        for i, (h, a) in enumerate(zip(hs, alone)):
            assert rel_err(h[1, 3:], a[0]) <= TOL, i
        assert model(ids, use_cache=False).hidden_states is None


def test_output_attentions_is_refused():
    model = model_for()
    ids = torch.randint(3, 259, (1, 4), generator=torch.Generator().manual_seed(12))
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)

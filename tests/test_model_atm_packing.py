"""ATM's packed attention block (SPEC §6): in merged layers the projections run on the
Σ_b T'_b merged tokens only. Packing is a pure re-layout, so the model with it must agree
with the static-shape path (every row computed, the attention op skipping past T'_b) to
rounding in float64 — logits and every gradient — and must really do less work."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import wiola_kernels
from wiola import WiolaConfig, WiolaForCausalLM
from wiola.bench import attention_flops
from wiola.modeling_wiola import PackedRows, WiolaAttention
from wiola_kernels.testing import rel_err, tolerance


pytestmark = pytest.mark.usefixtures("one_thread")  # small shapes: threads only add overhead


def config(**overrides) -> WiolaConfig:
    """d 32, L 6 (layers 2 and 3 merge); τ = 0 merges about half the neighbour pairs."""
    kw = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, dsff_narrow_size=32,
              dsff_wide_size=64, atm_threshold=0.0, gcla_gate_init=0.0)
    kw.update(overrides)
    return WiolaConfig.from_name("wiola-tiny", **kw)


def model_for(cfg: WiolaConfig, seed: int = 0) -> WiolaForCausalLM:
    torch.manual_seed(seed)
    return WiolaForCausalLM(cfg).double().train()


def set_packing(model: WiolaForCausalLM, pack: bool) -> None:
    for layer in model.model.layers:
        layer.pack_merged = pack  # instance attribute over the class default


def run(model, ids, mask):
    """Logits and every parameter's gradient of one training forward/backward."""
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=ids, return_logits=True)
    (out.loss + out.logits.square().mean()).backward()  # the logits' own gradient reaches every row
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def record_merges(monkeypatch) -> list:
    """Patches ``wiola_kernels.atm_merge`` (what the model calls) to record each call's merged
    lengths."""
    original, seen = wiola_kernels.atm_merge, []

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out[2].clone())
        return out

    monkeypatch.setattr(wiola_kernels, "atm_merge", recording)
    return seen


def batch(b: int, t: int, seed: int, padding: str):
    ids = torch.randint(3, 259, (b, t), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(b, t, dtype=torch.long)
    if padding == "right":
        mask[1, t - 7:] = 0
    elif padding == "left":
        mask[0, :5] = 0
    return ids, (None if padding == "none" else mask)


@pytest.mark.parametrize("mode", ["causal", "paper"])
@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_packed_equals_static_shapes_in_float64(mode, padding, backend, monkeypatch):
    model = model_for(config(gcla_summary=mode, kernel_backend=backend))
    ids, mask = batch(3, 24, seed=1, padding=padding)
    seen = record_merges(monkeypatch)
    set_packing(model, True)
    got_logits, got_grads = run(model, ids, mask)
    assert len(seen) == 2 and all(int((24 - n).sum()) > 0 for n in seen), "ATM must really merge here"
    set_packing(model, False)
    want_logits, want_grads = run(model, ids, mask)
    assert rel_err(got_logits, want_logits) <= tolerance(torch.float64)
    for name, want in want_grads.items():
        assert rel_err(got_grads[name], want) <= tolerance(torch.float64), name
    # The test discriminates: without ATM the logits differ by far more than rounding.
    with torch.no_grad():
        model.eval()
        plain = model(ids, attention_mask=mask, use_cache=False).logits
    assert rel_err(plain, want_logits) > 1e-4


def test_packed_projections_run_on_merged_rows_only(monkeypatch):
    cfg = config()
    model = model_for(cfg)
    b, t = 3, 20
    ids, mask = batch(b, t, seed=2, padding="right")
    seen = record_merges(monkeypatch)
    rows = {}
    project = WiolaAttention.context_kv  # the context projections read kc_proj.weight, not the module

    def count_context_rows(attn, context):
        rows[(attn.layer_idx, "kc_proj")] = context.shape[:-1].numel()
        return project(attn, context)

    monkeypatch.setattr(WiolaAttention, "context_kv", count_context_rows)
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "o_proj"):
            getattr(layer.attn, name).register_forward_hook(
                lambda mod, inp, out, key=(i, name): rows.__setitem__(key, inp[0].reshape(-1, inp[0].shape[-1]).shape[0]))
    with torch.no_grad():
        model(ids, attention_mask=mask)
    merged_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_merge_layer(i)]
    assert merged_layers == [2, 3] and len(seen) == 2
    for i in range(cfg.num_hidden_layers):
        if i in merged_layers:
            n = int(seen[merged_layers.index(i)].sum())
            assert n < b * t
            assert rows[(i, "q_proj")] == rows[(i, "o_proj")] == n
            assert rows[(i, "kc_proj")] == n * min(i, cfg.gcla_lookback)  # Λ' slots per merged token
        else:
            assert rows[(i, "q_proj")] == rows[(i, "o_proj")] == b * t


def _projection_flops(cfg: WiolaConfig, layer: int, tokens: int) -> int:
    """2 × multiply-adds of W_Q, W_K, W_V, W_O, W_Kc, W_Vc for ``tokens`` tokens (causal summaries)."""
    d, h, h_kv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return 2 * tokens * (2 * d * h * dh + 2 * d * h_kv * dh + 2 * min(layer, cfg.gcla_lookback) * d * h * dh)


def test_matmul_flops_saved_are_the_merged_tokens_projections(monkeypatch):
    # torch's FLOP counter sees the matrix products only (the fused attention core is not
    # counted), so packing on − off must be exactly the merged-away tokens' projections.
    cfg = config()
    model = model_for(cfg)
    b, t = 2, 32
    ids, _ = batch(b, t, seed=3, padding="none")
    for layer in model.model.layers:
        layer.attn.fold_context = "never"  # without gradients the static path would fold the context part
    seen = record_merges(monkeypatch)
    counts = {}
    for pack in (False, True):
        set_packing(model, pack)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(ids)
        counts[pack] = counter.get_total_flops()
    merged_away = [b * t - int(n.sum()) for n in seen[:2]]
    assert all(m > 0 for m in merged_away) and seen[0].tolist() == seen[2].tolist()
    want = sum(_projection_flops(cfg, layer, m) for layer, m in zip((2, 3), merged_away))
    assert counts[False] - counts[True] == want


def test_bench_attention_flops_counts_by_hand():
    cfg = config(num_hidden_layers=3, gcla_lookback=2)  # d 32, H 4, H_kv 2, d_h 8
    # layer 2 (Λ' = 2), one row of 3 tokens: per token W_Q 32·32 + W_K, W_V 2·32·16 + W_O 32·32
    # + cross 2·4·2·8 multiply-adds, W_Kc/W_Vc 2·2·32·32; core 2·4·8·(1+2+3).
    per_token = 1024 + 1024 + 1024 + 128 + 4096
    assert attention_flops(cfg, 2, [3]) == 2 * (3 * per_token + 64 * 6)
    assert attention_flops(cfg, 0, [2, 1]) == 2 * (3 * 3072 + 64 * (3 + 1))
    paper = config(num_hidden_layers=3, gcla_summary="paper")
    assert attention_flops(paper, 1, [3]) == 2 * (3 * (3072 + 64) + 2048 + 64 * 6)  # one context per row


def test_packed_rows_pack_unpack_unmerge():
    merged_len = torch.tensor([2, 0, 3])
    rows = PackedRows(merged_len, 4)
    x = torch.arange(12.0).view(3, 4, 1)
    assert rows.pack(x).flatten().tolist() == [0.0, 1.0, 8.0, 9.0, 10.0]
    assert rows.unpack(rows.pack(x)).flatten().tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 8, 9, 10, 0]
    slots = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [3, 2, 1, 0]])
    assert rows.pack(x, slots).flatten().tolist() == [1.0, 0.0, 11.0, 10.0, 9.0]
    index_map = torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3], [0, 1, 1, 2]])  # row 0: token 3 is padding
    y = torch.tensor([[10.0], [11.0], [20.0], [21.0], [22.0]])
    assert rows.unmerge(y, index_map).flatten().tolist() == [10, 10, 11, 0, 0, 0, 0, 0, 20, 21, 21, 22]
    full = PackedRows(torch.tensor([2, 3]), 3)  # no padding: every token maps inside its row
    got = full.unmerge(torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]]), torch.tensor([[0, 0, 1], [0, 1, 2]]), False)
    assert got.flatten().tolist() == [1, 1, 2, 3, 4, 5]
    heads = torch.arange(2 * 5 * 1.0).view(2, 5, 1)  # (H, N, d_h)
    padded = rows.unpack_heads(heads)
    assert padded.shape == (3, 2, 4, 1) and padded.is_contiguous()
    assert padded[2, 1, :, 0].tolist() == [7, 8, 9, 0] and padded[1].abs().sum() == 0
    assert torch.equal(rows.pack_heads(padded), heads.transpose(0, 1))


def test_bench_flop_summary_groups_calls_by_merged_layer():
    from wiola.bench import _atm_flops, _config

    args = dict(d=32, layers=6, heads=4, kv_heads=2, seq=8, batch=2, vocab=259)
    cfg = _config(args, "reference", True)
    off = [attention_flops(cfg, layer, [8, 8]) for layer in range(6)]
    # two forwards, each one call per merged layer (2, 3), in layer order
    got = _atm_flops(args, [[8, 6], [4, 4], [8, 8], [6, 6]])
    mean2 = (attention_flops(cfg, 2, [8, 6]) + attention_flops(cfg, 2, [8, 8])) / 2
    mean3 = (attention_flops(cfg, 3, [4, 4]) + attention_flops(cfg, 3, [6, 6])) / 2
    assert got["off"] == sum(off) and got["merged_layers_off"] == off[2] + off[3]
    assert got["merged_layers_on"] == mean2 + mean3
    assert got["on"] == sum(off) - off[2] - off[3] + mean2 + mean3
    assert _atm_flops(args, [])["on"] == sum(off)  # nothing recorded: nothing saved

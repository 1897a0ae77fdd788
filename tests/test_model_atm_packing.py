"""The model bench's count of GCLA's work in ATM-merged layers (python/wiola/bench/__init__.py).

The model's merged layers keep ATM's static shapes (SPEC §6.2: the attention op skips the
rows past each T'_b); ATM against the float64 oracle is tests/test_model.py's."""

from __future__ import annotations

import pytest

from wiola import WiolaConfig
from wiola.bench import attention_flops


pytestmark = pytest.mark.usefixtures("one_thread")  # small shapes: threads only add overhead


def config(**overrides) -> WiolaConfig:
    """d 32, L 6 (layers 2 and 3 merge); τ = 0 merges about half the neighbour pairs."""
    kw = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, dsff_narrow_size=32,
              dsff_wide_size=64, atm_threshold=0.0, gcla_gate_init=0.0)
    kw.update(overrides)
    return WiolaConfig.from_name("wiola-tiny", **kw)


def test_bench_attention_flops_counts_by_hand():
    cfg = config(num_hidden_layers=3, gcla_lookback=2)  # d 32, H 4, H_kv 2, d_h 8
    # layer 2 (Λ' = 2), one row of 3 tokens: per token W_Q 32·32 + W_K, W_V 2·32·16 + W_O 32·32
    # + cross 2·4·2·8 multiply-adds, W_Kc/W_Vc 2·2·32·32; core 2·4·8·(1+2+3).
    per_token = 1024 + 1024 + 1024 + 128 + 4096
    assert attention_flops(cfg, 2, [3]) == 2 * (3 * per_token + 64 * 6)
    assert attention_flops(cfg, 0, [2, 1]) == 2 * (3 * 3072 + 64 * (3 + 1))
    paper = config(num_hidden_layers=3, gcla_summary="paper")
    assert attention_flops(paper, 1, [3]) == 2 * (3 * (3072 + 64) + 2048 + 64 * 6)  # one context per row


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

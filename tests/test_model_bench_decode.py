"""``python -m wiola bench --decode``: records, floor arithmetic, the Llama twin."""

from __future__ import annotations

import json

import torch

import wiola_kernels
from wiola import WiolaConfig, WiolaForCausalLM
from wiola.bench import main as bench_main
from wiola.bench_decode import decode_rate, llama_like, weight_bytes
from wiola_kernels import decode_gemv


def test_weight_bytes_count_the_tied_matrix_once():
    config = WiolaConfig.from_name("wiola-tiny")
    model = WiolaForCausalLM(config)
    # SPEC §1 breakdown for d 128, L 6, H 4, H_kv 2, d_h 32, n 128, w 512, V 259
    d, n, w, L, V = 128, 128, 512, 6, 259
    per_layer = (d * 128 + 2 * d * 64 + 128 * d) + 2 * d * 128 + 4 + (3 * d * n + 3 * d * w + d) + 4 * d
    assert weight_bytes(model) == 4 * (V * d + L * per_layer + 2 * d)


def test_llama_twin_has_the_wiola_shape():
    config = WiolaConfig.from_name("wiola-tiny")
    llama = llama_like(config)
    c = llama.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == (128, 6, 4, 2, 32, 640, 259)
    assert llama.lm_head.weight is llama.model.embed_tokens.weight


def test_decode_rate_returns_the_greedy_tokens():
    torch.manual_seed(0)
    model = WiolaForCausalLM(WiolaConfig.from_name("wiola-tiny")).eval()
    prompt = torch.randint(3, 259, (1, 5), generator=torch.Generator().manual_seed(1))
    rate, ids = decode_rate(model, prompt, 4)
    ref = prompt
    with torch.no_grad():
        for _ in range(4):
            ref = torch.cat([ref, model(ref, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert rate > 0 and torch.equal(ids, ref[:, 5:])


def test_bench_decode_writes_the_records(tmp_path, capsys):
    out = tmp_path / "decode.json"
    records = bench_main(["--decode", "--preset", "wiola-tiny", "--prompt", "4", "--new-tokens", "3", "--dtype",
                          "bfloat16", "--repeats", "1", "--threads", "1", "--clock", "cpu", "--breakdown", "--json",
                          str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(records))
    r = saved[0]
    for key in ("preset", "tokens_per_s", "floor_tokens_per_s", "pct_of_floor", "llama_tokens_per_s", "dtype",
                "threads", "isa", "rss_growth_mb", "weight_mb"):
        assert key in r, key
    assert r["preset"] == "wiola-tiny" and r["clock"] == "cpu" and r["tokens_per_s"] > 0 and r["llama_tokens_per_s"] > 0
    assert r["dtype"] == "bfloat16" and r["threads"] == 1 and r["weight_mb"] == r["weight_bytes"] / 2**20
    assert r["weight_bytes"] == weight_bytes(WiolaForCausalLM(WiolaConfig.from_name("wiola-tiny")).bfloat16())
    assert r["isa"] == (wiola_kernels.kernel_isa("decode_gemv") if decode_gemv.available() else "none")
    assert r["rss_growth_mb"] >= 0
    assert abs(r["floor_tokens_per_s"] - r["bandwidth_bytes_per_s"] / r["weight_bytes"]) <= 1e-9 * r["floor_tokens_per_s"]
    assert abs(r["pct_of_floor"] - 100 * r["tokens_per_s"] / r["floor_tokens_per_s"]) <= 1e-9 * r["pct_of_floor"]
    assert r["step_s"] > 0 and r["gemv_s"] > 0  # --breakdown
    assert "of the floor" in capsys.readouterr().out

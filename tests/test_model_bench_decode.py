"""``python -m wiola bench --decode``: records, floor arithmetic, the Llama twin."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import numpy as np
import pytest
import torch

import wiola_kernels
from wiola import WiolaConfig, WiolaForCausalLM
from wiola.bench import main as bench_main
from wiola.bench.decode import decode_rate, llama_like, weight_bytes
from wiola_kernels.decode import gemv as decode_gemv


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
    assert r["llama_cpp_tokens_per_s"] is None and r["per_param_vs_llama_cpp"] is None  # no --llama-cpp
    assert abs(r["floor_tokens_per_s"] - r["bandwidth_bytes_per_s"] / r["weight_bytes"]) <= 1e-9 * r["floor_tokens_per_s"]
    assert abs(r["pct_of_floor"] - 100 * r["tokens_per_s"] / r["floor_tokens_per_s"]) <= 1e-9 * r["pct_of_floor"]
    assert r["step_s"] > 0 and r["gemv_s"] > 0  # --breakdown
    assert "of the floor" in capsys.readouterr().out


def test_bench_decode_alternates_several_dtypes(tmp_path, monkeypatch, capsys):
    # --dtype float32,bfloat16: both dtypes' models in every round, one record each; the second
    # is reported against the first as the median of the rounds' own ratios (a fake decode_rate
    # gives each run a known rate, so the median is of pairs, not a ratio of medians).
    from wiola.bench import decode as bench_decode

    rates = iter([10.0, 20.0, 12.0, 30.0, 8.0, 10.0])  # rounds: (fp32, bf16) × 3 → ratios 2, 2.5, 1.25
    calls = []

    def fake_rate(model, prompt, new_tokens, clock="wall"):
        if prompt.shape[1] == 4 and new_tokens == 3 and len(calls) >= 2 * 2:  # after the first generates and warm-ups
            calls.append(model.dtype)
            return next(rates), None
        calls.append(None)
        return 1.0, None

    monkeypatch.setattr(bench_decode, "decode_rate", fake_rate)
    records = bench_main(["--decode", "--preset", "wiola-tiny", "--prompt", "4", "--new-tokens", "3", "--dtype",
                          "float32,bfloat16", "--repeats", "3", "--threads", "1", "--no-llama"])
    assert [r["dtype"] for r in records] == ["float32", "bfloat16"]
    assert [c for c in calls if c is not None] == [torch.float32, torch.bfloat16] * 3  # alternating, round by round
    fp32, bf16 = records
    assert fp32["runs"]["wiola"] == [10.0, 12.0, 8.0] and bf16["runs"]["wiola"] == [20.0, 30.0, 10.0]
    assert fp32["vs_dtype"] is None and fp32["tokens_per_s_ratio"] is None
    assert bf16["vs_dtype"] == "float32" and bf16["tokens_per_s_ratio"] == 2.0  # median of 2, 2.5, 1.25
    assert bf16["weight_bytes"] * 2 == fp32["weight_bytes"]
    assert bf16["bandwidth_bytes_per_s"] == fp32["bandwidth_bytes_per_s"]  # one floor measurement per round
    assert "bfloat16: tok/s / float32's" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["float64", "float32,float32", "float32,", ""])
def test_bench_decode_refuses_a_bad_dtype_list(bad, capsys):
    with pytest.raises(SystemExit):
        bench_main(["--decode", "--preset", "wiola-tiny", "--dtype", bad])
    assert "--dtype" in capsys.readouterr().err


# llama.cpp (wiola/bench/llama_cpp.py): the GGUF file read back with gguf's own reader, llama-bench faked.

GGUF_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _gguf_array(tensor) -> np.ndarray:
    """A GGUF tensor's values as float32, in Hugging Face's (rows, columns) order; BF16 widened by hand
    (the reader hands its raw bytes), not through the gguf package that wrote it."""
    data = np.asarray(tensor.data)
    if tensor.tensor_type.name == "BF16":
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def _rotary_order(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order of a Q or K projection: within each head, row 2j + s is Hugging Face's
    row s·d_h/2 + j (the pair rotate_half rotates together becomes adjacent)."""
    d_h = w.shape[0] // n_head
    rows = [h * d_h + s * (d_h // 2) + j for h in range(n_head) for j in range(d_h // 2) for s in range(2)]
    return w[rows]


@pytest.mark.parametrize("dtype", list(GGUF_DTYPES), ids=lambda d: str(d).removeprefix("torch."))
def test_gguf_file_is_the_llama_twin(tmp_path, dtype):
    gguf = pytest.importorskip("gguf")
    from wiola.bench.llama_cpp import write_gguf

    config = WiolaConfig.from_name("wiola-tiny", vocab_size=262)  # three filler tokens after the 259 required
    llama = llama_like(config)
    write_gguf(llama, tmp_path / "twin.gguf", dtype)
    reader = gguf.GGUFReader(tmp_path / "twin.gguf")
    field = {name: f.contents() for name, f in reader.fields.items()}
    assert field["general.architecture"] == "llama"
    assert field["general.file_type"] == {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}[dtype]
    assert {k: field[f"llama.{k}"] for k in ("context_length", "embedding_length", "block_count", "feed_forward_length",
                                             "attention.head_count", "attention.head_count_kv", "attention.key_length",
                                             "attention.value_length", "rope.dimension_count")} == {
        "context_length": 1024, "embedding_length": 128, "block_count": 6, "feed_forward_length": 640,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 32,
        "attention.value_length": 32, "rope.dimension_count": 32}
    assert field["llama.rope.freq_base"] == 10000.0
    assert field["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6, rel=1e-6)  # stored as f32
    tokens = field["tokenizer.ggml.tokens"]
    assert field["tokenizer.ggml.model"] == "llama" and len(tokens) == 262
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and tokens[258:] == ["<0xFF>", "▁tok0", "▁tok1", "▁tok2"]
    assert field["tokenizer.ggml.scores"][-3:] == [0.0, -1.0, -2.0]
    assert field["tokenizer.ggml.token_type"] == [2, 3, 3] + [6] * 256 + [1] * 3  # unknown, control, byte, normal
    assert (field["tokenizer.ggml.bos_token_id"], field["tokenizer.ggml.eos_token_id"],
            field["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)

    sd = llama.state_dict()
    blocks = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    want = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    for i in range(6):
        for name, hf in blocks.items():
            want[f"blk.{i}.{name}.weight"] = sd[f"model.layers.{i}.{hf}.weight"]
        want[f"blk.{i}.attn_q.weight"] = _rotary_order(want[f"blk.{i}.attn_q.weight"], 4)
        want[f"blk.{i}.attn_k.weight"] = _rotary_order(want[f"blk.{i}.attn_k.weight"], 2)
    got = {t.name: t for t in reader.tensors}
    assert sorted(got) == sorted(want)  # no output.weight: llama.cpp reads token_embd as the tied head
    for name, w in want.items():
        t = got[name]
        assert t.tensor_type.name == ("F32" if w.ndim == 1 else GGUF_DTYPES[dtype]), name
        assert list(t.shape) == list(reversed(w.shape)), name  # ggml lists the fastest dimension first
        # exactly torch's rounding to the dtype (both round to nearest even); norms stay float32
        expect = w if w.ndim == 1 else w.to(dtype).float()
        assert np.array_equal(_gguf_array(t), expect.numpy()), name


def test_gguf_needs_a_sentencepiece_sized_vocabulary(tmp_path):
    pytest.importorskip("gguf")
    from wiola.bench.llama_cpp import write_gguf

    llama = llama_like(WiolaConfig.from_name("wiola-tiny", vocab_size=258))
    with pytest.raises(ValueError, match="at least 259"):
        write_gguf(llama, tmp_path / "small.gguf", torch.float32)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        write_gguf(llama_like(WiolaConfig.from_name("wiola-tiny")), tmp_path / "f64.gguf", torch.float64)


FAKE_RECORD = {"build_commit": "fake123", "model_n_params": 1000, "model_size": 4000, "type_k": "f16",
               "n_prompt": 0, "n_gen": 3, "avg_ts": 50.0, "samples_ts": [50.0]}


def _fake_llama_bench(tmp_path, body: str) -> str:
    """An executable ``llama-bench`` that records its arguments (and whether ``-m`` is a GGUF file)
    in ``argv.json`` beside it, then runs ``body`` (Python)."""
    script = tmp_path / "fake_llama_bench.py"
    script.write_text(textwrap.dedent(f"""\
        import json, os, sys
        args = sys.argv[1:]
        model = args[args.index("-m") + 1] if "-m" in args else None
        magic = open(model, "rb").read(4).decode() if model and os.path.exists(model) else None
        with open({str(tmp_path / "argv.json")!r}, "w") as f:
            json.dump({{"argv": args, "magic": magic}}, f)
        """) + textwrap.dedent(body))
    binary = tmp_path / "llama-bench"
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    binary.chmod(0o755)
    return str(binary)


def test_run_llama_bench_passes_the_decode_test_and_reads_its_json(tmp_path):
    from wiola.bench.llama_cpp import run_llama_bench

    fake = _fake_llama_bench(tmp_path, f"print(json.dumps([{FAKE_RECORD!r}]))")
    got = run_llama_bench(fake, tmp_path / "m.gguf", threads=2, prompt=4, new_tokens=3, repeats=5)
    argv = json.loads((tmp_path / "argv.json").read_text())["argv"]
    assert argv == ["-m", str(tmp_path / "m.gguf"), "-t", "2", "-p", "0", "-n", "3", "-d", "4", "-r", "5", "-o", "json"]
    assert got == {"tokens_per_s": 50.0, "samples_ts": [50.0], "model_n_params": 1000, "model_size": 4000,
                   "build_commit": "fake123", "type_k": "f16"}


def test_run_llama_bench_refuses_what_it_cannot_use(tmp_path):
    from wiola.bench.llama_cpp import run_llama_bench

    with pytest.raises(ValueError, match="--llama-cpp"):
        run_llama_bench(str(tmp_path / "missing"), "m.gguf", 1, 4, 3)
    (tmp_path / "plain").write_text("not executable")
    with pytest.raises(ValueError, match="--llama-cpp"):
        run_llama_bench(str(tmp_path / "plain"), "m.gguf", 1, 4, 3)
    failing = _fake_llama_bench(tmp_path, 'sys.stderr.write("loading\\nerror: failed to load model\\n"); sys.exit(1)')
    with pytest.raises(RuntimeError, match="(?s)status 1.*failed to load model"):
        run_llama_bench(failing, "m.gguf", 1, 4, 3)
    for output in ('print("| model | size |")', 'print(json.dumps([{"avg_ts": 1.0}]))', 'print("[]")'):
        with pytest.raises(RuntimeError, match="llama-bench"):
            run_llama_bench(_fake_llama_bench(tmp_path, output), "m.gguf", 1, 4, 3)


def test_bench_decode_times_llama_cpp_on_the_gguf_file(tmp_path, capsys):
    pytest.importorskip("gguf")
    fake = _fake_llama_bench(tmp_path, f"print(json.dumps([{FAKE_RECORD!r}]))")
    out = tmp_path / "decode.json"
    records = bench_main(["--decode", "--preset", "wiola-tiny", "--llama-cpp", fake, "--new-tokens", "3", "--prompt", "4",
                          "--repeats", "1", "--threads", "1", "--no-llama", "--json", str(out)])
    r = json.loads(out.read_text())[0]
    assert r == json.loads(json.dumps(records[0]))
    assert (r["llama_cpp_tokens_per_s"], r["llama_cpp_params"], r["llama_cpp_build"]) == (50.0, 1000, "fake123")
    assert r["runs"]["llama.cpp"] == [50.0] and r["llama_tokens_per_s"] is None  # --no-llama skips only the HF Llama
    assert r["per_param_vs_llama_cpp"] == pytest.approx(r["tokens_per_s"] * r["params"] / (50.0 * 1000), rel=1e-12)
    seen = json.loads((tmp_path / "argv.json").read_text())
    argv = seen["argv"]
    assert seen["magic"] == "GGUF" and argv[argv.index("-t") + 1] == "1"
    assert argv[argv.index("-n") + 1] == "3" and argv[argv.index("-d") + 1] == "4"
    assert not os.path.exists(argv[argv.index("-m") + 1])  # the temporary directory is gone
    assert "llama.cpp (0.0M, build fake123" in capsys.readouterr().out

"""``python -m wiola_kernels bench --hf FAMILY`` and ``--hf all`` (wiola_kernels/bench/hf.py): every
family :func:`wiola_kernels.patch_hf` supports has its benchmark model, with the family's own
conventions, and one tiny training step of it runs unpatched and patched. No timing is asserted:
only that the steps run, agree and are reported (the Llama command's own test: tests/test_hf.py)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

import wiola_kernels as wk
from wiola_kernels import __main__ as kernels_cli
from wiola_kernels.bench import hf as bench_hf

transformers = pytest.importorskip("transformers")


def test_the_families_are_the_ones_patch_hf_supports():
    assert bench_hf.FAMILIES == tuple(wk.hf.supported()) == tuple(wk.hf._FAMILIES)
    assert set(bench_hf.FAMILY_QUIRKS) == set(bench_hf.FAMILIES)


@pytest.mark.parametrize("family", bench_hf.FAMILIES)
def test_each_family_has_the_llama_bench_sizes_and_its_own_conventions(family):
    case = bench_hf.hf_case(family, "cpu")
    cfg = case.config()
    assert cfg.model_type == family and case.op == f"hf_{family}_step"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (512, 4, 8, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, case.batch, case.length) == (1376, 32000, 2, 1024)
    assert getattr(cfg, "head_dim", None) in (None, 64) and case.dtype == torch.float32
    assert all(t is None or 0 <= t < cfg.vocab_size for t in (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id))
    assert case.model_class().__name__.endswith("ForCausalLM")
    assert case.attn == ("eager" if family == "gemma2" else "sdpa")
    if family == "gemma2":  # soft-capping (which SDPA cannot do), both layer types within T
        assert cfg.final_logit_softcapping == 30.0 and cfg.attn_logit_softcapping == 50.0
        assert set(cfg.layer_types) == {"sliding_attention", "full_attention"} and cfg.sliding_window < case.length
    if family == "gemma3_text":
        assert cfg.layer_types[-1] == "full_attention" and "sliding_attention" in cfg.layer_types
        assert cfg.sliding_window < case.length
    if family == "smollm3":
        assert cfg.no_rope_layers == [1, 1, 1, 0]
    assert case.tied == (family in ("gemma2", "gemma3_text", "smollm3"))
    assert bench_hf.hf_case(family, "cpu", dtype="bfloat16").dtype == torch.bfloat16
    if family != "llama":
        with pytest.raises(ValueError, match="--size 1b: only with --hf llama"):
            bench_hf.hf_case(family, "cpu", size="1b")


def _layer_types(model) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", bench_hf.FAMILIES)
def test_one_tiny_step_of_each_family_runs_unpatched_and_patched(family, dtype, monkeypatch):
    case = bench_hf.hf_case(family, "cpu", small=True, dtype=dtype)
    model = case.make_model()
    names = _layer_types(model)
    # The family's own modules, which the patch then swaps.
    own = {"qwen3": "Qwen3RMSNorm", "gemma2": "Gemma2MLP", "gemma3_text": "Gemma3RMSNorm", "phi3": "Phi3MLP",
           "olmo2": "Olmo2RMSNorm", "smollm3": "SmolLM3MLP"}.get(family)
    assert own is None or own in names
    if family == "phi3":
        assert hasattr(model.model.layers[0].mlp, "gate_up_proj") and hasattr(model.model.layers[0].self_attn, "qkv_proj")
    if family == "qwen3":
        assert hasattr(model.model.layers[0].self_attn, "q_norm")
    del model
    patched = []
    real_variant = bench_hf._variant

    def variant(base, v):  # record what each patched model was swapped to
        model, scope = real_variant(base, v)
        if v.startswith("patched"):
            patched.append(_layer_types(model))
        return model, scope

    monkeypatch.setattr(bench_hf, "_variant", variant)
    records = bench_hf.run_hf_bench(case, repeats=1, warmup=1, variants=bench_hf.ALL_VARIANTS)
    assert [r["variant"] for r in records] == ["unpatched_eager", "patched_eager"]
    assert len(patched) == 1 and "FusedRotaryEmbedding" in patched[0]
    assert {"FusedGatedMLP", "FusedPackedGatedMLP"} & patched[0]
    for r in records:
        assert "skipped" not in r and r["family"] == family and r["dtype"] == dtype and r["repeats"] == 1
        for key in ("tokens_per_s", "ms", "cpu_ms", "peak_mb", "loss", "speedup_vs_unpatched_eager",
                    "wall_speedup_vs_unpatched_eager"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["variant"], key)
    assert records[0]["speedup_vs_unpatched_eager"] == records[0]["wall_speedup_vs_unpatched_eager"] == 1.0
    assert records[1]["wall_speedup_vs_unpatched_eager"] == records[0]["ms"] / records[1]["ms"]
    # The same weights and batch: the first losses agree (fp32 closely; bf16 rounds differently).
    tol = 1e-4 if dtype == "float32" else 2e-2
    assert abs(records[0]["loss"] - records[1]["loss"]) <= tol * records[0]["loss"], records
    assert f"{family:<12} patched_eager" in bench_hf.format_hf_all_row(records[1])
    r = records[1]
    assert (f"{family:<12} {r['speedup_vs_unpatched_eager']:.3f}x tokens/s "
            f"({r['wall_speedup_vs_unpatched_eager']:.3f}x by wall time)") in bench_hf.format_hf_all_summary(records)


def test_a_family_past_its_budget_is_skipped_with_the_reason():
    case = bench_hf.hf_case("qwen3", "cpu", small=True)
    seen = []
    records = bench_hf.run_hf_bench(case, repeats=3, warmup=1, variants=bench_hf.ALL_VARIANTS, budget_s=1e-3,
                                    on_record=seen.append)
    assert seen == records and [r["variant"] for r in records] == ["unpatched_eager", "patched_eager"]
    assert all(r["skipped"].startswith("> 0.001 s, skipped (building, warm-up") for r in records)
    assert "skipped: > 0.001 s" in bench_hf.format_hf_all_row(records[0])


def test_the_timed_rounds_are_as_many_as_the_budget_leaves(monkeypatch):
    real_peak = bench_hf.peak_mb

    def slow_peak(step, device):  # each variant's peak-memory step takes >= 2 s: a round >= 4 s
        out = real_peak(step, device)
        time.sleep(2.0)
        return out

    monkeypatch.setattr(bench_hf, "peak_mb", slow_peak)
    case = bench_hf.hf_case("llama", "cpu", small=True)
    records = bench_hf.run_hf_bench(case, repeats=10, warmup=1, variants=bench_hf.ALL_VARIANTS, budget_s=8.0)
    # At most 4 s were left after the peak steps, one round takes >= 4 s: one round (not 10, not 0).
    assert [r["repeats"] for r in records] == [1, 1] and all(r["budget_s"] == 8.0 for r in records)


def test_cli_takes_every_family_and_all(monkeypatch, capsys):
    seen = []

    def fake_run(case, repeats, backend, progress, variants, on_record):
        seen.append((case.family, case.dtype, tuple(variants), repeats))
        return [{"op": case.op, "family": case.family, "variant": v, "skipped": "fake"} for v in variants]

    monkeypatch.setattr(bench_hf, "run_hf_bench", fake_run)
    for family in bench_hf.FAMILIES:
        assert kernels_cli.main(["bench", "--hf", family, "--device", "cpu", "--small", "--dtype", "bfloat16"]) == 0
    assert [s[0] for s in seen] == list(bench_hf.FAMILIES)
    assert all(s[1] == torch.bfloat16 and s[2] == bench_hf.DEFAULT_VARIANTS and s[3] == 10 for s in seen)
    for argv, message in ((["--hf", "qwen3", "--size", "1b"], "--size 1b: only with --hf llama"),
                          (["--hf", "all", "--size", "1b"], "--size 1b: only with --hf llama"),
                          (["--hf", "all", "--sequential"], "--sequential: not with --hf all"),
                          (["--hf", "phi3", "--variants", "eager"], "--variants: unknown")):
        assert kernels_cli.main(["bench", "--device", "cpu", *argv]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kernels_cli.main(["bench", "--hf", "bloom"])
    assert "argument --hf: invalid choice: 'bloom'" in capsys.readouterr().err


def test_bench_hf_all_prints_every_familys_rows_and_writes_them(tmp_path, capsys):
    # Every family, one tiny step each way, through the command's main; no timing asserted.
    out = tmp_path / "all.json"
    assert kernels_cli.main(["bench", "--hf", "all", "--small", "--repeats", "1", "--device", "cpu", "--json",
                             str(out)]) == 0
    stdout = capsys.readouterr().out
    records = json.loads(out.read_text())
    assert [(r["family"], r["variant"]) for r in records] == \
        [(f, v) for f in bench_hf.FAMILIES for v in ("unpatched_eager", "patched_eager")]
    for r in records:
        assert "skipped" not in r, r
        assert r["op"] == f"hf_{r['family']}_step" and r["dtype"] == "float32" and r["tokens_per_s"] > 0
    for family in bench_hf.FAMILIES:
        assert f"  {family:<12} patched_eager " in stdout
        assert f"  {family:<12} {bench_hf.FAMILY_QUIRKS[family]}" in stdout
    assert "patched eager vs unpatched eager, per family" in stdout

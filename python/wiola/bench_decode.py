"""``python -m wiola bench --decode``: batch-1 greedy decoding on the CPU, against the
weight-streaming floor and a Hugging Face Llama of the same shape.

    python -m wiola bench --decode                       # wiola-360m, 128-token prompt, 64 new tokens
    python -m wiola bench --decode --preset wiola-120m --repeats 3 --json decode.json

* Tokens/s: ``generate(do_sample=False)`` of ``--new-tokens`` after a random
  ``--prompt``-token prompt, random weights, fp32. Each decoding step is timestamped by a
  logits processor; the rate is ``(n − 1)`` steps over the time from the first to the last
  step (the prompt's forward is excluded). Median over ``--repeats`` runs, Wiola and Llama
  alternating so that a change in machine load hits both.
* Weight-streaming floor: at batch 1 every weight is read once per token, so decoding
  cannot beat ``bandwidth ÷ bytes of weights`` (the tied embedding is read once, as the
  output head). The bandwidth is measured here: the larger of a read-only pass
  (``torch.sum``) and a copy (bytes read + written) over a 512 MiB buffer, with the same
  threads — the strictest floor of the two.
* Llama: ``LlamaForCausalLM`` with Wiola's width, depth, heads, vocabulary and an MLP of
  ``n + w`` (DSFF's two streams), tied embeddings, SDPA attention. Per-parameter parity
  means ``tokens/s × parameters`` at least the Llama's.

JSON records: ``preset, tokens_per_s, floor_tokens_per_s, pct_of_floor, llama_tokens_per_s``
and the parameter counts, bandwidth and threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def measure_bandwidth(mib: int = 512, repeats: int = 5, clock=time.perf_counter) -> dict:
    """Bytes per second of a read-only pass and of a copy over ``mib`` MiB (best of ``repeats``),
    timed with ``clock`` (the decoding runs' own)."""
    n = mib * 2**20 // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    reads, copies = [], []
    for _ in range(repeats):
        t0 = clock()
        float(src.sum())
        t1 = clock()
        dst.copy_(src)
        t2 = clock()
        reads.append(4 * n / (t1 - t0))
        copies.append(2 * 4 * n / (t2 - t1))
    return {"read_bytes_per_s": max(reads), "copy_bytes_per_s": max(copies)}


class _StepClock:
    """A logits processor that records when each decoding step's logits are ready."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(self.clock())
        return scores


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def decode_rate(model, prompt: torch.Tensor, new_tokens: int, clock: str = "wall") -> tuple[float, torch.Tensor]:
    """``(steps per second after the prompt, generated ids)`` of greedy decoding; ``clock``
    "cpu" counts this process's CPU time (for one thread on a loaded machine)."""
    from transformers import LogitsProcessorList

    clock = _StepClock(CLOCKS[clock])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]))
    steps = len(clock.times) - 1
    return steps / (clock.times[-1] - clock.times[0]), out[:, prompt.shape[1]:]


def llama_like(config):
    """A random ``LlamaForCausalLM`` of the Wiola config's shape (MLP width n + w, tied, SDPA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                      intermediate_size=config.dsff_narrow_size + config.dsff_wide_size,
                      num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
                      num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                      max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def weight_bytes(model) -> int:
    """Bytes of distinct parameters (a tied matrix counts once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def main(argv: list[str] | None = None) -> list[dict]:
    """Command line: print and optionally write the decoding benchmark."""
    p = argparse.ArgumentParser(prog="python -m wiola bench --decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", action="store_true", help="(selects this benchmark)")
    p.add_argument("--preset", default="wiola-360m")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each model (median reported)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--no-llama", action="store_true", help="skip the Llama comparison")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or this process's CPU time (with --threads 1 on a machine other jobs load)")
    p.add_argument("--json", default=None, help="also write the records here")
    a = p.parse_args(argv)
    if a.new_tokens < 2 or a.prompt < 1 or a.repeats < 1:
        raise SystemExit("--new-tokens must be ≥ 2, --prompt and --repeats ≥ 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    from .configuration_wiola import WiolaConfig
    from .modeling_wiola import WiolaForCausalLM

    config = WiolaConfig.from_name(a.preset)
    torch.manual_seed(0)
    models = {"wiola": WiolaForCausalLM(config).eval()}
    if not a.no_llama:
        torch.manual_seed(0)
        models["llama"] = llama_like(config)
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    prompt = torch.randint(3, config.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(0))
    print(f"wiola bench --decode: {a.preset} ({params['wiola'] / 1e6:.1f}M parameters), batch 1, prompt {a.prompt}, "
          f"{a.new_tokens} new tokens, greedy, fp32, {torch.get_num_threads()} threads, {a.clock} clock", flush=True)
    bw = measure_bandwidth(clock=CLOCKS[a.clock])
    bandwidth = max(bw["read_bytes_per_s"], bw["copy_bytes_per_s"])
    rates: dict[str, list[float]] = {k: [] for k in models}
    for name, model in models.items():  # warm-up (allocator, one-time kernel selection)
        decode_rate(model, prompt[:, :8], 2)
    for _ in range(a.repeats):
        for name, model in models.items():
            rates[name].append(decode_rate(model, prompt, a.new_tokens, a.clock)[0])
    wiola_bytes = weight_bytes(models["wiola"])
    floor = bandwidth / wiola_bytes
    tps = statistics.median(rates["wiola"])
    record = dict(preset=a.preset, tokens_per_s=tps, floor_tokens_per_s=floor, pct_of_floor=100 * tps / floor,
                  llama_tokens_per_s=statistics.median(rates["llama"]) if "llama" in rates else None,
                  params=params["wiola"], llama_params=params.get("llama"), weight_bytes=wiola_bytes,
                  bandwidth_bytes_per_s=bandwidth, threads=torch.get_num_threads(), clock=a.clock, runs=rates)
    print(f"  bandwidth: read {bw['read_bytes_per_s'] / 1e9:.2f} GB/s, copy {bw['copy_bytes_per_s'] / 1e9:.2f} GB/s "
          f"(read + write); floor = {bandwidth / 1e9:.2f} GB/s / {wiola_bytes / 1e9:.3f} GB of weights = "
          f"{floor:.2f} tok/s")
    print(f"  wiola: {tps:.2f} tok/s ({record['pct_of_floor']:.0f}% of the floor; target >= 80%) "
          f"runs {[round(r, 2) for r in rates['wiola']]}")
    if "llama" in rates:
        llama = record["llama_tokens_per_s"]
        parity = tps * params["wiola"] / (llama * params["llama"])
        record["per_param_vs_llama"] = parity
        print(f"  llama ({params['llama'] / 1e6:.1f}M): {llama:.2f} tok/s; wiola tok/s x params / llama's = "
              f"{parity:.2f} (target >= 1.0) runs {[round(r, 2) for r in rates['llama']]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([record], f, indent=2)
    return [record]


__all__ = ["decode_rate", "llama_like", "main", "measure_bandwidth", "weight_bytes"]

"""``python -m wiola bench --decode``: batch-1 greedy decoding on the CPU, against the
weight-streaming floor, a Hugging Face Llama of the same shape and, optionally, llama.cpp.

    python -m wiola bench --decode                       # wiola-360m, 128-token prompt, 64 new tokens, fp32
    python -m wiola bench --decode --dtype bfloat16 --threads 2
    python -m wiola bench --decode --dtype bfloat16 --threads 2 --llama-cpp /path/to/llama-bench
    python -m wiola bench --decode --dtype float32,bfloat16 --threads 2   # both, in the same rounds
    python -m wiola bench --decode --preset wiola-120m --repeats 3 --json decode.json

* Tokens/s: ``generate(do_sample=False)`` of ``--new-tokens`` after a random
  ``--prompt``-token prompt, random weights in ``--dtype``. Each decoding step is
  timestamped by a logits processor; the rate is ``(n − 1)`` steps over the time from the
  first to the last step (the prompt's forward is excluded). Median over ``--repeats``
  runs, Wiola and Llama alternating so that a change in machine load hits both.
* Several dtypes (``--dtype float32,bfloat16``): every round runs each dtype's models in
  turn, and a dtype after the first is reported against it round by round (the median of
  the per-round ratios of tokens/s): on a machine whose bandwidth moves by ±20 % between
  runs (other tenants), separate runs of the two dtypes measure the load as much as the
  dtypes.
* Weight-streaming floor: at batch 1 every weight is read once per token, so decoding
  cannot beat ``bandwidth ÷ bytes of weights`` (the tied embedding is read once, as the
  output head; the decoding path reads the parameters themselves, in their dtype). The
  bandwidth is measured here: the larger of a read-only pass (``torch.sum``) and a copy
  (bytes read + written) over a 512 MiB buffer, with the same threads — the strictest floor
  of the two. It is measured before every round, so that it sees the load the round's
  decoding sees (on a machine other jobs load, a bandwidth taken once, at the start, moved
  by ±15 % against the runs), and the median is reported.
* Memory: the growth of the process's resident set during the model's first ``generate``
  (peak minus before, from ``VmHWM`` reset through ``/proc/self/clear_refs``, else sampled),
  against the weights' bytes and the KV cache's: decoding that kept a second copy of the
  weights would grow by their size. With several dtypes, the first dtype's ``generate`` also
  holds the process's one-time allocations (code, thread pools, ~15–20 MiB) that the later
  ones reuse.
* ``--breakdown``: the decoding step's time against its weight reads alone — the same
  GEMVs on the same weights, nothing else — alternating; what the GEMVs reach is the
  ceiling the rest of the step (attention, norms, Python) lowers.
* Llama: ``LlamaForCausalLM`` with Wiola's width, depth, heads, vocabulary and an MLP of
  ``n + w`` (DSFF's two streams), tied embeddings, SDPA attention, in the same dtype.
  Per-parameter parity means ``tokens/s × parameters`` at least the Llama's.
* ``--llama-cpp BIN``: llama.cpp's ``llama-bench`` (a build of the machine's own, e.g.
  ``llama.cpp/build/bin/llama-bench``) on the same Llama — the same random weights (seed 0),
  written as a GGUF file in the run's dtype (F32, F16 or BF16 matrices, F32 norms, as
  llama.cpp's converter writes them; :mod:`wiola.bench.llama_cpp`) into ``--gguf-dir`` or a
  temporary directory. Once per round, beside our runs, it decodes ``--new-tokens`` after a
  context of ``--prompt`` tokens (``-d``; its warm-up and the context's fill are not timed),
  with the same thread count in its own thread pool, timed by its wall clock whatever
  ``--clock`` says. llama.cpp keeps its KV cache in F16 by default, whatever the weights.

JSON records: ``preset, dtype, threads, isa, tokens_per_s, floor_tokens_per_s, pct_of_floor,
llama_tokens_per_s, rss_growth_mb, weight_mb, kv_cache_mb`` (MiB), the parameter counts, the
bandwidth and the runs; with ``--llama-cpp``, ``llama_cpp_tokens_per_s, llama_cpp_params``
(llama-bench's count), ``per_param_vs_llama_cpp`` and ``llama_cpp_build`` (its commit),
otherwise None; ``vs_dtype`` and ``tokens_per_s_ratio`` (this dtype's tokens/s over
``vs_dtype``'s, the first ``--dtype``, median of the rounds' ratios; None for the first).
``isa`` is the level the decoding GEMV ran at (:func:`wiola_kernels.kernel_isa`), or
``"none"`` where decoding does not use it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import tempfile
import threading
import time

import torch

from wiola_kernels.cli import CommandError

from .llama_cpp import find_llama_bench, run_llama_bench, write_gguf


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


def _status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``), or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class RssPeak:
    """The peak resident set inside a ``with`` block, in bytes: ``VmHWM`` after resetting it
    (``/proc/self/clear_refs``), else the largest ``VmRSS`` a sampling thread saw (every 2 ms).
    ``before`` is the resident set on entry; ``growth`` the peak minus it."""

    def __enter__(self):
        self.before = 1024 * (_status_kib("VmRSS") or 0)
        self._hwm = False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._hwm = _status_kib("VmHWM") is not None
        except OSError:
            pass
        self._samples = [self.before]
        self._stop = threading.Event()
        if not self._hwm:
            def sample():
                while not self._stop.wait(0.002):
                    self._samples.append(1024 * (_status_kib("VmRSS") or 0))
            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._hwm:
            self.peak = 1024 * _status_kib("VmHWM")
        else:
            self._thread.join()
            self.peak = max(self._samples + [1024 * (_status_kib("VmRSS") or 0)])
        self.growth = self.peak - self.before
        return False


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


def _weight_reads(model) -> None:
    """The products of one decoding step of ``model`` (a WiolaForCausalLM, batch 1) on its own
    weights, grouped as the step groups them (decode.py), on constant activations: only the
    weight reads."""
    from wiola_kernels.decode.gemv import gemv

    from ..decode import gemv_applies

    inner = model.model
    dtype = inner.embed_tokens.weight.dtype
    d = model.config.hidden_size
    x = torch.ones(1, 1, d, dtype=dtype)
    if gemv_applies(dtype, x.device) and inner.decode_packing:
        for i, blk in enumerate(inner.layers):
            a, f = blk.attn, blk.ffn
            gemv(x, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            slots = min(i, model.config.gcla_lookback)  # the context slots of layer i, through W_Kc and W_Vc
            if slots == 1:
                gemv(torch.ones(1, d, dtype=dtype), a.vc_proj.weight)
            elif slots:
                gemv(torch.ones(slots, d, dtype=dtype), [a.kc_proj.weight, a.vc_proj.weight])
            gemv(x, a.o_proj.weight)
            gemv(x, [f.w_n1.weight, f.w_n3.weight, f.w_w1.weight, f.w_w3.weight])
            gemv(torch.ones(1, 1, f.w_n2.in_features + f.w_w2.in_features, dtype=dtype), [f.w_n2.weight, f.w_w2.weight],
                 split_input=True)
        gemv(x, model.lm_head.weight)
        return
    packed = inner._decode_weights
    for blk in inner.layers:
        a, f = blk.attn, blk.ffn
        got = packed.blocks.get(blk.layer_idx) if packed is not None else None
        if got is not None:
            qkv, up = got
            x @ qkv.t, x @ up.t
        else:
            a.q_proj(x), a.k_proj(x), a.v_proj(x), f.w_n1(x), f.w_n3(x), f.w_w1(x), f.w_w3(x)
        h, dh = a.n_head, a.head_dim
        q = torch.ones(1, h, dh, dtype=dtype)  # the context slots' part reads W_Kc and W_Vc by heads
        q_hat = torch.einsum("nhe,hed->nhd", q, a.kc_proj.weight.view(h, dh, d))
        torch.einsum("nhd,hed->nhe", q_hat, a.vc_proj.weight.view(h, dh, d))
        a.o_proj(x), f.w_n2(torch.ones(1, 1, f.w_n2.in_features, dtype=dtype))
        f.w_w2(torch.ones(1, 1, f.w_w2.in_features, dtype=dtype))
    if packed is not None and packed.head is not None:
        x @ packed.head.t
    else:
        model.lm_head(x)


def step_breakdown(model, prompt: torch.Tensor, clock: str = "wall", rounds: int = 5, steps: int = 4
                   ) -> tuple[float, float]:
    """``(seconds per decoding step, seconds of its weight reads alone)``, medians of
    ``rounds`` alternating runs of ``steps`` each, after ``prompt`` (batch 1)."""
    tick = CLOCKS[clock]
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
        model(tok, cache=cache, use_cache=True)  # the first step (one-time allocations)
        step_times, read_times = [], []
        for _ in range(rounds):
            t0 = tick()
            for _ in range(steps):
                model(tok, cache=cache, use_cache=True)
            t1 = tick()
            for _ in range(steps):
                _weight_reads(model)
            t2 = tick()
            step_times.append((t1 - t0) / steps)
            read_times.append((t2 - t1) / steps)
    return statistics.median(step_times), statistics.median(read_times)


def llama_like(config):
    """A random ``LlamaForCausalLM`` of the Wiola config's shape (MLP width n + w, tied, SDPA), float32."""
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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_bytes(config, positions: int, dtype: torch.dtype) -> int:
    """Bytes of the keys and values of ``positions`` positions (batch 1, every layer)."""
    per = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per * positions * torch.empty(0, dtype=dtype).element_size()


def gemv_isa(model) -> str:
    """The level the decoding GEMV runs at for ``model`` (a WiolaForCausalLM), or ``"none"``."""
    import wiola_kernels

    from ..decode import gemv_applies

    weight = model.model.embed_tokens.weight
    if not (model.model.decode_packing and gemv_applies(weight.dtype, weight.device)):
        return "none"
    return wiola_kernels.kernel_isa("decode_gemv") or "none"


def _llama_gguf(llama, config, dtype: torch.dtype, a: argparse.Namespace, stack: contextlib.ExitStack) -> str:
    """The GGUF file llama.cpp decodes: ``llama`` (the Hugging Face row's model), or, without
    that row, the same model built again from seed 0, written in ``dtype`` into ``a.gguf_dir``
    or a temporary directory ``stack`` removes."""
    if llama is None:
        torch.manual_seed(0)
        llama = llama_like(config)  # float32: write_gguf rounds it to dtype as .to(dtype) would
    if a.gguf_dir:
        os.makedirs(a.gguf_dir, exist_ok=True)
        folder = a.gguf_dir
    else:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="wiola-bench-"))
    path = os.path.join(folder, f"llama-like-{a.preset}-{str(dtype).removeprefix('torch.')}.gguf")
    write_gguf(llama, path, dtype)
    return path


def _dtype_list(text: str) -> list[str]:
    """``--dtype``'s value: one dtype name, or several, comma-separated, each once."""
    names = [t.strip() for t in text.split(",")]
    bad = [t for t in names if t not in DTYPES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected one or more of {sorted(DTYPES)}, comma-separated and each once, "
                                         f"got {text!r}")
    return names


def main(argv: list[str] | None = None) -> list[dict]:
    """Command line: print and optionally write the decoding benchmark (one record per dtype)."""
    p = argparse.ArgumentParser(prog="python -m wiola bench --decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", action="store_true", help="(selects this benchmark)")
    p.add_argument("--preset", default="wiola-360m")
    p.add_argument("--dtype", type=_dtype_list, default=["float32"], metavar="D[,D...]",
                   help=f"the models' parameter dtype, of {sorted(DTYPES)}; several (comma-separated) alternate in "
                        "the same rounds and are reported against the first")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each model (median reported)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--no-llama", action="store_true", help="skip the Hugging Face Llama comparison")
    p.add_argument("--llama-cpp", default=None, metavar="BIN",
                   help="also time llama.cpp: the path to its llama-bench (the same Llama, as a GGUF file)")
    p.add_argument("--gguf-dir", default=None, metavar="DIR",
                   help="where --llama-cpp writes the GGUF file (default: a temporary directory, removed afterwards)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or this process's CPU time (with --threads 1 on a machine other jobs load)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time one decoding step against its weight reads (GEMVs) alone")
    p.add_argument("--json", default=None, help="also write the records here")
    a = p.parse_args(argv)
    if a.new_tokens < 2 or a.prompt < 1 or a.repeats < 1:
        raise SystemExit("--new-tokens must be ≥ 2, --prompt and --repeats ≥ 1")
    if a.llama_cpp:  # before the models are built: a mistake here should not cost a run
        find_llama_bench(a.llama_cpp)
        if importlib.util.find_spec("gguf") is None:
            raise CommandError("--llama-cpp writes its model with the gguf package, which is not installed: "
                               "pip install gguf (it is in requirements.txt)")
    if a.threads:
        torch.set_num_threads(a.threads)
    from ..configuration_wiola import WiolaConfig
    from ..modeling_wiola import WiolaForCausalLM

    config = WiolaConfig.from_name(a.preset)
    prompt = torch.randint(3, config.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(0))
    runs = {}  # per dtype name: its models, their rates, the first generate's memory
    for name in a.dtype:
        dtype = DTYPES[name]
        torch.manual_seed(0)
        models = {"wiola": WiolaForCausalLM(config).to(dtype).eval()}
        if not a.no_llama:
            torch.manual_seed(0)
            models["llama"] = llama_like(config).to(dtype)
        runs[name] = dict(dtype=dtype, models=models, rates={k: [] for k in models}, llama_cpp=None,
                          params={k: sum(q.numel() for q in m.parameters()) for k, m in models.items()},
                          isa=gemv_isa(models["wiola"]), weight_bytes=weight_bytes(models["wiola"]),
                          kv_bytes=kv_cache_bytes(config, a.prompt + a.new_tokens, dtype))
    first = runs[a.dtype[0]]
    print(f"wiola bench --decode: {a.preset} ({first['params']['wiola'] / 1e6:.1f}M parameters), batch 1, prompt "
          f"{a.prompt}, {a.new_tokens} new tokens, greedy, {', '.join(a.dtype)}, {torch.get_num_threads()} threads, "
          f"{a.clock} clock, GEMV isa {first['isa']}", flush=True)
    for run in runs.values():
        with RssPeak() as rss:  # the first generate: whatever decoding allocates beside the weights shows here
            decode_rate(run["models"]["wiola"], prompt, a.new_tokens, a.clock)
        run["rss"] = rss
    for run in runs.values():
        for model in run["models"].values():  # warm-up (allocator, one-time kernel selection)
            decode_rate(model, prompt[:, :8], 2)
    rounds = []
    with contextlib.ExitStack() as stack:
        if a.llama_cpp:
            for run in runs.values():
                run["gguf"] = _llama_gguf(run["models"].get("llama"), config, run["dtype"], a, stack)
                run["rates"]["llama.cpp"] = []
        for _ in range(a.repeats):
            rounds.append(measure_bandwidth(repeats=2, clock=CLOCKS[a.clock]))
            for run in runs.values():
                for name, model in run["models"].items():
                    run["rates"][name].append(decode_rate(model, prompt, a.new_tokens, a.clock)[0])
                if a.llama_cpp:
                    run["llama_cpp"] = run_llama_bench(a.llama_cpp, run["gguf"], torch.get_num_threads(), a.prompt,
                                                       a.new_tokens)
                    run["rates"]["llama.cpp"].append(run["llama_cpp"]["tokens_per_s"])
    bw = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    bandwidth = statistics.median(max(r["read_bytes_per_s"], r["copy_bytes_per_s"]) for r in rounds)
    per_round = [round(max(r["read_bytes_per_s"], r["copy_bytes_per_s"]) / 1e9, 1) for r in rounds]
    print(f"  bandwidth (median of rounds {per_round} GB/s): read {bw['read_bytes_per_s'] / 1e9:.2f} GB/s, copy "
          f"{bw['copy_bytes_per_s'] / 1e9:.2f} GB/s (read + write)")
    records = [_report(a, name, run, bandwidth, first, prompt) for name, run in runs.items()]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=2)
    return records


def _report(a: argparse.Namespace, name: str, run: dict, bandwidth: float, first: dict, prompt: torch.Tensor) -> dict:
    """Print one dtype's lines and return its record; a dtype after the first is also compared
    with the first, round by round (the same rounds, so a change of load hits both)."""
    mib = 2.0**20
    rates, params, wiola_bytes, kv_bytes, rss = run["rates"], run["params"], run["weight_bytes"], run["kv_bytes"], \
        run["rss"]
    floor = bandwidth / wiola_bytes
    tps = statistics.median(rates["wiola"])
    record = dict(preset=a.preset, dtype=name, threads=torch.get_num_threads(), isa=run["isa"], tokens_per_s=tps,
                  floor_tokens_per_s=floor, pct_of_floor=100 * tps / floor,
                  llama_tokens_per_s=statistics.median(rates["llama"]) if "llama" in rates else None,
                  params=params["wiola"], llama_params=params.get("llama"), weight_bytes=wiola_bytes,
                  weight_mb=wiola_bytes / mib, kv_cache_mb=kv_bytes / mib, rss_growth_mb=rss.growth / mib,
                  rss_before_mb=rss.before / mib, bandwidth_bytes_per_s=bandwidth, clock=a.clock, runs=rates,
                  llama_cpp_tokens_per_s=None, llama_cpp_params=None, per_param_vs_llama_cpp=None, llama_cpp_build=None,
                  vs_dtype=None, tokens_per_s_ratio=None)
    lead = f"  {name}: " if len(a.dtype) > 1 else "  "
    print(f"{lead}floor = {bandwidth / 1e9:.2f} GB/s / {wiola_bytes / 1e9:.3f} GB of weights = {floor:.2f} tok/s")
    print(f"{lead}wiola: {tps:.2f} tok/s ({record['pct_of_floor']:.0f}% of the floor; target >= 80%) "
          f"runs {[round(r, 2) for r in rates['wiola']]}")
    print(f"{lead}memory: RSS grew {rss.growth / mib:.0f} MiB during the first generate (from {rss.before / mib:.0f} "
          f"MiB; weights {wiola_bytes / mib:.0f} MiB, KV cache {kv_bytes / mib:.1f} MiB)")
    if run is not first:
        ratios = [x / y for x, y in zip(rates["wiola"], first["rates"]["wiola"])]
        base = a.dtype[0]
        record.update(vs_dtype=base, tokens_per_s_ratio=statistics.median(ratios))
        print(f"{lead}tok/s / {base}'s, round by round: {[round(r, 2) for r in ratios]}, median "
              f"{record['tokens_per_s_ratio']:.2f} (bytes per weight: {first['dtype'].itemsize} / "
              f"{run['dtype'].itemsize})")
    if "llama" in rates:
        llama = record["llama_tokens_per_s"]
        parity = tps * params["wiola"] / (llama * params["llama"])
        record["per_param_vs_llama"] = parity
        print(f"{lead}llama ({params['llama'] / 1e6:.1f}M): {llama:.2f} tok/s; wiola tok/s x params / llama's = "
              f"{parity:.2f} (target >= 1.0) runs {[round(r, 2) for r in rates['llama']]}")
    llama_cpp = run["llama_cpp"]
    if llama_cpp is not None:
        cpp, cpp_params = statistics.median(rates["llama.cpp"]), llama_cpp["model_n_params"]
        parity = tps * params["wiola"] / (cpp * cpp_params)
        record.update(llama_cpp_tokens_per_s=cpp, llama_cpp_params=cpp_params, per_param_vs_llama_cpp=parity,
                      llama_cpp_build=llama_cpp["build_commit"])
        print(f"{lead}llama.cpp ({cpp_params / 1e6:.1f}M, build {llama_cpp['build_commit']}, KV cache "
              f"{llama_cpp['type_k']}): {cpp:.2f} tok/s; wiola tok/s x params / llama.cpp's = {parity:.2f} "
              f"(target >= 1.0) runs {[round(r, 2) for r in rates['llama.cpp']]}")
    if a.breakdown:
        step, gemv = step_breakdown(run["models"]["wiola"], prompt, clock=a.clock)
        record.update(step_s=step, gemv_s=gemv)
        print(f"{lead}breakdown: one step {step * 1e3:.1f} ms; its weight reads alone (GEMVs, same weights) "
              f"{gemv * 1e3:.1f} ms = {wiola_bytes / gemv / 1e9:.1f} GB/s ({100 * wiola_bytes / gemv / bandwidth:.0f}% "
              f"of the floor's bandwidth); the rest of the step {(step - gemv) * 1e3:.1f} ms"
              + (" (the GEMVs alone took longer: the rest is within the run-to-run spread)" if step < gemv else ""))
    return record


__all__ = ["RssPeak", "decode_rate", "gemv_isa", "kv_cache_bytes", "llama_like", "main", "measure_bandwidth",
           "step_breakdown", "weight_bytes"]

"""Training-step benchmark: fused vs reference kernels, ATM on vs off.

    python -m wiola bench                     # d 256, L 6, H 8, H_kv 2, T 512, B 4, fp32, CPU
    python -m wiola bench --steps 5 --json out.json

One training step = forward + backward + AdamW on a Wiola model of the size above
(vocabulary: the 259 byte-level ids of the demo, so the output head does not dominate).
Each case runs in a fresh process, so its peak resident memory is its own: we report
the process peak RSS and the growth of RSS from just before the first step (model and
inputs built) to the peak, which is what the step itself needs (activations, gradients,
AdamW state). Tokens/s is ``B·T`` over the median step time after one warm-up step.
Targets on CPU (issue 5): fused ≥ 1.25× the reference's tokens/s and ≤ 0.9× its peak.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _case(args: dict, queue) -> None:
    import torch

    import wiola_kernels

    from .configuration_wiola import WiolaConfig
    from .modeling_wiola import WiolaForCausalLM, backend_scope

    if args["threads"]:
        torch.set_num_threads(args["threads"])
    config = WiolaConfig.from_name(
        "wiola-tiny", hidden_size=args["d"], num_hidden_layers=args["layers"], num_attention_heads=args["heads"],
        num_key_value_heads=args["kv_heads"], head_dim=args["d"] // args["heads"], dsff_narrow_size=args["d"],
        dsff_wide_size=4 * args["d"], vocab_size=args["vocab"], max_position_embeddings=max(1024, args["seq"]),
        kernel_backend=args["backend"], atm_enabled=args["atm"])
    torch.manual_seed(0)
    model = WiolaForCausalLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, args["vocab"], (args["batch"], args["seq"]))
    merged = {"tokens": 0, "calls": 0}
    if args["atm"]:  # count what ATM actually merges (at random init, τ = 0.92 merges little)
        original = wiola_kernels.atm_merge

        def counting(x, *a, **k):
            out = original(x, *a, **k)
            merged["tokens"] += int(x.shape[0] * x.shape[1] - out[2].sum())
            merged["calls"] += 1
            return out

        wiola_kernels.atm_merge = counting
    with backend_scope(config.kernel_backend):
        used = {op: wiola_kernels.dispatch.select(op, torch.device("cpu")) for op in wiola_kernels.dispatch.ops()}
    baseline = _rss_mb()
    times = []
    for _ in range(args["steps"] + 1):
        t0 = time.perf_counter()
        with model.kernel_backend():
            loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    step = statistics.median(times[1:])
    merged_frac = merged["tokens"] / max(1, merged["calls"] * args["batch"] * args["seq"])
    queue.put(dict(backend=args["backend"], atm=args["atm"], step_s=step,
                   tokens_per_s=args["batch"] * args["seq"] / step,
                   peak_rss_mb=peak, step_peak_mb=peak - baseline, loss=loss.item(), ops=used,
                   atm_merged_fraction=merged_frac if args["atm"] else None, threads=torch.get_num_threads()))


def run_case(**args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_case, args=(args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m wiola bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=259)
    p.add_argument("--steps", type=int, default=3, help="timed steps per case (after one warm-up step)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--fused", default="auto", help="backend for the fused runs (default auto)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    common = dict(d=a.d, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, seq=a.seq, batch=a.batch,
                  vocab=a.vocab, steps=a.steps, threads=a.threads)
    print(f"wiola bench: training step (fwd+bwd+AdamW), d {a.d}, L {a.layers}, H {a.heads}, H_kv {a.kv_heads}, "
          f"T {a.seq}, B {a.batch}, V {a.vocab}, fp32, CPU; median of {a.steps} steps after 1 warm-up", flush=True)
    results = []
    for backend, atm in ((a.fused, False), ("reference", False), (a.fused, True), ("reference", True)):
        r = run_case(backend=backend, atm=atm, **common)
        results.append(r)
        extra = f", ATM merged {100 * r['atm_merged_fraction']:.1f}% of tokens" if atm else ""
        print(f"  {backend:>9} ATM {'on ' if atm else 'off'}: {r['tokens_per_s']:8.0f} tok/s  "
              f"step {r['step_s']:.3f} s  peak RSS {r['peak_rss_mb']:7.1f} MB (step +{r['step_peak_mb']:.1f} MB)"
              f"{extra}  [threads {r['threads']}; ops: {', '.join(f'{k}={v}' for k, v in r['ops'].items())}]",
              flush=True)
    fused, ref = results[0], results[1]
    speed = fused["tokens_per_s"] / ref["tokens_per_s"]
    mem = fused["step_peak_mb"] / max(ref["step_peak_mb"], 1e-9)
    mem_rss = fused["peak_rss_mb"] / ref["peak_rss_mb"]
    print(f"fused/reference (ATM off): {speed:.2f}x tokens/s "
          f"(target >= 1.25x: {'met' if speed >= 1.25 else 'NOT met'}), "
          f"step memory {mem:.2f}x, process peak {mem_rss:.2f}x (target <= 0.9x: "
          f"{'met' if mem <= 0.9 else 'NOT met'} on step memory)")
    atm_speed = results[2]["tokens_per_s"] / fused["tokens_per_s"]
    print(f"ATM on/off ({a.fused}): {atm_speed:.2f}x tokens/s, step memory "
          f"{results[2]['step_peak_mb'] / max(fused['step_peak_mb'], 1e-9):.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return results

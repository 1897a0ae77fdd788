"""Training-step benchmark: fused vs reference kernels, ATM on vs off.

    python -m wiola bench                     # d 256, L 6, H 8, H_kv 2, T 512, B 4, fp32, CPU
    python -m wiola bench --threads 1 --steps 5 --json out.json

One training step = forward + backward + AdamW on a Wiola model of the size above
(vocabulary: the 259 byte-level ids of the demo, so the output head does not dominate).

* Speed: the four cases (fused/reference × ATM off/on) run in one process, one step of
  each in turn (round robin), so a change in machine load hits all of them alike.
  Tokens/s is ``B·T`` over each case's median step time, after one warm-up round.
* Memory: each case runs again in a fresh process (two steps, so AdamW state exists);
  we report the process peak RSS and the growth of RSS from just before the first step
  (model and inputs built) to the peak — what the step itself needs (activations,
  gradients, AdamW state).

Targets on CPU (issue 5): fused ≥ 1.25× the reference's tokens/s and ≤ 0.9× its peak
memory. On a shared machine prefer ``--threads 1``: OpenMP threads spin when cores are
oversubscribed and step times then swing by several times.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import time

CASES = (("fused", False), ("reference", False), ("fused", True), ("reference", True))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _setup(args: dict, backend: str, atm: bool):
    """(model, optimizer, ids, merge counter) for one case."""
    import torch

    import wiola_kernels

    from .configuration_wiola import WiolaConfig
    from .modeling_wiola import WiolaForCausalLM

    config = WiolaConfig.from_name(
        "wiola-tiny", hidden_size=args["d"], num_hidden_layers=args["layers"], num_attention_heads=args["heads"],
        num_key_value_heads=args["kv_heads"], head_dim=args["d"] // args["heads"], dsff_narrow_size=args["d"],
        dsff_wide_size=4 * args["d"], vocab_size=args["vocab"], max_position_embeddings=max(1024, args["seq"]),
        kernel_backend=backend, atm_enabled=atm)
    torch.manual_seed(0)
    model = WiolaForCausalLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, args["vocab"], (args["batch"], args["seq"]), generator=torch.Generator().manual_seed(0))
    if not getattr(wiola_kernels.atm_merge, "_counting", False):  # count what ATM merges (all cases share it)
        original = wiola_kernels.atm_merge

        def counting(x, *a, **k):
            out = original(x, *a, **k)
            counting.tokens += int(x.shape[0] * x.shape[1] - out[2].sum())
            counting.rows += x.shape[0] * x.shape[1]
            return out

        counting._counting, counting.tokens, counting.rows = True, 0, 0
        wiola_kernels.atm_merge = counting
    return model, opt, ids


def _step(model, opt, ids) -> float:
    t0 = time.perf_counter()
    loss = model(ids, labels=ids, use_cache=False).loss  # backward follows the forward's backend
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _backend(args: dict, name: str) -> str:
    return args["fused"] if name == "fused" else "reference"


def _timing(args: dict, queue) -> None:
    import torch

    import wiola_kernels

    from .modeling_wiola import backend_scope

    if args["threads"]:
        torch.set_num_threads(args["threads"])
    cases = [(_backend(args, b), atm, *_setup(args, _backend(args, b), atm)) for b, atm in CASES]
    times = [[] for _ in cases]
    for _ in range(args["steps"] + 1):
        for i, (_, _, model, opt, ids) in enumerate(cases):
            times[i].append(_step(model, opt, ids))
    results = []
    for (backend, atm, *_), t in zip(cases, times):
        with backend_scope(backend):
            ops = {op: wiola_kernels.dispatch.select(op, torch.device("cpu")) for op in wiola_kernels.dispatch.ops()}
        step = statistics.median(t[1:])
        results.append(dict(backend=backend, atm=atm, step_s=step, steps_s=t[1:],
                            tokens_per_s=args["batch"] * args["seq"] / step, ops=ops))
    counter = wiola_kernels.atm_merge
    queue.put(dict(results=results, threads=torch.get_num_threads(),
                   atm_merged_fraction=counter.tokens / max(1, counter.rows)))


def _memory(args: dict, backend: str, atm: bool, queue) -> None:
    import torch

    if args["threads"]:
        torch.set_num_threads(args["threads"])
    model, opt, ids = _setup(args, backend, atm)
    baseline = _rss_mb()
    for _ in range(2):
        _step(model, opt, ids)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put(dict(peak_rss_mb=peak, step_peak_mb=peak - baseline))


def _subprocess(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    import sys

    if "--decode" in (sys.argv[1:] if argv is None else argv):  # the decoding benchmark (bench_decode.py)
        from .bench_decode import main as decode_main

        return decode_main(argv)
    p = argparse.ArgumentParser(prog="python -m wiola bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=259)
    p.add_argument("--steps", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--fused", default="auto", help="backend for the fused runs (default auto)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    args = dict(d=a.d, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, seq=a.seq, batch=a.batch,
                vocab=a.vocab, steps=a.steps, threads=a.threads, fused=a.fused)
    print(f"wiola bench: training step (fwd+bwd+AdamW), d {a.d}, L {a.layers}, H {a.heads}, H_kv {a.kv_heads}, "
          f"T {a.seq}, B {a.batch}, V {a.vocab}, fp32, CPU; median of {a.steps} interleaved rounds after 1 warm-up",
          flush=True)
    timing = _subprocess(_timing, args)
    results = timing["results"]
    for r in results:
        r.update(_subprocess(_memory, args, r["backend"], r["atm"]))
        r["threads"] = timing["threads"]
    for r in results:
        extra = f", ATM merged {100 * timing['atm_merged_fraction']:.1f}% of tokens" if r["atm"] else ""
        print(f"  {r['backend']:>9} ATM {'on ' if r['atm'] else 'off'}: {r['tokens_per_s']:8.0f} tok/s  "
              f"step {r['step_s']:.3f} s  peak RSS {r['peak_rss_mb']:7.1f} MB (step +{r['step_peak_mb']:.1f} MB)"
              f"{extra}  [ops: {', '.join(f'{k}={v}' for k, v in r['ops'].items())}]", flush=True)
    fused, ref, fused_atm = results[0], results[1], results[2]
    speed = fused["tokens_per_s"] / ref["tokens_per_s"]
    mem = fused["step_peak_mb"] / max(ref["step_peak_mb"], 1e-9)
    print(f"threads {timing['threads']}. fused/reference (ATM off): {speed:.2f}x tokens/s "
          f"(target >= 1.25x: {'met' if speed >= 1.25 else 'NOT met'}), step memory {mem:.2f}x "
          f"(target <= 0.9x: {'met' if mem <= 0.9 else 'NOT met'}), process peak "
          f"{fused['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x")
    print(f"ATM on/off ({a.fused}): {fused_atm['tokens_per_s'] / fused['tokens_per_s']:.2f}x tokens/s, "
          f"step memory {fused_atm['step_peak_mb'] / max(fused['step_peak_mb'], 1e-9):.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return results

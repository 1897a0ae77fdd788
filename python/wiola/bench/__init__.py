"""Training-step benchmark: fused vs reference kernels, ATM on vs off.

    python -m wiola bench                     # d 256, L 6, H 8, H_kv 2, T 128, B 4, fp32, CPU; minutes
    python -m wiola bench --full              # T 512, interleaved, each case's memory in a fresh process
    python -m wiola bench --threads 1 --steps 5 --json out.json

One training step = forward + backward + AdamW on a Wiola model of the size above
(vocabulary: the 259 byte-level ids of the demo, so the output head does not dominate).
Each of the four cases (fused/reference × ATM off/on) is one row of a table printed as
the rows complete.

* Default: the cases run one after the other in this process. Each builds its model,
  runs two steps under a peak-memory probe (the growth of the process's peak resident set
  over the two steps, after returning freed heap pages: what the step itself needs —
  activations, gradients, AdamW state; these steps are also the warm-up), then times
  ``--steps`` steps; its row is printed. Tokens/s is ``B·T`` over the median step.
* ``--full`` (and T 512 unless ``--seq`` says otherwise): the four cases run in one
  (spawned) process, one step of each in turn (round robin, after one warm-up round), so a
  change in machine load hits all of them alike; then each case runs again in a fresh
  process (two steps, so AdamW state exists)
  for its memory: the process peak RSS and its growth from just before the first step
  (model and inputs built) to the peak. A row is printed as each memory run ends.

Targets on CPU: fused ≥ 1.25× the reference's tokens/s and ≤ 0.9× its peak
memory. On a shared machine prefer ``--full --threads 1``: OpenMP threads spin when cores
are oversubscribed and step times then swing by several times.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_module
import resource
import statistics
import sys
import time
import traceback

from wiola_kernels.cli import CommandError, HelpFormatter, non_negative_int, positive_int

CASES = (("fused", False), ("reference", False), ("fused", True), ("reference", True))
#: Tokens per row: the default run's (sized for minutes on 2 cores) and --full's.
DEFAULT_SEQ, FULL_SEQ = 128, 512


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _config(args: dict, backend: str, atm: bool):
    """The WiolaConfig of one case (built in the parent first, to check the sizes)."""
    from ..configuration_wiola import WiolaConfig

    return WiolaConfig.from_name(
        "wiola-tiny", hidden_size=args["d"], num_hidden_layers=args["layers"], num_attention_heads=args["heads"],
        num_key_value_heads=args["kv_heads"], head_dim=args["d"] // args["heads"], dsff_narrow_size=args["d"],
        dsff_wide_size=4 * args["d"], vocab_size=args["vocab"], max_position_embeddings=max(1024, args["seq"]),
        kernel_backend=backend, atm_enabled=atm)


def _setup(args: dict, backend: str, atm: bool):
    """(model, optimizer, ids, merge counter) for one case."""
    import torch

    import wiola_kernels

    from ..modeling_wiola import WiolaForCausalLM

    config = _config(args, backend, atm)
    torch.manual_seed(0)
    model = WiolaForCausalLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, args["vocab"], (args["batch"], args["seq"]), generator=torch.Generator().manual_seed(0))
    merge = wiola_kernels.ATMMergeFunction  # what the model calls
    if not getattr(merge.apply, "_counting", False):  # count what ATM merges (all cases share it)
        original = merge.apply

        def counting(x, *a, **k):
            out = original(x, *a, **k)
            counting.tokens += int(x.shape[0] * x.shape[1] - out[2].sum())
            counting.rows += x.shape[0] * x.shape[1]
            counting.lengths.append(out[2].tolist())  # merged lengths T'_b of this call, for the FLOP count
            return out

        counting._counting, counting.tokens, counting.rows, counting.lengths = True, 0, 0, []
        merge.apply = counting
    return model, opt, ids


def attention_flops(config, layer: int, lengths: list[int]) -> int:
    """Forward FLOPs (2 × multiply-adds) of layer ``layer``'s attention block (GCLA, SPEC §5)
    on rows of the given lengths: Q/K/V/O and the context projections per token, the causal
    self-attention core (QKᵀ and PV over ``t + 1`` keys at query ``t``) and the cross part
    over ``Λ'`` slots.

    With ATM, ``lengths`` are the merged lengths ``T'_b``: each merged token is computed
    once (the packed projections, and the attention op skips past ``T'_b``). Norms, SRPE
    and softmax are left out (linear in T and small). The backward's FLOPs are about twice
    these, in the same proportions."""
    d, h, h_kv, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    n_ctx = min(layer, config.gcla_lookback)
    per_token = d * h * dh + 2 * d * h_kv * dh + h * dh * d  # W_Q, W_K, W_V, W_O
    per_token += 2 * h * n_ctx * dh                          # cross scores and mixture
    ctx = 2 * n_ctx * d * h * dh                             # W_Kc, W_Vc of the slots
    total = 0
    for t in lengths:
        total += t * per_token + 2 * h * dh * t * (t + 1) // 2
        total += t * ctx if config.gcla_summary == "causal" else ctx  # paper: one context per row
    return 2 * total


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

    from ..modeling_wiola import backend_scope

    if args["threads"]:
        torch.set_num_threads(args["threads"])
    cases = [(_backend(args, b), atm, *_setup(args, _backend(args, b), atm)) for b, atm in CASES]
    times = [[] for _ in cases]
    start = time.perf_counter()
    for r in range(args["steps"] + 1):
        for i, (_, _, model, opt, ids) in enumerate(cases):
            times[i].append(_step(model, opt, ids))
        _progress(f"timing: round {r + 1}/{args['steps'] + 1}{' (warm-up)' if r == 0 else ''} done, "
                  f"{time.perf_counter() - start:.1f} s")
    results = []
    for (backend, atm, *_), t in zip(cases, times):
        with backend_scope(backend):
            ops = {op: wiola_kernels.dispatch.select(op, torch.device("cpu")) for op in wiola_kernels.dispatch.ops()}
        step = statistics.median(t[1:])
        results.append(dict(backend=backend, atm=atm, step_s=step, steps_s=t[1:],
                            tokens_per_s=args["batch"] * args["seq"] / step, ops=ops))
    counter = wiola_kernels.ATMMergeFunction.apply
    queue.put(dict(results=results, threads=torch.get_num_threads(),
                   atm_merged_fraction=counter.tokens / max(1, counter.rows),
                   atm_flops=_atm_flops(args, counter.lengths)))


def _atm_flops(args: dict, calls: list[list[int]]) -> dict:
    """Attention FLOPs per forward with ATM off and on (mean over the recorded merge calls,
    which come in layer order: one per merged layer per forward), over all layers and over
    the merged layers alone."""
    config = _config(args, "reference", True)
    full = [args["seq"]] * args["batch"]
    merged = [i for i in range(config.num_hidden_layers) if config.is_merge_layer(i)]
    off = {i: attention_flops(config, i, full) for i in range(config.num_hidden_layers)}
    forwards = [calls[k:k + len(merged)] for k in range(0, len(calls) - len(merged) + 1, len(merged))]
    on = dict(off)
    if merged and forwards:
        for i, layer in enumerate(merged):
            on[layer] = statistics.mean(attention_flops(config, layer, f[i]) for f in forwards)
    return dict(off=sum(off.values()), on=sum(on.values()), merged_layers_off=sum(off[i] for i in merged),
                merged_layers_on=sum(on[i] for i in merged))


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


def _in_process(args: dict, backend: str, atm: bool) -> dict:
    """The default path's case: build, two steps under the peak-memory probe (the warm-up
    too), ``steps`` timed steps, in this process."""
    import torch

    import wiola_kernels
    from wiola_kernels.bench.hf import peak_mb

    from ..modeling_wiola import backend_scope

    model, opt, ids = _setup(args, backend, atm)
    step_peak = peak_mb(lambda: [_step(model, opt, ids) for _ in range(2)], torch.device("cpu"))
    times = [_step(model, opt, ids) for _ in range(args["steps"])]
    with backend_scope(backend):
        ops = {op: wiola_kernels.dispatch.select(op, torch.device("cpu")) for op in wiola_kernels.dispatch.ops()}
    step = statistics.median(times)
    return dict(backend=backend, atm=atm, step_s=step, steps_s=times, tokens_per_s=args["batch"] * args["seq"] / step,
                ops=ops, peak_rss_mb=None, step_peak_mb=step_peak, threads=torch.get_num_threads())


ROW_HEADER = (f"  {'backend':>9}  {'ATM':<3}  {'tok/s':>8}  {'step s':>7}  {'step +MiB':>9}  {'peak RSS MiB':>12}  "
              f"{'ATM merged':>10}  ops")


def _row(r: dict, merged_fraction: float | None) -> str:
    """One case's row under :data:`ROW_HEADER`."""
    peak = "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.1f}"
    merged = f"{100 * merged_fraction:.1f}%" if r["atm"] and merged_fraction is not None else "-"
    ops = ", ".join(f"{k}={v}" for k, v in r["ops"].items())
    return (f"  {r['backend']:>9}  {'on' if r['atm'] else 'off':<3}  {r['tokens_per_s']:8.0f}  {r['step_s']:7.3f}  "
            f"{r['step_peak_mb']:9.1f}  {peak:>12}  {merged:>10}  {ops}")


def _progress(line: str) -> None:
    print(f"  [bench] {line}", file=sys.stderr, flush=True)


def _child(target, args: tuple, queue) -> None:
    """Runs ``target(*args, queue)`` in a child; a failure goes back as a message."""
    try:
        target(*args, queue)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        queue.put(dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()))
        raise SystemExit(1) from None


def _subprocess(target, *args) -> dict:
    """``target(*args, queue)`` in a fresh (spawned) process; its result, or a
    ``RuntimeError`` with the child's message when it fails or dies (out of memory, a
    signal), instead of waiting forever for a result that never comes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(target, args, queue))
    proc.start()
    result = None
    while result is None:
        try:
            result = queue.get(timeout=0.5)
        except queue_module.Empty:
            if not proc.is_alive():
                try:  # the child may have put its result just before exiting
                    result = queue.get(timeout=2)
                except queue_module.Empty:
                    break
    proc.join()
    if result is None or "error" in result:
        if result is None:
            code = proc.exitcode
            why = f"killed by signal {-code} (out of memory?)" if code is not None and code < 0 else \
                f"exited with status {code} without a result"
        else:
            why = result["error"]
            if os.environ.get("WIOLA_TRACEBACK", "0") not in ("", "0"):
                print(result["traceback"], file=sys.stderr)
        raise RuntimeError(f"the benchmark's {target.__name__.strip('_')} process failed: {why}")
    return result


def _validate(a: argparse.Namespace) -> None:
    """Everything the children would trip over, checked in the parent before any run."""
    import torch

    if a.d % a.heads:
        raise CommandError(f"--d {a.d} must be a multiple of --heads {a.heads} (head_dim = d / heads)")
    if a.heads % a.kv_heads:
        raise CommandError(f"--kv-heads {a.kv_heads} must divide --heads {a.heads}")
    if (a.d // a.heads) % 2:
        raise CommandError(f"head_dim = --d / --heads = {a.d // a.heads} must be even (SRPE rotates pairs)")
    if a.vocab < 4:
        raise CommandError(f"--vocab must be at least 4 (3 special ids and one token), got {a.vocab}")
    for backend in (a.fused, "reference"):
        for atm in (False, True):
            _config(vars(a), backend, atm)  # WiolaConfig checks every field
    if a.fused not in ("auto", "reference"):
        from wiola_kernels import dispatch

        reason = dispatch.BACKENDS[a.fused].unavailable_reason(torch.device("cpu"))
        if reason is not None:
            raise CommandError(f"--fused {a.fused} cannot run on the CPU: {reason}")


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m wiola bench``: returns one record per case (see the module docstring)."""
    import sys

    from .gpu import split_device

    device, argv = split_device(sys.argv[1:] if argv is None else list(argv))
    if device != "cpu":  # --device cuda: the GPU training-step benchmark (bench/gpu.py)
        from .gpu import main as gpu_main

        return gpu_main([*argv, "--device", device])
    if "--decode" in argv:  # the decoding benchmark (bench/decode.py)
        from .decode import main as decode_main

        return decode_main(argv)
    from ..configuration_wiola import KERNEL_BACKENDS


    p = argparse.ArgumentParser(prog="python -m wiola bench", formatter_class=HelpFormatter,
                                description="Training-step benchmark (forward + backward + AdamW) on the CPU: fused "
                                            "vs reference kernels, ATM on vs off; tokens/s and peak memory.")
    p.add_argument("--d", type=positive_int, default=256, help="model width (hidden_size)")
    p.add_argument("--layers", type=positive_int, default=6, help="decoder layers")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads (must divide --d)")
    p.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (must divide --heads)")
    p.add_argument("--seq", type=positive_int, help=f"tokens per row (default: {DEFAULT_SEQ}; with --full {FULL_SEQ})")
    p.add_argument("--batch", type=positive_int, default=4, help="rows per step")
    p.add_argument("--vocab", type=positive_int, default=259, help="vocabulary size")
    p.add_argument("--steps", type=positive_int, default=3,
                   help="timed steps per case (with --full: rounds of the four, after one warm-up round)")
    p.add_argument("--threads", type=non_negative_int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--fused", default="auto", choices=KERNEL_BACKENDS, help="backend of the fused runs")
    p.add_argument("--full", action="store_true",
                   help="the four cases interleaved in a spawned process and each one's memory in a fresh "
                        "process (steadier under load; a few minutes more)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results here")
    p.add_argument("--decode", action="store_true",
                   help="instead: batch-1 decoding tokens/s vs the weight-streaming floor and a same-shape Llama "
                        "(python -m wiola bench --decode --help)")
    a = p.parse_args(argv)
    if a.seq is None:
        a.seq = FULL_SEQ if a.full else DEFAULT_SEQ
    _validate(a)
    args = dict(d=a.d, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, seq=a.seq, batch=a.batch,
                vocab=a.vocab, steps=a.steps, threads=a.threads, fused=a.fused)
    how = ("median of {s} interleaved rounds after 1 warm-up; memory in fresh processes" if a.full else
           "cases one after the other in this process, median of {s} steps after 2 (the memory probe); "
           "--full: interleaved, memory in fresh processes").format(s=a.steps)
    print(f"wiola bench: training step (fwd+bwd+AdamW), d {a.d}, L {a.layers}, H {a.heads}, H_kv {a.kv_heads}, "
          f"T {a.seq}, B {a.batch}, V {a.vocab}, fp32, CPU; {how}", flush=True)
    if a.full:
        _progress(f"timing: building 4 models, then {a.steps + 1} rounds of 4 steps in one process")
        timing = _subprocess(_timing, args)
        results = timing["results"]
        print(ROW_HEADER, flush=True)
        for i, r in enumerate(results):
            _progress(f"memory: {r['backend']} ATM {'on' if r['atm'] else 'off'} in a fresh process ({i + 1}/4)")
            r.update(_subprocess(_memory, args, r["backend"], r["atm"]))
            r["threads"] = timing["threads"]
            print(_row(r, timing["atm_merged_fraction"]), flush=True)
        threads, merged_fraction, flops = timing["threads"], timing["atm_merged_fraction"], timing["atm_flops"]
    else:
        import torch

        import wiola_kernels

        if a.threads:
            torch.set_num_threads(a.threads)
        print(ROW_HEADER, flush=True)
        results = []
        for backend, atm in ((_backend(args, b), atm) for b, atm in CASES):
            results.append(_in_process(args, backend, atm))
            counter = wiola_kernels.ATMMergeFunction.apply
            merged_fraction = counter.tokens / max(1, counter.rows)
            print(_row(results[-1], merged_fraction), flush=True)
        threads, flops = torch.get_num_threads(), _atm_flops(args, counter.lengths)
    fused, ref, fused_atm = results[0], results[1], results[2]
    speed = fused["tokens_per_s"] / ref["tokens_per_s"]
    mem = fused["step_peak_mb"] / max(ref["step_peak_mb"], 1e-9)
    process_peak = "" if fused["peak_rss_mb"] is None else \
        f", process peak {fused['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x"
    print(f"threads {threads}. fused/reference (ATM off): {speed:.2f}x tokens/s "
          f"(target >= 1.25x: {'met' if speed >= 1.25 else 'NOT met'}), step memory {mem:.2f}x "
          f"(target <= 0.9x: {'met' if mem <= 0.9 else 'NOT met'}){process_peak}")
    print(f"ATM on/off ({a.fused}): {fused_atm['tokens_per_s'] / fused['tokens_per_s']:.2f}x tokens/s, "
          f"step memory {fused_atm['step_peak_mb'] / max(fused['step_peak_mb'], 1e-9):.2f}x")
    saved = 1 - flops["on"] / flops["off"]
    in_merged = 1 - flops["merged_layers_on"] / flops["merged_layers_off"] if flops["merged_layers_off"] else 0.0
    print(f"ATM attention FLOPs (projections + core, forward; backward alike): {flops['on'] / 1e9:.2f} of "
          f"{flops['off'] / 1e9:.2f} GFLOP, {100 * saved:.1f}% saved over all layers "
          f"({100 * in_merged:.1f}% in the merged layers)")
    for r in results:
        r["atm_merged_fraction"] = merged_fraction
        r["attention_gflops"] = (flops["on"] if r["atm"] else flops["off"]) / 1e9
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return results

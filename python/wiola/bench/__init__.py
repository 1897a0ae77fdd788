"""Training-step benchmark: fused vs reference kernels, ATM on vs off.

    python -m wiola bench                     # 3 cases; d 256, L 6, H 8, H_kv 2, T 128, B 4, fp32, CPU; < 3 minutes
    python -m wiola bench --full              # all 4 cases, T 512, interleaved, each case's memory in a fresh process
    python -m wiola bench --threads 1 --steps 5 --budget 90 --json out.json

One training step = forward + backward + AdamW on a Wiola model of the size above
(vocabulary: the 259 byte-level ids of the demo, so the output head does not dominate).
Each case (fused or reference backend, ATM off or on) is one row of a table printed as
the rows complete.

* Default: one configuration per question the command answers — fused vs reference with
  ATM off, and ATM on vs off with the fused backend: the cases fused/off, reference/off,
  fused/on, one after the other in this process. Each builds its model and times its steps
  with wiola_kernels' ``time_pass`` (2 warm-up steps, then ``--steps`` timed steps; the
  median), all of them under a peak-memory probe: the growth of the process's peak resident
  set over those steps, after returning freed heap pages — what a step needs (activations,
  gradients, and the AdamW state, which exists from the first step on). Its row is
  printed. Tokens/s is ``B·T`` over the median step.
* ``--full`` (and T 512 unless ``--seq`` says otherwise): the four cases (reference/on
  too) in one (spawned) process: each warmed up alone (2 steps), then one step of each in
  turn, the order flipped every round (wiola_kernels' ``time_alternating``), so a change in
  machine load hits all of them alike; then each case runs again in a fresh process (two
  steps, so AdamW state exists) for its memory: the process peak RSS and its growth from
  just before the first step (model and inputs built) to the peak. A row is printed as each
  memory run ends.

Budgets (``--budget``: seconds per case, its warm-up included; default 45, with ``--full``
240): the default's three cases end within about 2.5 minutes and the first row comes
within one, whatever the machine's load. A case whose warm-up shows that its timed steps
would end past the budget, or whose steps are still running at the budget, is stopped (a
timer interrupts the step: wiola_kernels.bench.runner's budgets) and its row reads
``> N s, skipped (reason)``; the other cases run on. With ``--full`` the interleaved rounds
get the budget times the number of cases left in them, each memory run the budget, and a
process still running a minute past its share is stopped.

Threads (``--threads 0``, the default): torch's default, or fewer where the load average
shows other work holding CPUs (:func:`auto_threads`; the header says which and why). More
threads than free CPUs make OpenMP's threads wait on each other at every parallel region:
measured on a 2-CPU AMD EPYC VM at load 4 (T 128), 2 threads took 1–11 s a step where 1
thread took 0.5–0.9 s. ``--threads N`` fixes the count; compare runs at the same count.

Targets on CPU: fused ≥ 1.25× the reference's tokens/s and ≤ 0.9× its peak
memory. On a shared machine ``--full`` is steadier: the interleaved rounds see the same load.
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

from wiola_kernels.cli import CommandError, HelpFormatter, non_negative_int, positive_float, positive_int

CASES = (("fused", False), ("reference", False), ("fused", True), ("reference", True))
#: The default run's cases: fused vs reference (ATM off) and ATM on vs off (fused), one each.
DEFAULT_CASES = CASES[:3]
#: Tokens per row: the default run's (sized for minutes on 2 cores) and --full's.
DEFAULT_SEQ, FULL_SEQ = 128, 512
#: Seconds per case (``--budget``): the default run's (3 cases in under 3 minutes) and --full's.
DEFAULT_BUDGET_S, FULL_BUDGET_S = 45.0, 240.0
#: How long past its budget a benchmark process may run before it is stopped (spawning and
#: importing take ~10 s; the budget's own timer normally ends it first).
PROCESS_GRACE_S = 60.0

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



def _label(backend: str, atm: bool) -> str:
    return f"{backend} ATM {'on' if atm else 'off'}"


def _ops(backend: str) -> dict:
    """The backend each op dispatches to under ``backend`` on the CPU."""
    import torch

    from wiola_kernels import dispatch

    from ..modeling_wiola import backend_scope

    with backend_scope(backend):
        return {op: dispatch.select(op, torch.device("cpu")) for op in dispatch.ops()}


def _record(backend: str, atm: bool, args: dict, steps: list[float] | None, skipped: str | None) -> dict:
    """One case's record; ``steps`` are its timed step times (None: ``skipped`` says why)."""
    step = statistics.median(steps) if steps else None
    return dict(backend=backend, atm=atm, step_s=step, steps_s=steps or [],
                tokens_per_s=None if step is None else args["batch"] * args["seq"] / step, ops=_ops(backend),
                peak_rss_mb=None, step_peak_mb=None, skipped=skipped)


def _merge_counts() -> tuple[float, list[list[int]]]:
    """What ATM merged in this process so far (the counter :func:`_setup` installs): the
    fraction of tokens merged away, and the merged lengths of every merge call."""
    import wiola_kernels

    counter = wiola_kernels.ATMMergeFunction.apply
    if not getattr(counter, "_counting", False):  # no model built yet
        return 0.0, []
    return counter.tokens / max(1, counter.rows), counter.lengths


def _timing(args: dict, cases: list[tuple[str, bool]], budget_s: float, queue) -> None:
    """--full's timing (in a spawned process): ``cases`` in alternation within the budget."""
    import torch

    from wiola_kernels.bench.runner import time_alternating

    if args["threads"]:
        torch.set_num_threads(args["threads"])
    built = [(backend, atm, *_setup(args, backend, atm)) for backend, atm in cases]
    times: list[list[float]] = [[] for _ in built]
    start = time.perf_counter()

    def runner(i: int, model, opt, ids):
        def run():
            times[i].append(_step(model, opt, ids))
            _progress(f"timing: {_label(*cases[i])} step {len(times[i])} ({times[i][-1]:.1f} s), "
                      f"{time.perf_counter() - start:.0f} s in")
        return run

    runs = {_label(backend, atm): runner(i, model, opt, ids) for i, (backend, atm, model, opt, ids) in enumerate(built)}
    _, skipped = time_alternating(runs, torch.device("cpu"), args["steps"], budget_s)
    results = []
    for (backend, atm), label, t in zip(cases, runs, times):
        why = skipped.get(label)
        results.append(_record(backend, atm, args, None if why else t[2:], why))  # 2 warm-up steps first
    merged_fraction, lengths = _merge_counts()
    queue.put(dict(results=results, threads=torch.get_num_threads(), atm_merged_fraction=merged_fraction,
                   atm_lengths=lengths))


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



def _memory(args: dict, backend: str, atm: bool, budget_s: float, queue) -> None:
    """--full's memory run of one case (in a fresh process): two steps within the budget."""
    import torch
    from wiola_kernels.bench.runner import BudgetExceeded, warm_up

    if args["threads"]:
        torch.set_num_threads(args["threads"])
    model, opt, ids = _setup(args, backend, atm)
    baseline = _rss_mb()
    try:
        warm_up(lambda: _step(model, opt, ids), torch.device("cpu"), 2, 0, budget_s)
    except BudgetExceeded as exc:
        queue.put(dict(peak_rss_mb=None, step_peak_mb=None, memory_skipped=str(exc)))
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put(dict(peak_rss_mb=peak, step_peak_mb=peak - baseline))


def _in_process(args: dict, backend: str, atm: bool, budget_s: float) -> dict:
    """The default path's case, in this process: build, then 2 warm-up and ``steps`` timed
    steps within ``budget_s`` (wiola_kernels' ``time_pass``) under the peak-memory probe."""
    import torch

    from wiola_kernels.bench.memory import peak_mb
    from wiola_kernels.bench.runner import BudgetExceeded, time_pass

    cpu = torch.device("cpu")
    model, opt, ids = _setup(args, backend, atm)
    times: list[float] = []

    def run():
        times.append(_step(model, opt, ids))

    try:
        step_peak = peak_mb(lambda: time_pass(run, cpu, args["steps"], budget_s, warmup_s=0), cpu)
    except BudgetExceeded as exc:
        record = _record(backend, atm, args, None, str(exc))
    else:
        record = _record(backend, atm, args, times[2:], None)  # time_pass warms up with 2 steps
        record["step_peak_mb"] = step_peak
    record["threads"] = torch.get_num_threads()
    return record


ROW_HEADER = (f"  {'backend':>9}  {'ATM':<3}  {'tok/s':>8}  {'step s':>7}  {'step +MiB':>9}  {'peak RSS MiB':>12}  "
              f"{'ATM merged':>10}  ops")


def _row(r: dict, merged_fraction: float | None) -> str:
    """One case's row under :data:`ROW_HEADER`. A skipped timing fills the tok/s and step s
    cells with ``> N s, skipped (reason)`` (wider than they are: the rest shifts right); a
    skipped memory run (--full) is said at the end."""
    def mib(v):
        return "-" if v is None else f"{v:.1f}"

    merged = f"{100 * merged_fraction:.1f}%" if r["atm"] and merged_fraction is not None and r["step_s"] else "-"
    ops = ", ".join(f"{k}={v}" for k, v in r["ops"].items())
    timing = r["skipped"] if r["step_s"] is None else f"{r['tokens_per_s']:8.0f}  {r['step_s']:7.3f}"
    memory = f"  (memory run: {r['memory_skipped']})" if r.get("memory_skipped") else ""
    return (f"  {r['backend']:>9}  {'on' if r['atm'] else 'off':<3}  {timing:>17}  {mib(r['step_peak_mb']):>9}  "
            f"{mib(r['peak_rss_mb']):>12}  {merged:>10}  {ops}{memory}")


def _progress(line: str) -> None:
    print(f"  [bench] {line}", file=sys.stderr, flush=True)


def _child(target, args: tuple, queue) -> None:
    """Runs ``target(*args, queue)`` in a child; a failure goes back as a message."""
    try:
        target(*args, queue)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        queue.put(dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()))
        raise SystemExit(1) from None


def _subprocess(target, *args, limit_s: float | None = None) -> dict:
    """``target(*args, queue)`` in a fresh (spawned) process; its result, or a
    ``RuntimeError`` with the child's message when it fails or dies (out of memory, a
    signal), instead of waiting forever for a result that never comes. A child still
    running after ``limit_s`` seconds is killed: ``BudgetExceeded``."""
    from wiola_kernels.bench.runner import BudgetExceeded

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(target, args, queue))
    start = time.monotonic()
    proc.start()
    result = None
    while result is None:
        try:
            result = queue.get(timeout=0.5)
        except queue_module.Empty:
            if limit_s is not None and time.monotonic() - start > limit_s:
                proc.kill()
                proc.join()
                raise BudgetExceeded(limit_s, "its process was still running then and was stopped") from None
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


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    return None if a is None or b is None or a[key] is None or b[key] is None else a[key] / max(b[key], 1e-9)


def _versus(ratio: float | None, form: str, target: str | None, met: bool, a: dict | None, b: dict | None) -> str:
    """``form`` with its ``{}`` the ratio (``1.90x tokens/s (target >= 1.25x: met)``), or
    ``n/a`` and which case was skipped."""
    if ratio is None:
        missing = [_label(r["backend"], r["atm"]) for r in (a, b) if r is not None and r["step_s"] is None]
        return form.format("n/a") + f" ({', '.join(missing) or 'a case'} skipped)"
    verdict = "" if target is None else f" (target {target}: {'met' if met else 'NOT met'})"
    return form.format(f"{ratio:.2f}x") + verdict


def _summary(results: list[dict], threads: int, fused_backend: str, flops: dict | None) -> list[str]:
    """The closing lines: fused vs reference (ATM off), ATM on vs off (fused), the FLOP count."""
    by_case = {(r["backend"], r["atm"]): r for r in results}
    fused, ref, fused_atm = (by_case.get((fused_backend, False)), by_case.get(("reference", False)),
                             by_case.get((fused_backend, True)))
    speed, mem = _ratio(fused, ref, "tokens_per_s"), _ratio(fused, ref, "step_peak_mb")
    speed_text = _versus(speed, "{} tokens/s", ">= 1.25x", speed is not None and speed >= 1.25, fused, ref)
    mem_text = _versus(mem, "step memory {}", "<= 0.9x", mem is not None and mem <= 0.9, fused, ref)
    process = _ratio(fused, ref, "peak_rss_mb")
    process_text = "" if process is None else f", process peak {process:.2f}x"
    lines = [f"threads {threads}. fused/reference (ATM off): {speed_text}, {mem_text}{process_text}"]
    atm_speed = _versus(_ratio(fused_atm, fused, "tokens_per_s"), "{} tokens/s", None, False, fused_atm, fused)
    atm_mem = _versus(_ratio(fused_atm, fused, "step_peak_mb"), "step memory {}", None, False, fused_atm, fused)
    lines.append(f"ATM on/off ({fused_backend}): {atm_speed}, {atm_mem}")
    if flops is None:
        lines.append("ATM attention FLOPs: n/a (no ATM step ran)")
    else:
        saved = 1 - flops["on"] / flops["off"]
        in_merged = 1 - flops["merged_layers_on"] / flops["merged_layers_off"] if flops["merged_layers_off"] else 0.0
        lines.append(f"ATM attention FLOPs (projections + core, forward; backward alike): {flops['on'] / 1e9:.2f} of "
                     f"{flops['off'] / 1e9:.2f} GFLOP, {100 * saved:.1f}% saved over all layers "
                     f"({100 * in_merged:.1f}% in the merged layers)")
    skipped = [r for r in results if r["skipped"]]
    if skipped:
        hint = "; on a loaded machine --threads 1 is faster and steadier" if threads and threads > 1 else ""
        lines.append(f"{len(skipped)} case(s) not timed (their rows say why): --budget SECONDS gives each case more"
                     + hint)
    return lines


def auto_threads(default: int) -> tuple[int, str]:
    """``--threads 0``: ``(threads, why)`` — ``default`` (torch's), or fewer when the 1-minute
    load average shows other work already holding CPUs of this process's: one thread per CPU
    left free (at least one). More threads than free CPUs make OpenMP's threads wait on each
    other at every parallel region (see the module docstring)."""
    try:
        cpus = len(os.sched_getaffinity(0))
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not Linux
        return default, "torch's default"
    free = max(1, int(cpus - load + 0.5))
    where = f"load average {load:.1f} on {cpus} CPUs"
    return (default, f"torch's default; {where}") if free >= default else (free, f"auto: {where}")


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m wiola bench``: returns one record per case (see the module docstring)."""
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
                                            "vs reference kernels, ATM on vs off; tokens/s and peak memory. Without "
                                            "options 3 cases at T 128 in under 3 minutes, each row printed as it "
                                            "completes; --full for all 4 at T 512.")
    p.add_argument("--d", type=positive_int, default=256, help="model width (hidden_size)")
    p.add_argument("--layers", type=positive_int, default=6, help="decoder layers")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads (must divide --d)")
    p.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (must divide --heads)")
    p.add_argument("--seq", type=positive_int, help=f"tokens per row (default: {DEFAULT_SEQ}; with --full {FULL_SEQ})")
    p.add_argument("--batch", type=positive_int, default=4, help="rows per step")
    p.add_argument("--vocab", type=positive_int, default=259, help="vocabulary size")
    p.add_argument("--steps", type=positive_int, default=3,
                   help="timed steps per case, after 2 warm-up steps (with --full: rounds of the four)")
    p.add_argument("--threads", type=non_negative_int, default=0,
                   help="torch intra-op threads (0: torch's default, or fewer: one per CPU the load average leaves "
                        "free)")
    p.add_argument("--fused", default="auto", choices=KERNEL_BACKENDS, help="backend of the fused runs")
    p.add_argument("--budget", type=positive_float, metavar="SECONDS",
                   help=f"seconds allowed per case, its warm-up included; a case that would take longer is "
                        f"stopped and reported as '> N s, skipped (reason)' (default: {DEFAULT_BUDGET_S:g}; "
                        f"with --full {FULL_BUDGET_S:g})")
    p.add_argument("--full", action="store_true",
                   help="all four cases (the reference with ATM on too) at T 512, interleaved in a spawned process, "
                        "and each one's memory in a fresh process (steadier under load; several minutes more)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results here")
    p.add_argument("--decode", action="store_true",
                   help="instead: batch-1 decoding tokens/s vs the weight-streaming floor and a same-shape Llama "
                        "(python -m wiola bench --decode --help)")
    a = p.parse_args(argv)
    if a.seq is None:
        a.seq = FULL_SEQ if a.full else DEFAULT_SEQ
    if a.budget is None:
        a.budget = FULL_BUDGET_S if a.full else DEFAULT_BUDGET_S
    _validate(a)
    import torch

    threads, why = (a.threads, "--threads") if a.threads else auto_threads(torch.get_num_threads())
    torch.set_num_threads(threads)
    args = dict(d=a.d, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, seq=a.seq, batch=a.batch,
                vocab=a.vocab, steps=a.steps, threads=threads, fused=a.fused)
    cases = [(_backend(args, b), atm) for b, atm in (CASES if a.full else DEFAULT_CASES)]
    how = ("{n} cases interleaved, median of {s} rounds after 2 warm-up steps each; memory in fresh processes" if a.full
           else "{n} cases one after the other in this process, median of {s} steps after 2 warm-up steps "
                "(all under the memory probe)").format(n=len(cases), s=a.steps)
    print(f"wiola bench: training step (fwd+bwd+AdamW), d {a.d}, L {a.layers}, H {a.heads}, H_kv {a.kv_heads}, "
          f"T {a.seq}, B {a.batch}, V {a.vocab}, fp32, CPU, threads {threads} ({why})", flush=True)
    print(f"{how}; budget {a.budget:g} s per case", flush=True)
    if not a.full:
        print("--full: also reference with ATM on, T 512, the cases interleaved, memory in fresh processes (longer)",
              flush=True)
    from wiola_kernels.bench.runner import BudgetExceeded

    if a.full:
        _progress(f"timing: building {len(cases)} models, then 2 warm-up steps each and {a.steps} rounds of "
                  f"{len(cases)} steps in one process")
        try:
            timing = _subprocess(_timing, args, cases, a.budget,
                                 limit_s=2 * len(cases) * a.budget + PROCESS_GRACE_S)
        except BudgetExceeded as exc:  # the child overran its own timers (a single call that never returned)
            timing = dict(results=[_record(b, atm, args, None, str(exc)) for b, atm in cases],
                          threads=torch.get_num_threads(),
                          atm_merged_fraction=None, atm_lengths=[])
        results = timing["results"]
        print(ROW_HEADER, flush=True)
        for i, r in enumerate(results):
            _progress(f"memory: {_label(r['backend'], r['atm'])} in a fresh process ({i + 1}/{len(results)})")
            try:
                r.update(_subprocess(_memory, args, r["backend"], r["atm"], a.budget,
                                     limit_s=a.budget + PROCESS_GRACE_S))
            except BudgetExceeded as exc:
                r["memory_skipped"] = str(exc)
            r["threads"] = timing["threads"]
            print(_row(r, timing["atm_merged_fraction"]), flush=True)
        threads, merged_fraction, lengths = timing["threads"], timing["atm_merged_fraction"], timing["atm_lengths"]
    else:
        print(ROW_HEADER, flush=True)
        results = []
        for backend, atm in cases:
            results.append(_in_process(args, backend, atm, a.budget))
            merged_fraction, lengths = _merge_counts()
            print(_row(results[-1], merged_fraction), flush=True)
        threads = torch.get_num_threads()
    flops = _atm_flops(args, lengths) if lengths else None
    for line in _summary(results, threads, _backend(args, "fused"), flops):
        print(line)
    for r in results:
        r["atm_merged_fraction"] = merged_fraction
        r["attention_gflops"] = None if flops is None else (flops["on"] if r["atm"] else flops["off"]) / 1e9
        r["budget_s"] = a.budget
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return results

"""Training-step benchmark on a GPU: wiola-360m, fused vs reference kernels, ATM off and on,
beside a Hugging Face Llama of the same parameter count, in one run.

    python -m wiola bench --device cuda                  # wiola-360m, B 4 x T 2048, bf16
    python -m wiola bench --device cuda --steps 5 --json out.json

One training step = forward (LM loss) + backward + AdamW, bf16 weights and activations. The
cases run one after another (each model built, warmed up, timed and freed before the next),
and each prints its row as soon as it is done, so a run cut short by a time limit still leaves
the rows it finished. Order (what the targets need first): fused and reference ATM off, the
Llama eager and compiled, then fused and reference ATM on.

* ``tokens/s`` = B·T over the median step time (CUDA-synchronised wall time; the host mostly
  waits on a GPU), after ``--warmup`` untimed steps (compilation included).
* ``peak MiB``: ``torch.cuda.max_memory_allocated`` over one step above what was allocated
  before it (model, optimizer state and inputs excluded; activations and gradients included).
* The Llama (:func:`llama_config_like`): d, L, H, H_kv, d_h, V and the tied head of the Wiola
  config, and the SwiGLU width that gives it the same parameter count (within 1 %), SDPA attention.

Targets (issue 37): fused ≥ 2× the reference's tokens/s, and ≥ 0.9× the Llama's compiled step.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

CASES = (("fused", False), ("reference", False), ("llama", "eager"), ("llama", "compile"), ("fused", True),
         ("reference", True))


def wiola_config(name: str = "wiola-360m", backend: str = "auto", atm: bool = False, seq: int = 2048):
    """The WiolaConfig of one case."""
    from ..configuration_wiola import WiolaConfig

    return WiolaConfig.from_name(name, kernel_backend=backend, atm_enabled=atm,
                                 max_position_embeddings=max(2048, seq))


def llama_parameters(cfg: dict) -> int:
    """Parameters of a ``LlamaForCausalLM`` with config fields ``cfg`` (no biases; a tied head counts once)."""
    d, L, h, h_kv, dh, V, inter = (cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                      "num_key_value_heads", "head_dim", "vocab_size",
                                                      "intermediate_size"))
    attn = d * h * dh + 2 * d * h_kv * dh + h * dh * d
    layer = attn + 3 * d * inter + 2 * d
    return V * d * (1 if cfg.get("tie_word_embeddings", False) else 2) + L * layer + d


def llama_config_like(wiola_cfg, parameters: int) -> dict:
    """LlamaConfig fields with the Wiola config's d, L, H, H_kv, d_h, V and tied head, and the
    SwiGLU width (a multiple of 64) that brings its parameter count nearest ``parameters``."""
    cfg = dict(hidden_size=wiola_cfg.hidden_size, num_hidden_layers=wiola_cfg.num_hidden_layers,
               num_attention_heads=wiola_cfg.num_attention_heads, num_key_value_heads=wiola_cfg.num_key_value_heads,
               head_dim=wiola_cfg.head_dim, vocab_size=wiola_cfg.vocab_size,
               tie_word_embeddings=bool(wiola_cfg.tie_word_embeddings), intermediate_size=0,
               max_position_embeddings=wiola_cfg.max_position_embeddings, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    rest = parameters - llama_parameters(cfg)
    per_unit = 3 * cfg["hidden_size"] * cfg["num_hidden_layers"]
    cfg["intermediate_size"] = max(64, round(rest / per_unit / 64) * 64)
    return cfg


def _progress(line: str) -> None:
    print(f"  [bench] {line}", file=sys.stderr, flush=True)


def _on_device(make, device: torch.device):
    """``make()`` initialised on ``device`` (seconds; a 360 M model's CPU init takes tens of them),
    or on the CPU where that fails; in bf16, in training mode."""
    try:
        with torch.device(device):
            model = make()
    except Exception:  # noqa: BLE001 - a constructor that insists on the CPU
        model = make()
    return model.to(device=device, dtype=torch.bfloat16).train()


def _build(case: tuple, args, device: torch.device, params: int):
    """(model, step callable, label) of one case, in bf16 on ``device``."""
    kind, opt = case
    torch.manual_seed(0)
    if kind == "llama":
        import transformers

        cfg = transformers.LlamaConfig(**llama_config_like(wiola_config(args.model, seq=args.seq), params))
        cfg._attn_implementation = "sdpa"
        model = _on_device(lambda: transformers.LlamaForCausalLM(cfg), device)
        run = torch.compile(model) if opt == "compile" else model
        label = f"HF Llama {opt} (I {cfg.intermediate_size})"

        def forward(ids):
            return run(input_ids=ids, labels=ids).loss
    else:
        from ..modeling_wiola import WiolaForCausalLM

        backend = args.fused if kind == "fused" else "reference"
        config = wiola_config(args.model, backend, opt, args.seq)
        model = _on_device(lambda: WiolaForCausalLM(config), device)
        label = f"{args.model} {kind} ({backend}) ATM {'on' if opt else 'off'}"

        def forward(ids):
            return model(ids, labels=ids, use_cache=False).loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        loss = forward(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return model, step, label


def run_case(case: tuple, args, device: torch.device, params: int) -> dict:
    """Build, warm up, measure and free one case; its record."""
    t0 = time.perf_counter()
    model, step, label = _build(case, args, device, params)
    n_params = sum(p.numel() for p in model.parameters())
    loss = float(step())
    for _ in range(args.warmup - 1):
        step()
    torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - t0
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    del model, step
    gc.collect()
    torch.cuda.empty_cache()
    s = statistics.median(times)
    return dict(case=label, kind=case[0], option=case[1], parameters=n_params, step_s=s,
                tokens_per_s=args.batch * args.seq / s, peak_mb=peak, first_loss=loss, warmup_s=warmup_s,
                steps_s=[round(t, 5) for t in times])


def format_row(r: dict) -> str:
    """One case's line."""
    if "error" in r:
        return f"  {r['case']:<44} ERROR: {r['error']}"
    return (f"  {r['case']:<44} {r['tokens_per_s']:>10.0f} {r['step_s'] * 1e3:>9.1f} {r['peak_mb']:>9.0f} "
            f"{r['parameters'] / 1e6:>8.1f} {r['first_loss']:>8.4f} {r['warmup_s']:>8.1f}")


def summary(rows: list[dict]) -> list[str]:
    """The target lines (fused vs reference, vs the Llama compiled, ATM on/off) from the rows that ran."""
    by = {(r["kind"], r["option"]): r for r in rows if "error" not in r}
    out = []
    fused, ref = by.get(("fused", False)), by.get(("reference", False))
    llama_c = by.get(("llama", "compile"))
    if fused and ref:
        x = fused["tokens_per_s"] / ref["tokens_per_s"]
        out.append(f"fused / reference (ATM off): {x:.2f}x tokens/s (target >= 2x: {'met' if x >= 2 else 'NOT met'})")
    if fused and llama_c:
        x = fused["tokens_per_s"] / llama_c["tokens_per_s"]
        out.append(f"fused / HF Llama compiled: {x:.2f}x tokens/s (target >= 0.9x: {'met' if x >= 0.9 else 'NOT met'})")
    if fused and by.get(("fused", True)):
        out.append(f"ATM on / off (fused): {by[('fused', True)]['tokens_per_s'] / fused['tokens_per_s']:.2f}x tokens/s")
    return out


def split_device(argv: list[str]) -> tuple[str, list[str]]:
    """``(device, the other arguments)`` from ``python -m wiola bench``'s arguments: ``--device X``
    or ``--device=X`` taken out (``"cpu"`` when absent: the CPU benchmark's default)."""
    rest, device, i = [], "cpu", 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--device" and i + 1 < len(argv):
            device, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--device="):
            device = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return device, rest


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m wiola bench --device cuda``: one record per case (see the module docstring)."""
    from wiola_kernels.cli import CommandError, HelpFormatter, positive_int

    from ..configuration_wiola import KERNEL_BACKENDS

    p = argparse.ArgumentParser(prog="python -m wiola bench --device cuda", formatter_class=HelpFormatter,
                                description="Training-step benchmark on a GPU: wiola-360m fused vs reference, ATM "
                                            "off/on, beside a same-size Hugging Face Llama (eager, compiled).")
    p.add_argument("--device", default="cuda", help="a CUDA device")
    p.add_argument("--model", default="wiola-360m", help="Wiola preset")
    p.add_argument("--batch", type=positive_int, default=4, help="rows per step")
    p.add_argument("--seq", type=positive_int, default=2048, help="tokens per row")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per case (median)")
    p.add_argument("--warmup", type=positive_int, default=2, help="untimed steps first (compilation included)")
    p.add_argument("--fused", default="auto", choices=KERNEL_BACKENDS, help="backend of the fused cases")
    p.add_argument("--cases", help="comma-separated subset: fused,fused-atm,llama-eager,llama-compile,reference,"
                                   "reference-atm (default: all, in that order of priority)")
    p.add_argument("--json", metavar="FILE", help="also write the records (rewritten after every case)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise CommandError(f"--device {a.device}: this benchmark needs a CUDA device (python -m wiola bench "
                           "without --device times the CPU)")
    names = {"fused": ("fused", False), "fused-atm": ("fused", True), "llama-eager": ("llama", "eager"),
             "llama-compile": ("llama", "compile"), "reference": ("reference", False),
             "reference-atm": ("reference", True)}
    if a.cases:
        unknown = [c for c in a.cases.split(",") if c.strip() and c.strip() not in names]
        if unknown:
            raise CommandError(f"--cases: unknown {unknown}; choose from {', '.join(names)}")
        wanted = {names[c.strip()] for c in a.cases.split(",") if c.strip()}
        cases = [c for c in CASES if c in wanted]
    else:
        cases = list(CASES)
    from ..modeling_wiola import WiolaForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in WiolaForCausalLM(wiola_config(a.model, seq=a.seq)).parameters())
    print(f"wiola bench (GPU): training step (fwd+bwd+AdamW), {a.model} ({params / 1e6:.1f} M parameters), "
          f"B {a.batch} x T {a.seq}, bf16, {torch.cuda.get_device_name(device)}, torch {torch.__version__}; "
          f"median of {a.steps} steps after {a.warmup} warm-up", flush=True)
    print(f"  {'case':<44} {'tokens/s':>10} {'step ms':>9} {'peak MiB':>9} {'params M':>8} {'loss':>8} "
          f"{'warm-up s':>8}", flush=True)
    rows: list[dict] = []
    for case in cases:
        _progress(f"{case[0]} {case[1]}: building and warming up")
        try:
            row = run_case(case, a, device, params)
        except Exception as exc:  # noqa: BLE001 - one case failing (out of memory...) must not end the run
            row = dict(case=f"{case[0]} {case[1]}", kind=case[0], option=case[1],
                       error=f"{type(exc).__name__}: {exc}"[:300])
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        print(format_row(row), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    for line in summary(rows):
        print(line, flush=True)
    return rows

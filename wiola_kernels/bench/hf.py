"""Benchmark case ``hf_llama_step``: a training step of a Hugging Face Llama in four
variants — unpatched eager, unpatched ``torch.compile``, patched by
:func:`wiola_kernels.patch_hf` eager, and patched compiled — in one process (``python -m
wiola_kernels bench --hf llama``; the pytest-benchmark suite in ``benchmarks/`` times the
eager steps).

The step is forward (with the language-modelling loss), backward and ``AdamW.step``; the
compiled variants wrap the model in ``torch.compile`` (default inductor), the optimizer
stays eager. Four models with the same weights, each with its own optimizer, are timed in
rotation (the order shifted every round), so all see the same machine load; the medians
are reported. Throughput ``tokens_per_s`` is by the process's CPU time on the CPU (on a
shared, loaded machine it moves far less than wall time, which includes waiting for a
core) and by wall time on a GPU (where the host thread mostly waits); both are in the
record. Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over a step; on the
CPU, the growth of the process's peak resident set over a step (``VmHWM`` reset through
``/proc/self/clear_refs`` after ``malloc_trim``), i.e. the memory the step really touched.

Model: Llama with d = 512, L = 4, 8 heads (d_h = 64, no GQA), SwiGLU width 1376 (≈ 8d/3),
vocabulary 32000 (Llama's), SDPA attention; B = 2, T = 1024; float32 on the CPU,
bfloat16 on a GPU. ``small=True``: d 64, L 2, T 64, vocabulary 256 (seconds per step; the
compile warm-up dominates; smoke tests).
"""

from __future__ import annotations

import copy
import ctypes
import statistics
import time
from dataclasses import dataclass

import torch

OP = "hf_llama_step"
VARIANTS = ("unpatched_eager", "unpatched_compile", "patched_eager", "patched_compile")


@dataclass
class HFStepCase:
    """Everything one timing needs: the model config, the batch, and the dtype."""

    family: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    length: int
    config_kwargs: dict

    @property
    def shape(self) -> str:
        c = self.config_kwargs
        return (f"d {c['hidden_size']}, L {c['num_hidden_layers']}, H {c['num_attention_heads']}, "
                f"V {c['vocab_size']}, B {self.batch}, T {self.length}")

    def make_model(self, seed: int = 0):
        """A random-initialised model (seeded) in ``dtype`` on ``device``, in training mode."""
        import transformers

        config = transformers.LlamaConfig(**self.config_kwargs)
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            torch.manual_seed(seed)
            model = transformers.LlamaForCausalLM(config)
        return model.to(device=self.device, dtype=self.dtype).train()

    def make_batch(self, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.config_kwargs["vocab_size"], (self.batch, self.length), generator=g)
        return ids.to(self.device)


def hf_case(family: str, device: torch.device | str, small: bool = False) -> HFStepCase:
    """The ``--hf`` benchmark case (only ``llama`` is defined)."""
    if family != "llama":
        raise ValueError(f"--hf: unknown model family {family!r}; known: ['llama']")
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if small:
        cfg = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=256, max_position_embeddings=128)
        b, t = 2, 64
    else:
        cfg = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
        b, t = 2, 1024
    cfg.update(rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               tie_word_embeddings=False)
    return HFStepCase(family, device, dtype, b, t, cfg)


def make_step(model, ids: torch.Tensor):
    """``step()``: one forward (LM loss), backward and AdamW step of ``model`` on ``ids``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def make_swapped_ops_pass(model, case: HFStepCase, seed: int = 2):
    """``run()``: forward + backward of only what :func:`~wiola_kernels.patch_hf` swaps, at the
    step's shapes and call counts, using ``model``'s own modules (patched or not): 2L + 1
    RMSNorms of ``(B, T, d)``, one rotary-table call and L RoPE applications to q/k
    laid out as HF's projections are (``(B, T, H, d_h)`` viewed as ``(B, H, T, d_h)``),
    and L MLP gate products ``SiLU(gate) ⊙ up`` of ``(B, T, intermediate)`` (HF's
    ``act_fn(g) * u``, or :func:`wiola_kernels.glu` where the MLP is swapped).
    Its time is the part of the step the patch can change."""
    import sys

    from ..hf import FusedGatedMLP
    from ..ops.glu import glu

    cfg = model.config
    b, t, d = case.batch, case.length, cfg.hidden_size
    h, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = d // h
    modeling = sys.modules[type(model).__module__]
    norms = [m for m in model.modules() if "RMSNorm" in type(m).__name__]
    rotary = model.model.rotary_emb
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, d, generator=g).to(case.device, case.dtype).requires_grad_()
    q_proj = torch.randn(b, t, h * dh, generator=g).to(case.device, case.dtype).requires_grad_()
    k_proj = torch.randn(b, t, h_kv * dh, generator=g).to(case.device, case.dtype).requires_grad_()
    pos = torch.arange(t, device=case.device).unsqueeze(0)
    layers = cfg.num_hidden_layers
    width = cfg.intermediate_size
    gate = torch.randn(b, t, width, generator=g).to(case.device, case.dtype).requires_grad_()
    up = torch.randn(b, t, width, generator=g).to(case.device, case.dtype).requires_grad_()
    products = [(lambda a, u: glu(a, u, "silu")) if isinstance(layer.mlp, FusedGatedMLP)
                else (lambda a, u, act=layer.mlp.act_fn: act(a) * u) for layer in model.model.layers]

    def run():
        total = x.new_zeros(())
        rope = rotary(x, pos)
        for i, norm in enumerate(norms):
            total = total + norm(x).float().square().mean()
            if i < layers:
                q = q_proj.view(b, t, h, dh).transpose(1, 2)
                k = k_proj.view(b, t, h_kv, dh).transpose(1, 2)
                q_rot, k_rot = modeling.apply_rotary_pos_emb(q, k, *rope)
                total = total + q_rot.float().square().mean() + k_rot.float().square().mean()
        for product in products:
            total = total + product(gate, up).float().square().mean()
        total.backward()
        x.grad = q_proj.grad = k_proj.grad = gate.grad = up.grad = None
        model.zero_grad(set_to_none=True)
        return total.detach()

    return run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_mb(step, device: torch.device) -> float:
    """Memory a call of ``step()`` needs above what is live before it, in MiB (see the module docstring)."""
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so RSS ≈ live memory
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _status_kb("VmRSS")
    except OSError:
        return float("nan")  # not Linux/glibc: no measurement
    step()
    return (_status_kb("VmHWM") - base) / 1024


def run_hf_bench(case: HFStepCase, repeats: int = 5, warmup: int = 2, backend: str = "auto",
                 progress=None, variants=VARIANTS) -> list[dict]:
    """Time the training step of each of ``variants`` in rotation; one record per variant."""
    from .. import dispatch
    from ..hf import patch_hf

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants: unknown {unknown}; known: {list(VARIANTS)}")
    ids = case.make_batch()
    base = case.make_model()
    # All are copies of one model, so none keeps the allocation pattern of construction.
    models = {v: patch_hf(copy.deepcopy(base)) if v.startswith("patched") else copy.deepcopy(base)
              for v in variants}
    del base
    steps = {v: make_step(torch.compile(m) if v.endswith("compile") else m, ids) for v, m in models.items()}
    samples: dict[str, list[float]] = {v: [] for v in variants}  # wall time per step
    cpu_samples: dict[str, list[float]] = {v: [] for v in variants}  # process CPU time per step
    first_loss, warmup_s = {}, {}
    eager = [v for v in variants if v.endswith("eager")]
    ops = {v: make_swapped_ops_pass(models[v], case) for v in eager}
    op_samples: dict[str, list[float]] = {v: [] for v in eager}
    with dispatch.use_backend(backend):
        for v in variants:  # warm-up: compilation, and first touch of the optimizer state
            t0 = time.perf_counter()
            first_loss[v] = float(steps[v]())
            for _ in range(warmup - 1):
                steps[v]()
            _sync(case.device)
            warmup_s[v] = time.perf_counter() - t0
        peaks = {v: peak_mb(steps[v], case.device) for v in variants}
        for i in range(repeats):
            order = variants[i % len(variants):] + variants[:i % len(variants)]
            for v in order:
                _sync(case.device)
                t0, c0 = time.perf_counter(), time.process_time()
                steps[v]()
                _sync(case.device)
                samples[v].append(time.perf_counter() - t0)
                cpu_samples[v].append(time.process_time() - c0)
                if progress is not None:
                    progress.update(1)
        for v in ops:
            ops[v]()  # warm-up
        for i in range(4 * repeats):  # short: more samples, same alternation
            for v in (eager if i % 2 == 0 else eager[::-1]):
                _sync(case.device)
                t0 = time.perf_counter()
                ops[v]()
                _sync(case.device)
                op_samples[v].append(time.perf_counter() - t0)
    tokens = case.batch * case.length
    timing = "wall" if case.device.type == "cuda" else "process_cpu"
    records = []
    for v in variants:
        ms = statistics.median(samples[v]) * 1e3
        cpu_ms = statistics.median(cpu_samples[v]) * 1e3
        record = {
            "op": OP, "variant": v,
            "backend": dispatch.select("rms_norm", case.device) if backend == "auto" else backend,
            "shape": case.shape, "dtype": str(case.dtype).replace("torch.", ""), "pass": "train_step",
            "timing": timing,
            "tokens_per_s": tokens / (ms if timing == "wall" else cpu_ms) * 1e3,
            "tokens_per_s_wall": tokens / ms * 1e3, "tokens_per_s_cpu": tokens / cpu_ms * 1e3,
            "ms": ms, "cpu_ms": cpu_ms, "peak_mb": peaks[v],
            "loss": first_loss[v],  # of the first step: the same model and batch for every variant
            "warmup_s": warmup_s[v],  # the warm-up steps, compilation included
            "repeats": repeats, "threads": torch.get_num_threads(), "device": str(case.device),
            "ms_samples": [round(t * 1e3, 2) for t in samples[v]],
            "cpu_ms_samples": [round(t * 1e3, 2) for t in cpu_samples[v]],
        }
        if v in ops:
            # Only what patch_hf swaps (norms, RoPE, MLP gate products; forward + backward), run eagerly, and
            # its share of this variant's step (wall time, both).
            record["swapped_ops_ms"] = statistics.median(op_samples[v]) * 1e3
            record["swapped_ops_share"] = record["swapped_ops_ms"] / ms
        records.append(record)
    base = next((r for r in records if r["variant"] == "unpatched_eager"), None)
    for r in records:
        r["speedup_vs_unpatched_eager"] = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        r["peak_vs_unpatched_eager"] = r["peak_mb"] / base["peak_mb"] if base and base["peak_mb"] > 0 else float("nan")
    return records


def format_hf_records(records: list[dict]) -> str:
    """:func:`run_hf_bench`'s records as a table, one row per variant."""
    r0 = records[0]
    by = "process CPU time" if r0["timing"] == "process_cpu" else "wall time"
    lines = [f"{r0['op']} ({r0['shape']}, {r0['dtype']}, {r0['device']}, backend {r0['backend']}, "
             f"median of {r0['repeats']} rotating steps; tokens/s by {by})",
             f"  {'variant':<18} {'tokens/s':>9} {'vs eager':>8} {'wall ms':>9} {'cpu ms':>9} {'peak MiB':>9} "
             f"{'vs eager':>8} {'first loss':>10} {'warm-up s':>9}"]
    for r in records:
        lines.append(f"  {r['variant']:<18} {r['tokens_per_s']:9.0f} {r['speedup_vs_unpatched_eager']:7.3f}x "
                     f"{r['ms']:9.1f} {r['cpu_ms']:9.1f} {r['peak_mb']:9.1f} {r['peak_vs_unpatched_eager']:7.3f}x "
                     f"{r['loss']:10.5f} {r['warmup_s']:9.1f}")
    for r in records:
        if "swapped_ops_ms" in r:
            lines.append(f"  {r['variant']}: swapped ops only (2L+1 RMSNorms + L RoPEs + L gate products, "
                         f"fwd+bwd, eager) "
                         f"{r['swapped_ops_ms']:.1f} ms = {100 * r['swapped_ops_share']:.1f}% of its step")
    return "\n".join(lines)

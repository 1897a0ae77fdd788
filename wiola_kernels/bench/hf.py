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

``size="1b"`` (``bench --hf llama --size 1b``): Llama-3.2-1B's shapes (:data:`LLAMA_3_2_1B`:
d 2048, L 16, H 32, H_kv 8, intermediate 8192, V 128256, tied head; RoPE θ 500000 of the
default type — its llama3 frequency scaling changes the angles, not the work), bf16 on a GPU,
B 4 × T 2048. A model that size with its gradients and AdamW state takes ~10 GB, so the
variants run one after another (each built, warmed up, timed and freed before the next),
each record reported as it completes (``on_record``); the small model's variants keep the
rotation.

Two more variants on CUDA: ``liger_eager`` and ``liger_compile``, the model patched by
Liger-Kernel's ``apply_liger_kernel_to_llama`` (RoPE, RMSNorm, SwiGLU, fused linear
cross-entropy; :func:`wiola_kernels.bench.peers.apply_liger_to_llama`). Where Liger cannot
run (not installed; not a GPU) those variants give a record with ``skipped`` and the reason.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import statistics
import time
from dataclasses import dataclass

import torch

OP = "hf_llama_step"
VARIANTS = ("unpatched_eager", "unpatched_compile", "patched_eager", "patched_compile", "liger_eager",
            "liger_compile")
#: What ``bench --hf llama`` runs when no ``--variants`` are named (Liger's only on CUDA).
DEFAULT_VARIANTS = VARIANTS[:4]
DEFAULT_VARIANTS_CUDA = VARIANTS
SIZES = ("default", "1b")
#: Llama-3.2-1B's config.json, the fields that fix the shapes and the work (meta-llama/Llama-3.2-1B).
LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, max_position_embeddings=131072,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
LLAMA_3_2_1B_BATCH = (4, 2048)  # B × T


@dataclass
class HFStepCase:
    """Everything one timing needs: the model config, the batch, and the dtype."""

    family: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    length: int
    config_kwargs: dict
    size: str = "default"
    sequential: bool = False   # one variant at a time (a model too large to hold several copies)

    @property
    def shape(self) -> str:
        c = self.config_kwargs
        return (f"d {c['hidden_size']}, L {c['num_hidden_layers']}, H {c['num_attention_heads']}"
                + (f", H_kv {c['num_key_value_heads']}" if c["num_key_value_heads"] != c["num_attention_heads"] else "")
                + f", V {c['vocab_size']}" + (", tied" if c.get("tie_word_embeddings") else "")
                + f", B {self.batch}, T {self.length}")

    def make_model(self, seed: int = 0):
        """A random-initialised model (seeded) in ``dtype`` on ``device``, in training mode."""
        import transformers

        config = transformers.LlamaConfig(**self.config_kwargs)
        config._attn_implementation = "sdpa"
        # A large model is initialised on the device (seconds, not a minute of CPU init).
        where = torch.device(self.device) if self.sequential else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]), where:
            torch.manual_seed(seed)
            model = transformers.LlamaForCausalLM(config)
        return model.to(device=self.device, dtype=self.dtype).train()

    def make_batch(self, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.config_kwargs["vocab_size"], (self.batch, self.length), generator=g)
        return ids.to(self.device)


def hf_case(family: str, device: torch.device | str, small: bool = False, size: str = "default") -> HFStepCase:
    """The ``--hf`` benchmark case (only ``llama`` is defined).

    Args:
        family: ``"llama"``.
        device: where the models run (bf16 on CUDA, float32 on the CPU).
        small: tiny shapes for smoke tests (only with ``size="default"``).
        size: ``"default"`` (d 512, L 4) or ``"1b"`` (Llama-3.2-1B's shapes, B 4 × T 2048).
    """
    if family != "llama":
        raise ValueError(f"--hf: unknown model family {family!r}; known: ['llama']")
    if size not in SIZES:
        raise ValueError(f"--size: must be one of {list(SIZES)}, got {size!r}")
    if size != "default" and small:
        raise ValueError(f"--size {size} and --small exclude each other")
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if size == "1b":
        return HFStepCase(family, device, dtype, *LLAMA_3_2_1B_BATCH, copy.deepcopy(LLAMA_3_2_1B), size="1b",
                          sequential=True)
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


def _variant(base, v: str):
    """``(model, scope)`` of variant ``v``: a copy of ``base``, patched by :func:`~wiola_kernels.patch_hf`
    or by Liger-Kernel, and a context-manager factory its steps run under (Liger's RoPE)."""
    from ..hf import patch_hf

    model = copy.deepcopy(base)
    if v.startswith("patched"):
        return patch_hf(model), contextlib.nullcontext
    if v.startswith("liger"):
        from . import peers

        rope = peers.apply_liger_to_llama(model)
        return model, (lambda: peers.liger_rope_scope(rope))
    return model, contextlib.nullcontext


def _scoped(step, scope):
    def run():
        with scope():
            return step()
    return run


def _record(case: HFStepCase, v: str, backend: str, samples: list[float], cpu_samples: list[float], peak: float,
            loss: float, warmup_s: float, repeats: int) -> dict:
    from .. import dispatch

    tokens = case.batch * case.length
    timing = "wall" if case.device.type == "cuda" else "process_cpu"
    ms = statistics.median(samples) * 1e3
    cpu_ms = statistics.median(cpu_samples) * 1e3
    return {
        "op": OP, "variant": v, "size": case.size,
        "backend": dispatch.select("rms_norm", case.device) if backend == "auto" else backend,
        "shape": case.shape, "dtype": str(case.dtype).replace("torch.", ""), "pass": "train_step",
        "timing": timing,
        "tokens_per_s": tokens / (ms if timing == "wall" else cpu_ms) * 1e3,
        "tokens_per_s_wall": tokens / ms * 1e3, "tokens_per_s_cpu": tokens / cpu_ms * 1e3,
        "ms": ms, "cpu_ms": cpu_ms, "peak_mb": peak,
        "loss": loss,  # of the first step: the same model and batch for every variant
        "warmup_s": warmup_s,  # the warm-up steps, compilation included
        "repeats": repeats, "threads": torch.get_num_threads(), "device": str(case.device),
        "ms_samples": [round(t * 1e3, 2) for t in samples],
        "cpu_ms_samples": [round(t * 1e3, 2) for t in cpu_samples],
    }


def _skipped(case: HFStepCase, variants) -> dict:
    """``{variant: reason}`` for the variants that cannot run here (Liger's without Liger or a GPU)."""
    from . import peers

    out = {}
    if any(v.startswith("liger") for v in variants):
        st = peers.status("liger", case.device)
        if not st.available:
            out = {v: st.describe() for v in variants if v.startswith("liger")}
    return out


def _timed(step, device) -> tuple[float, float]:
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def run_hf_bench(case: HFStepCase, repeats: int = 5, warmup: int = 2, backend: str = "auto",
                 progress=None, variants=DEFAULT_VARIANTS, on_record=None) -> list[dict]:
    """Time the training step of each of ``variants``; one record per variant.

    Variants run in rotation (every step of every variant in turn), or one after another for
    a case marked ``sequential`` (Llama-3.2-1B: one model at a time fits the device), each record
    passed to ``on_record`` as soon as it is complete. A variant that cannot run here (Liger's
    without Liger-Kernel or a GPU) gives a record ``{"op", "variant", "skipped": reason}``.
    """
    from .. import dispatch

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants: unknown {unknown}; known: {list(VARIANTS)}")
    variants = tuple(v for v in VARIANTS if v in variants)  # unpatched eager, the yardstick, first
    skipped = _skipped(case, variants)
    emit = on_record or (lambda r: None)
    records = []
    for v, why in skipped.items():
        records.append({"op": OP, "variant": v, "size": case.size, "shape": case.shape, "skipped": why})
        emit(records[-1])
    variants = tuple(v for v in variants if v not in skipped)
    ids = case.make_batch()
    base = case.make_model()
    with dispatch.use_backend(backend):
        if case.sequential:
            for v in variants:
                model, scope = _variant(base, v)
                step = _scoped(make_step(torch.compile(model) if v.endswith("compile") else model, ids), scope)
                t0 = time.perf_counter()
                loss = float(step())
                for _ in range(warmup - 1):
                    step()
                _sync(case.device)
                warmup_s = time.perf_counter() - t0
                peak = peak_mb(step, case.device)
                samples, cpu_samples = [], []
                for _ in range(repeats):
                    wall, cpu = _timed(step, case.device)
                    samples.append(wall)
                    cpu_samples.append(cpu)
                    if progress is not None:
                        progress.update(1)
                records.append(_record(case, v, backend, samples, cpu_samples, peak, loss, warmup_s, repeats))
                _finish(records, emit)
                del model, step
                if case.device.type == "cuda":
                    torch.cuda.empty_cache()
            del base
            return records
        # All are copies of one model, so none keeps the allocation pattern of construction.
        built = {v: _variant(base, v) for v in variants}
        models = {v: m for v, (m, _) in built.items()}
        del base
        steps = {v: _scoped(make_step(torch.compile(m) if v.endswith("compile") else m, ids), built[v][1])
                 for v, m in models.items()}
        samples: dict[str, list[float]] = {v: [] for v in variants}  # wall time per step
        cpu_samples: dict[str, list[float]] = {v: [] for v in variants}  # process CPU time per step
        first_loss, warmup_s = {}, {}
        eager = [v for v in variants if v in ("unpatched_eager", "patched_eager")]
        ops = {v: make_swapped_ops_pass(models[v], case) for v in eager}
        op_samples: dict[str, list[float]] = {v: [] for v in eager}
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
                wall, cpu = _timed(steps[v], case.device)
                samples[v].append(wall)
                cpu_samples[v].append(cpu)
                if progress is not None:
                    progress.update(1)
        for v in ops:
            ops[v]()  # warm-up
        for i in range(4 * repeats):  # short: more samples, same alternation
            for v in (eager if i % 2 == 0 else eager[::-1]):
                op_samples[v].append(_timed(ops[v], case.device)[0])
    for v in variants:
        record = _record(case, v, backend, samples[v], cpu_samples[v], peaks[v], first_loss[v], warmup_s[v], repeats)
        if v in ops:
            # Only what patch_hf swaps (norms, RoPE, MLP gate products; forward + backward), run eagerly, and
            # its share of this variant's step (wall time, both).
            record["swapped_ops_ms"] = statistics.median(op_samples[v]) * 1e3
            record["swapped_ops_share"] = record["swapped_ops_ms"] / record["ms"]
        records.append(record)
        _finish(records, emit)
    return records


def _finish(records: list[dict], emit) -> None:
    """Ratios of the last record to unpatched eager (when that has run), then ``emit`` it."""
    base = next((r for r in records if r["variant"] == "unpatched_eager" and "skipped" not in r), None)
    for r in records:
        if "skipped" in r:
            continue
        r["speedup_vs_unpatched_eager"] = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        r["peak_vs_unpatched_eager"] = r["peak_mb"] / base["peak_mb"] if base and base["peak_mb"] > 0 else float("nan")
    emit(records[-1])


def format_hf_header(case: HFStepCase, repeats: int, backend: str) -> str:
    """The title and column line of :func:`format_hf_records` (printed before rows that come one by one)."""
    by = "process CPU time" if case.device.type == "cpu" else "wall time"
    how = "one variant after another" if case.sequential else "rotating steps"
    return (f"{OP} ({case.shape}, {str(case.dtype).replace('torch.', '')}, {case.device}, backend {backend}, "
            f"median of {repeats} {how}; tokens/s by {by})\n"
            f"  {'variant':<18} {'tokens/s':>9} {'vs eager':>8} {'wall ms':>9} {'cpu ms':>9} {'peak MiB':>9} "
            f"{'vs eager':>8} {'first loss':>10} {'warm-up s':>9}")


def format_hf_row(r: dict) -> str:
    """One variant's line (a skipped variant says why)."""
    if "skipped" in r:
        return f"  {r['variant']:<18} skipped: {r['skipped']}"
    return (f"  {r['variant']:<18} {r['tokens_per_s']:9.0f} {r['speedup_vs_unpatched_eager']:7.3f}x "
            f"{r['ms']:9.1f} {r['cpu_ms']:9.1f} {r['peak_mb']:9.1f} {r['peak_vs_unpatched_eager']:7.3f}x "
            f"{r['loss']:10.5f} {r['warmup_s']:9.1f}")


def format_hf_records(records: list[dict]) -> str:
    """:func:`run_hf_bench`'s records as a table, one row per variant."""
    ran = [r for r in records if "skipped" not in r]
    if not ran:
        return "\n".join(format_hf_row(r) for r in records)
    r0 = ran[0]
    by = "process CPU time" if r0["timing"] == "process_cpu" else "wall time"
    lines = [f"{r0['op']} ({r0['shape']}, {r0['dtype']}, {r0['device']}, backend {r0['backend']}, "
             f"median of {r0['repeats']} steps; tokens/s by {by})",
             f"  {'variant':<18} {'tokens/s':>9} {'vs eager':>8} {'wall ms':>9} {'cpu ms':>9} {'peak MiB':>9} "
             f"{'vs eager':>8} {'first loss':>10} {'warm-up s':>9}"]
    lines += [format_hf_row(r) for r in records]
    for r in ran:
        if "swapped_ops_ms" in r:
            lines.append(f"  {r['variant']}: swapped ops only (2L+1 RMSNorms + L RoPEs + L gate products, "
                         f"fwd+bwd, eager) "
                         f"{r['swapped_ops_ms']:.1f} ms = {100 * r['swapped_ops_share']:.1f}% of its step")
    return "\n".join(lines)

"""Benchmark case ``hf_llama_step``: a training step of a Hugging Face Llama, patched by
:func:`wiola_kernels.patch_hf` vs unpatched, in one process (``python -m wiola_kernels
bench --hf llama``; the pytest-benchmark suite in ``benchmarks/`` times the same steps).

The step is forward (with the language-modelling loss), backward and ``AdamW.step``.
Two models with the same weights, each with its own optimizer, are timed in alternation
(the order swapped every round), so both see the same machine load; the medians are
reported. Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over a step; on the
CPU, the growth of the process's peak resident set over a step (``VmHWM`` reset through
``/proc/self/clear_refs`` after ``malloc_trim``), i.e. the memory the step really touched.

Model: Llama with d = 512, L = 4, 8 heads (d_h = 64, no GQA), SwiGLU width 1376 (≈ 8d/3),
vocabulary 32000 (Llama's), SDPA attention; B = 2, T = 1024; float32 on the CPU,
bfloat16 on a GPU. ``small=True``: d 64, L 2, T 64, vocabulary 256 (seconds; smoke tests).
"""

from __future__ import annotations

import copy
import ctypes
import statistics
import time
from dataclasses import dataclass

import torch

OP = "hf_llama_step"


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
    laid out as HF's projections are (``(B, T, H, d_h)`` viewed as ``(B, H, T, d_h)``).
    Its time is the part of the step the patch can change."""
    import sys

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
        total.backward()
        x.grad = q_proj.grad = k_proj.grad = None
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


def run_hf_bench(case: HFStepCase, repeats: int = 5, warmup: int = 1, backend: str = "auto",
                 progress=None) -> dict:
    """Time the patched and the unpatched training step in alternation; returns the record."""
    from .. import dispatch
    from ..hf import patch_hf

    ids = case.make_batch()
    base = case.make_model()
    # Both are copies of one model, so neither keeps the allocation pattern of construction.
    plain, patched = copy.deepcopy(base), patch_hf(copy.deepcopy(base))
    del base
    steps = {"patched": make_step(patched, ids), "unpatched": make_step(plain, ids)}
    samples: dict[str, list[float]] = {k: [] for k in steps}
    cpu_samples: dict[str, list[float]] = {k: [] for k in steps}  # process CPU time per step
    ops = {"patched": make_swapped_ops_pass(patched, case), "unpatched": make_swapped_ops_pass(plain, case)}
    op_samples: dict[str, list[float]] = {k: [] for k in ops}
    with dispatch.use_backend(backend):
        for name in steps:  # warm-up (and first-touch of the optimizer state)
            for _ in range(warmup):
                steps[name]()
        peaks = {name: peak_mb(fn, case.device) for name, fn in steps.items()}
        for i in range(repeats):
            order = ("patched", "unpatched") if i % 2 == 0 else ("unpatched", "patched")
            for name in order:
                _sync(case.device)
                t0, c0 = time.perf_counter(), time.process_time()
                steps[name]()
                _sync(case.device)
                samples[name].append(time.perf_counter() - t0)
                cpu_samples[name].append(time.process_time() - c0)
                if progress is not None:
                    progress.update(1)
        for name in ops:
            ops[name]()  # warm-up
        for i in range(4 * repeats):  # short: more samples, same alternation
            for name in (("patched", "unpatched") if i % 2 == 0 else ("unpatched", "patched")):
                _sync(case.device)
                t0 = time.perf_counter()
                ops[name]()
                _sync(case.device)
                op_samples[name].append(time.perf_counter() - t0)
    tokens = case.batch * case.length
    ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    ops_ms = {k: statistics.median(v) * 1e3 for k, v in op_samples.items()}
    cpu_ms = {k: statistics.median(v) * 1e3 for k, v in cpu_samples.items()}
    return {
        "op": OP, "backend": dispatch.select("rms_norm", case.device) if backend == "auto" else backend,
        "shape": case.shape, "dtype": str(case.dtype).replace("torch.", ""), "pass": "train_step",
        "ms": ms["patched"], "ms_unpatched": ms["unpatched"],
        "tokens_per_s": tokens / ms["patched"] * 1e3, "tokens_per_s_unpatched": tokens / ms["unpatched"] * 1e3,
        "speedup_vs_eager": ms["unpatched"] / ms["patched"],
        "peak_mb": peaks["patched"], "peak_mb_unpatched": peaks["unpatched"],
        "repeats": repeats, "threads": torch.get_num_threads(), "device": str(case.device),
        # CPU time of the process per step: on a shared, overloaded machine it moves far less
        # than wall time (which includes waiting for a core), so it shows small differences.
        "cpu_ms": cpu_ms["patched"], "cpu_ms_unpatched": cpu_ms["unpatched"],
        "speedup_cpu_time": cpu_ms["unpatched"] / cpu_ms["patched"],
        "ms_samples": [round(v * 1e3, 2) for v in samples["patched"]],
        "ms_unpatched_samples": [round(v * 1e3, 2) for v in samples["unpatched"]],
        # Only the swapped parts (norms + RoPE, forward + backward), and their share of the
        # unpatched step: the step speedup cannot exceed 1 / (1 − share·(1 − 1/ops_speedup)).
        "swapped_ops_ms": ops_ms["patched"], "swapped_ops_ms_unpatched": ops_ms["unpatched"],
        "swapped_ops_speedup": ops_ms["unpatched"] / ops_ms["patched"],
        "swapped_ops_share_unpatched": ops_ms["unpatched"] / ms["unpatched"],
    }


def format_hf_record(r: dict) -> str:
    """A short human-readable summary of :func:`run_hf_bench`'s record."""
    return (f"{r['op']} ({r['shape']}, {r['dtype']}, {r['device']}, backend {r['backend']}, "
            f"median of {r['repeats']} alternating steps)\n"
            f"  patched   {r['ms']:9.1f} ms  {r['tokens_per_s']:9.0f} tokens/s  peak {r['peak_mb']:8.1f} MiB\n"
            f"  unpatched {r['ms_unpatched']:9.1f} ms  {r['tokens_per_s_unpatched']:9.0f} tokens/s  "
            f"peak {r['peak_mb_unpatched']:8.1f} MiB\n"
            f"  speedup {r['speedup_vs_eager']:.3f}x, peak memory ratio "
            f"{r['peak_mb'] / r['peak_mb_unpatched'] if r['peak_mb_unpatched'] else float('nan'):.3f}\n"
            f"  process CPU time per step: {r['cpu_ms']:.1f} ms vs {r['cpu_ms_unpatched']:.1f} ms unpatched = "
            f"{r['speedup_cpu_time']:.3f}x\n"
            f"  swapped ops only (2L+1 RMSNorms + L RoPEs, fwd+bwd): {r['swapped_ops_ms']:.1f} ms vs "
            f"{r['swapped_ops_ms_unpatched']:.1f} ms unpatched = {r['swapped_ops_speedup']:.2f}x; "
            f"{100 * r['swapped_ops_share_unpatched']:.1f}% of the unpatched step")

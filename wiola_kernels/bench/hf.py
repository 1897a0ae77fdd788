"""Benchmark case ``hf_<family>_step`` (``hf_llama_step``, ...): a training step of a Hugging
Face model of a family :func:`wiola_kernels.patch_hf` supports (:data:`FAMILIES`) in four
variants — unpatched eager, unpatched ``torch.compile``, patched by
:func:`wiola_kernels.patch_hf` eager, and patched compiled — in one process (``python -m
wiola_kernels bench --hf llama``, ``--hf qwen3``, ...; the pytest-benchmark suite in
``benchmarks/`` times Llama's eager steps). ``bench --hf all`` (:func:`run_hf_all`) runs
every family in turn, by default only the two eager variants, within a time budget per
family, and prints each family's rows as they complete.

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
bfloat16 on a GPU (``dtype`` chooses: ``bench --hf ... --dtype bfloat16`` on the CPU).
``small=True``: d 64, L 2, T 64, vocabulary 256 (seconds per step; the compile warm-up
dominates; smoke tests).

The other families have the same shapes (d, L, H, MLP width, vocabulary, B × T; the
family's default special-token ids moved into the vocabulary) built from their own config
class, with each family's defaults otherwise and its own conventions (:data:`FAMILY_QUIRKS`
says what each row's model has): Mistral's sliding window (4096, wider than T), Qwen2's
q/k/v biases, Qwen3's per-head q/k RMSNorms, Gemma 2's soft-capping of attention and
final logits (HF's eager attention: SDPA cannot soft-cap) with alternating sliding (T/2)
and full layers, Gemma 3's q/k norms and one full layer after the sliding ones with their
own θ₀, Gemma's GeGLU, ``(1 + γ)`` norms, scaled embeddings and tied head, Phi-3's fused
``qkv_proj`` and ``gate_up_proj``, OLMo-2's norms after attention and MLP and on all of q/k,
SmolLM3's layer without RoPE (every fourth) and tied head. The records of the other families
have no ``swapped_ops_ms`` (that pass follows Llama's module layout).

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

from .memory import _sync, peak_mb

OP = "hf_llama_step"
#: The families ``bench --hf`` runs: every ``model_type`` :func:`wiola_kernels.patch_hf` supports.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3")
VARIANTS = ("unpatched_eager", "unpatched_compile", "patched_eager", "patched_compile", "liger_eager",
            "liger_compile")
#: What ``bench --hf <family>`` runs when no ``--variants`` are named (Liger's only on CUDA, only for Llama).
DEFAULT_VARIANTS = VARIANTS[:4]
DEFAULT_VARIANTS_CUDA = VARIANTS
#: What ``bench --hf all`` runs per family when no ``--variants`` are named.
ALL_VARIANTS = ("unpatched_eager", "patched_eager")
#: ``bench --hf all``: seconds per family (warm-up included) and timed rounds, by default.
DEFAULT_FAMILY_BUDGET_S = 300.0
ALL_REPEATS = 3
SIZES = ("default", "1b")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Llama-3.2-1B's config.json, the fields that fix the shapes and the work (meta-llama/Llama-3.2-1B).
LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, max_position_embeddings=131072,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
LLAMA_3_2_1B_BATCH = (4, 2048)  # B × T
#: What each family's model has besides the shapes (the table's header; see the module docstring).
FAMILY_QUIRKS = {
    "llama": "SwiGLU, RoPE θ₀ 1e4",
    "mistral": "SwiGLU, sliding window 4096 (> T)",
    "qwen2": "q/k/v biases, SwiGLU",
    "qwen3": "per-head q/k RMSNorms, SwiGLU",
    "gemma2": "attention soft-cap 50 and final-logit soft-cap 30 (eager attention), sliding (T/2) and full "
              "layers alternating, GeGLU, (1+γ) norms, tied head",
    "gemma3_text": "per-head q/k norms, sliding (T/2) layers then one full, θ₀ 1e4 / 1e6, GeGLU, (1+γ) norms, "
                   "tied head",
    "phi3": "fused qkv_proj and gate_up_proj",
    "olmo2": "norms after attention and MLP, q/k norms over all heads, SwiGLU",
    "smollm3": "no RoPE in every fourth layer, SwiGLU, tied head",
}


def _family_overrides(family: str, layers: int, length: int, head_dim: int) -> dict:
    """Config fields of ``family`` besides the shared shapes: its conventions at these sizes
    (the rest are its config class's defaults)."""
    if family == "llama":
        return dict(rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    tie_word_embeddings=False)
    # The families' own special-token ids lie outside a 32000 (or 256) vocabulary.
    out = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=head_dim)
    if family in ("gemma2", "gemma3_text"):
        out.update(query_pre_attn_scalar=head_dim, sliding_window=length // 2)
    if family == "gemma3_text":  # Gemma 3's one full layer in six; at L < 6 the last one
        period = min(6, layers)
        out["layer_types"] = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                              for i in range(layers)]
    if family == "smollm3":  # SmolLM3's NoPE layer every fourth (at L < 4 the last one)
        period = min(4, layers)
        out["no_rope_layers"] = [0 if (i + 1) % period == 0 else 1 for i in range(layers)]
    return out


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
    attn: str = "sdpa"         # HF's attention implementation (Gemma 2's soft-capping needs "eager")

    @property
    def op(self) -> str:
        return f"hf_{self.family}_step"

    @property
    def quirks(self) -> str:
        return FAMILY_QUIRKS.get(self.family, "")

    @property
    def shape(self) -> str:
        c = self.config_kwargs
        return (f"d {c['hidden_size']}, L {c['num_hidden_layers']}, H {c['num_attention_heads']}"
                + (f", H_kv {c['num_key_value_heads']}" if c["num_key_value_heads"] != c["num_attention_heads"] else "")
                + f", V {c['vocab_size']}" + (", tied" if self.tied else "")
                + f", B {self.batch}, T {self.length}")

    @property
    def tied(self) -> bool:
        """Whether the head shares the embedding's weight (given, or the family config's default)."""
        if "tie_word_embeddings" in self.config_kwargs:
            return bool(self.config_kwargs["tie_word_embeddings"])
        return bool(self.config().tie_word_embeddings)

    def config(self):
        """The family's config (its own class: ``LlamaConfig``, ``Gemma2Config``, ...)."""
        import transformers

        config = transformers.AutoConfig.for_model(self.family, **self.config_kwargs)
        config._attn_implementation = self.attn
        return config

    def model_class(self):
        """The family's ``*ForCausalLM`` class."""
        import importlib

        from ..hf import _FAMILIES, _modeling_name

        modeling = importlib.import_module(_modeling_name(self.family))
        return getattr(modeling, f"{_FAMILIES[self.family].prefix}ForCausalLM")

    def make_model(self, seed: int = 0):
        """A random-initialised model (seeded) in ``dtype`` on ``device``, in training mode."""
        config, cls = self.config(), self.model_class()
        # A large model is initialised on the device (seconds, not a minute of CPU init).
        where = torch.device(self.device) if self.sequential else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]), where:
            torch.manual_seed(seed)
            model = cls(config)
        return model.to(device=self.device, dtype=self.dtype).train()

    def make_batch(self, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.config_kwargs["vocab_size"], (self.batch, self.length), generator=g)
        return ids.to(self.device)


def hf_case(family: str, device: torch.device | str, small: bool = False, size: str = "default",
            dtype: torch.dtype | str | None = None) -> HFStepCase:
    """The ``--hf`` benchmark case of ``family``.

    Args:
        family: a ``model_type`` of :data:`FAMILIES` (``"llama"``, ``"qwen3"``, ...).
        device: where the models run.
        small: tiny shapes for smoke tests (only with ``size="default"``).
        size: ``"default"`` (d 512, L 4) or, for Llama only, ``"1b"`` (Llama-3.2-1B's shapes, B 4 × T 2048).
        dtype: the models' dtype (``"float32"``, ``"bfloat16"`` or a torch dtype); None: bf16 on
            CUDA, float32 on the CPU.
    """
    if family not in FAMILIES:
        raise ValueError(f"--hf: unknown model family {family!r}; known: {list(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"--size: must be one of {list(SIZES)}, got {size!r}")
    if size != "default" and family != "llama":
        raise ValueError(f"--size {size}: only with --hf llama (Llama-3.2-1B's shapes)")
    if size != "default" and small:
        raise ValueError(f"--size {size} and --small exclude each other")
    device = torch.device(device)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"--dtype: must be one of {list(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype is None:
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
    cfg.update(_family_overrides(family, cfg["num_hidden_layers"], t,
                                 cfg["hidden_size"] // cfg["num_attention_heads"]))
    return HFStepCase(family, device, dtype, b, t, cfg, attn="eager" if family == "gemma2" else "sdpa")


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
        "op": case.op, "family": case.family, "variant": v, "size": case.size,
        "backend": dispatch.select("rms_norm", case.device) if backend == "auto" else backend,
        "shape": case.shape, "dtype": str(case.dtype).replace("torch.", ""), "pass": "train_step",
        "timing": timing,
        "tokens_per_s": tokens / (ms if timing == "wall" else cpu_ms) * 1e3,
        "tokens_per_s_wall": tokens / ms * 1e3, "tokens_per_s_cpu": tokens / cpu_ms * 1e3,
        "ms": ms, "cpu_ms": cpu_ms, "peak_mb": peak,
        "loss": loss,  # of the first step: the same model and batch for every variant
        "warmup_s": warmup_s,  # the warm-up steps, compilation included
        "repeats": repeats, "threads": torch.get_num_threads(), "device": str(case.device), "quirks": case.quirks,
        "ms_samples": [round(t * 1e3, 2) for t in samples],
        "cpu_ms_samples": [round(t * 1e3, 2) for t in cpu_samples],
    }


def _skipped(case: HFStepCase, variants) -> dict:
    """``{variant: reason}`` for the variants that cannot run here (Liger's without Liger or a GPU,
    or for a family other than Llama)."""
    from . import peers

    liger = [v for v in variants if v.startswith("liger")]
    if liger and case.family != "llama":
        return {v: f"Liger-Kernel's variant is Llama's only (bench --hf llama), not {case.family}'s" for v in liger}
    out = {}
    if liger:
        st = peers.status("liger", case.device)
        if not st.available:
            out = {v: st.describe() for v in liger}
    return out


def _skip_record(case: HFStepCase, v: str, why: str) -> dict:
    return {"op": case.op, "family": case.family, "variant": v, "size": case.size, "shape": case.shape,
            "dtype": str(case.dtype).replace("torch.", ""), "skipped": why}


def _timed(step, device) -> tuple[float, float]:
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def run_hf_bench(case: HFStepCase, repeats: int = 5, warmup: int = 2, backend: str = "auto",
                 progress=None, variants=DEFAULT_VARIANTS, on_record=None, budget_s: float | None = None) -> list[dict]:
    """Time the training step of each of ``variants``; one record per variant.

    Variants run in rotation (every step of every variant in turn), or one after another for
    a case marked ``sequential`` (Llama-3.2-1B: one model at a time fits the device), each record
    passed to ``on_record`` as soon as it is complete. A variant that cannot run here (Liger's
    without Liger-Kernel or a GPU, or for another family than Llama) gives a record
    ``{"op", "variant", "skipped": reason}``.

    ``budget_s`` (rotation only; None: no limit): seconds for the whole case. Building the
    models, the warm-up steps (compiling included) and the peak-memory step must finish within
    it (a timer stops them at it; then every variant's record is ``skipped`` with the reason);
    of the ``repeats`` timed rounds, as many run as the time left allows, at least one
    (``repeats`` in the records says how many did).
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
        records.append(_skip_record(case, v, why))
        emit(records[-1])
    variants = tuple(v for v in variants if v not in skipped)
    if not variants:
        return records
    if case.sequential:
        _run_sequential(case, variants, repeats, warmup, backend, progress, records, emit)
        return records
    start = time.perf_counter()
    from .runner import _Overrun, _seconds, deadline

    try:
        with deadline(budget_s):
            runs = _prepare_rotation(case, variants, warmup, backend)
    except _Overrun:
        why = f"> {budget_s:g} s, skipped (building, warm-up and the peak-memory step unfinished at " \
              f"{_seconds(budget_s)})"
        for v in variants:
            records.append(_skip_record(case, v, why))
            emit(records[-1])
        return records
    steps, ops, first_loss, warmup_s, peaks, step_s = runs
    rounds = repeats
    if budget_s is not None:
        left = budget_s - (time.perf_counter() - start)
        rounds = max(1, min(repeats, int(left // max(sum(step_s.values()), 1e-9))))
    samples: dict[str, list[float]] = {v: [] for v in variants}  # wall time per step
    cpu_samples: dict[str, list[float]] = {v: [] for v in variants}  # process CPU time per step
    with dispatch.use_backend(backend):
        for i in range(rounds):
            order = variants[i % len(variants):] + variants[:i % len(variants)]
            for v in order:
                wall, cpu = _timed(steps[v], case.device)
                samples[v].append(wall)
                cpu_samples[v].append(cpu)
                if progress is not None:
                    progress.update(1)
        op_samples: dict[str, list[float]] = {v: [] for v in ops}
        for v in ops:
            ops[v]()  # warm-up
        for i in range(4 * rounds):  # short: more samples, same alternation
            for v in (list(ops) if i % 2 == 0 else list(ops)[::-1]):
                op_samples[v].append(_timed(ops[v], case.device)[0])
    for v in variants:
        record = _record(case, v, backend, samples[v], cpu_samples[v], peaks[v], first_loss[v], warmup_s[v], rounds)
        if budget_s is not None:
            record["budget_s"] = budget_s
        if v in ops:
            # Only what patch_hf swaps (norms, RoPE, MLP gate products; forward + backward), run eagerly, and
            # its share of this variant's step (wall time, both).
            record["swapped_ops_ms"] = statistics.median(op_samples[v]) * 1e3
            record["swapped_ops_share"] = record["swapped_ops_ms"] / record["ms"]
        records.append(record)
        _finish(records, emit)
    return records


def _prepare_rotation(case: HFStepCase, variants: tuple, warmup: int, backend: str):
    """The rotation's models and steps, warmed up, and each variant's peak memory (the step
    after the warm-up); also the swapped-ops passes of the eager variants (Llama only) and
    each variant's last step time (seconds, wall)."""
    from .. import dispatch

    ids = case.make_batch()
    base = case.make_model()
    with dispatch.use_backend(backend):
        # All are copies of one model, so none keeps the allocation pattern of construction.
        built = {v: _variant(base, v) for v in variants}
        models = {v: m for v, (m, _) in built.items()}
        del base
        steps = {v: _scoped(make_step(torch.compile(m) if v.endswith("compile") else m, ids), built[v][1])
                 for v, m in models.items()}
        first_loss, warmup_s = {}, {}
        eager = [v for v in variants if v in ("unpatched_eager", "patched_eager")]
        # The swapped-ops pass follows Llama's layout (one rotary module, d_h = d / H, act_fn · up).
        ops = {v: make_swapped_ops_pass(models[v], case) for v in eager} if case.family == "llama" else {}
        for v in variants:  # warm-up: compilation, and first touch of the optimizer state
            t0 = time.perf_counter()
            first_loss[v] = float(steps[v]())
            for _ in range(warmup - 1):
                steps[v]()
            _sync(case.device)
            warmup_s[v] = time.perf_counter() - t0
        peaks, step_s = {}, {}
        for v in variants:
            t0 = time.perf_counter()
            peaks[v] = peak_mb(steps[v], case.device)
            step_s[v] = time.perf_counter() - t0
    return steps, ops, first_loss, warmup_s, peaks, step_s


def _run_sequential(case: HFStepCase, variants: tuple, repeats: int, warmup: int, backend: str, progress,
                    records: list, emit) -> None:
    from .. import dispatch

    ids = case.make_batch()
    base = case.make_model()
    with dispatch.use_backend(backend):
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


def run_hf_all(device: torch.device | str, variants=ALL_VARIANTS, repeats: int = ALL_REPEATS, warmup: int = 1,
               backend: str = "auto", budget_s: float | None = DEFAULT_FAMILY_BUDGET_S, small: bool = False,
               dtype: torch.dtype | str | None = None, families=FAMILIES, on_record=None, progress=None) -> list[dict]:
    """``bench --hf all``: :func:`run_hf_bench` for each of ``families`` in turn (rotation,
    ``budget_s`` seconds per family), every record passed to ``on_record`` as it completes.

    ``warmup`` 1 by default: the peak-memory step after it is a second step before the timed
    ones. A family that fails (an exception) gives a ``skipped`` record per variant naming
    the error, and the run goes on. Each family's models are freed before the next is built.
    """
    import gc

    emit = on_record or (lambda r: None)
    records: list[dict] = []
    for family in families:
        case = hf_case(family, device, small=small, dtype=dtype)
        try:
            got = run_hf_bench(case, repeats=repeats, warmup=warmup, backend=backend, variants=variants,
                               on_record=emit, budget_s=budget_s, progress=progress)
        except Exception as exc:  # report and go on to the next family
            got = []
            for v in (v for v in VARIANTS if v in variants):
                got.append(_skip_record(case, v, f"failed: {type(exc).__name__}: {' '.join(str(exc).split())}"))
                emit(got[-1])
        records += got
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        else:
            with contextlib.suppress(OSError):
                ctypes.CDLL("libc.so.6").malloc_trim(0)
        torch._dynamo.reset()
    return records


def _finish(records: list[dict], emit) -> None:
    """Ratios of the last record to unpatched eager (when that has run), then ``emit`` it."""
    base = next((r for r in records if r["variant"] == "unpatched_eager" and "skipped" not in r
                 and r.get("family") == records[-1].get("family")), None)
    for r in records:
        if "skipped" in r or r.get("family") != records[-1].get("family"):
            continue
        r["speedup_vs_unpatched_eager"] = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        # By the wall clock too: on the CPU tokens/s is by CPU time, which a kernel that leaves a
        # core idle flatters.
        r["wall_speedup_vs_unpatched_eager"] = base["ms"] / r["ms"] if base and r["ms"] > 0 else float("nan")
        r["peak_vs_unpatched_eager"] = r["peak_mb"] / base["peak_mb"] if base and base["peak_mb"] > 0 else float("nan")
    emit(records[-1])


_COLUMNS = (f"{'variant':<18} {'tokens/s':>9} {'vs eager':>8} {'wall ms':>9} {'cpu ms':>9} {'peak MiB':>9} "
            f"{'vs eager':>8} {'first loss':>10} {'warm-up s':>9}")


def format_hf_header(case: HFStepCase, repeats: int, backend: str) -> str:
    """The title and column line of :func:`format_hf_records` (printed before rows that come one by one)."""
    by = "process CPU time" if case.device.type == "cpu" else "wall time"
    how = "one variant after another" if case.sequential else "rotating steps"
    return (f"{case.op} ({case.shape}, {str(case.dtype).replace('torch.', '')}, {case.device}, backend {backend}, "
            f"median of {repeats} {how}; tokens/s by {by})\n"
            + (f"  model: {case.quirks}\n" if case.family != "llama" else "")
            + f"  {_COLUMNS}")


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
             f"median of {r0['repeats']} steps; tokens/s by {by})"]
    if r0.get("family", "llama") != "llama":
        lines.append(f"  model: {r0['quirks']}")
    lines.append(f"  {_COLUMNS}")
    lines += [format_hf_row(r) for r in records]
    for r in ran:
        if "swapped_ops_ms" in r:
            lines.append(f"  {r['variant']}: swapped ops only (2L+1 RMSNorms + L RoPEs + L gate products, "
                         f"fwd+bwd, eager) "
                         f"{r['swapped_ops_ms']:.1f} ms = {100 * r['swapped_ops_share']:.1f}% of its step")
    return "\n".join(lines)


def format_hf_all_header(device: torch.device | str, repeats: int, backend: str, budget_s: float | None,
                         small: bool = False, dtype: torch.dtype | str | None = None, families=FAMILIES) -> str:
    """The title, the models and the column line of ``bench --hf all``'s table (rows: :func:`format_hf_all_row`)."""
    case = hf_case("llama", device, small=small, dtype=dtype)
    by = "process CPU time" if case.device.type == "cpu" else "wall time"
    budget = "no budget" if budget_s is None else f"budget {budget_s:g} s per family, warm-up included"
    tied = [f for f in families if hf_case(f, device, small=small).tied]
    lines = [f"hf_<family>_step, every family ({case.shape}{'; tied head: ' + ', '.join(tied) if tied else ''}; "
             f"{str(case.dtype).replace('torch.', '')}, {case.device}, backend {backend}; median of up to {repeats} "
             f"rotating steps ({budget}); tokens/s by {by}; vs eager: vs the family's unpatched eager)"]
    lines += [f"  {f:<12} {FAMILY_QUIRKS[f]}" for f in families]
    lines.append(f"  {'family':<12} {_COLUMNS} {'rounds':>6}")
    return "\n".join(lines)


def format_hf_all_row(r: dict) -> str:
    """One variant of one family: :func:`format_hf_row` after the family's name, then the timed rounds."""
    row = format_hf_row(r)[2:]
    return f"  {r['family']:<12} {row}" + ("" if "skipped" in r else f" {r['repeats']:6d}")


def format_hf_all_summary(records: list[dict]) -> str:
    """One line per family: patched eager's tokens/s and peak memory relative to unpatched eager's."""
    lines = ["patched eager vs unpatched eager, per family (tokens/s ratio, by wall time too; peak memory ratio):"]
    for family in dict.fromkeys(r["family"] for r in records):
        r = next((r for r in records if r["family"] == family and r["variant"] == "patched_eager"), None)
        if r is None or "skipped" in r:
            why = "not run" if r is None else r["skipped"]
            lines.append(f"  {family:<12} {why}")
        else:
            lines.append(f"  {family:<12} {r['speedup_vs_unpatched_eager']:.3f}x tokens/s "
                         f"({r['wall_speedup_vs_unpatched_eager']:.3f}x by wall time), "
                         f"{r['peak_vs_unpatched_eager']:.3f}x peak memory ({r['repeats']} rounds)")
    return "\n".join(lines)

"""Training demo: the tiny Wiola preset on the English text shipped in ``wiola/data``.

    python -m wiola train --steps 200 --out checkpoints/tiny
    python -m wiola train --backend reference        # the plain-PyTorch ops, to compare speed
    torchrun --nproc_per_node=2 -m wiola train --dist ddp    # or --dist fsdp (FSDP2 fully_shard)
    python -m wiola generate --checkpoint checkpoints/tiny "Once upon a time"

Byte-level tokenizer: id = byte + 3, with the config's special ids (pad 0, bos 1, eos 2).
AdamW, cosine learning rate with linear warm-up, bf16 autocast where it pays (CUDA with
bf16; ``--precision bf16`` forces it on the CPU too), next-token cross-entropy.

Distributed runs (torchrun sets ``RANK``/``WORLD_SIZE``) use the gloo backend on CPU
(nccl on CUDA). Every rank draws the same global batch from the same seed and trains
on its own slice of rows, so a 2-rank run and a 1-rank run with the same
``--batch-size`` (the global batch) see the same data and, up to float rounding, the
same losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from importlib import resources

import torch
import torch.distributed as dist
from torch import Tensor

from .configuration_wiola import WiolaConfig
from .modeling_wiola import WiolaForCausalLM

PAD, BOS, EOS, OFFSET = 0, 1, 2, 3  # byte b has id b + OFFSET


# ---- tokenizer and data ------------------------------------------------------------------

def encode(text: str, bos: bool = True) -> list[int]:
    """UTF-8 bytes shifted by 3, optionally after the bos id."""
    return ([BOS] if bos else []) + [b + OFFSET for b in text.encode("utf-8")]


def decode(ids) -> str:
    """Inverse of :func:`encode`; special ids are dropped, broken UTF-8 is replaced."""
    return bytes(int(i) - OFFSET for i in ids if int(i) >= OFFSET).decode("utf-8", errors="replace")


def load_corpus() -> str:
    """The concatenated ``*.txt`` files shipped in ``wiola/data`` (sorted by name)."""
    folder = resources.files("wiola") / "data"
    texts = [p.read_text(encoding="utf-8") for p in sorted(folder.iterdir(), key=lambda p: p.name)
             if p.name.endswith(".txt")]
    if not texts:
        raise FileNotFoundError(f"no *.txt corpus found in {folder}")
    return "\n\n".join(texts)


def corpus_tensor() -> Tensor:
    return torch.tensor(encode(load_corpus()), dtype=torch.long)


def get_batch(data: Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """``(batch_size, seq_len)`` random windows of ``data`` (the model shifts labels itself)."""
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)
    return torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine down to ``min_ratio·peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---- distributed ---------------------------------------------------------------------------

def dist_setup() -> tuple[int, int]:
    """``(rank, world_size)``; initialises the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def wrap_distributed(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """DDP, or FSDP2 ``fully_shard`` per block then the whole model."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if mode == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError as exc:  # torch < 2.6
            raise RuntimeError(f"--dist fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard): {exc}") from exc
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
        return model
    raise ValueError(f"--dist must be 'ddp' or 'fsdp', got {mode!r}")


def full_state_dict(model: torch.nn.Module, mode: str | None) -> dict[str, Tensor] | None:
    """A full (unsharded) state dict on CPU for saving; collective under FSDP."""
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return None


# ---- the training loop ---------------------------------------------------------------------

def build_model(config: WiolaConfig, seed: int) -> WiolaForCausalLM:
    torch.manual_seed(seed)
    return WiolaForCausalLM(config)


def train_steps(model: torch.nn.Module, config: WiolaConfig, batches, steps: int, lr: float = 1e-3,
                warmup: int = 10, weight_decay: float = 0.1, precision: str = "fp32", rank: int = 0,
                world: int = 1, progress: bool = False, on_step=None) -> list[float]:
    """Run ``steps`` AdamW steps on ``batches`` (an iterator of global ``(B, T)`` id batches).

    Each rank trains on rows ``rank::world`` of the global batch; the returned losses are
    the global-batch means (all-reduced across ranks). Backward runs inside the configured
    kernel backend, like the forward.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    device = next(model.parameters()).device
    use_bf16 = precision == "bf16"
    losses: list[float] = []
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="train", unit="step")
    model.train()
    for step in range(steps):
        batch = next(batches)
        local = batch[rank::world].to(device) if world > 1 else batch.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        t0 = time.perf_counter()
        # The forward applies config.kernel_backend; each op's backward follows its forward.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(local, labels=local, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().float()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
        if bar is not None:
            dt = time.perf_counter() - t0
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{batch.numel() / dt:,.0f}")
            bar.update(1)
        if on_step is not None:
            on_step(step, losses[-1])
    if bar is not None:
        bar.close()
    return losses


def batch_iterator(data: Tensor, batch_size: int, seq_len: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield get_batch(data, batch_size, seq_len, gen)


def default_precision(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"  # CPU: bf16 autocast is supported but the CPU kernels are fastest in fp32


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(prog="python -m wiola train", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="wiola-tiny", help="config preset (default wiola-tiny)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (split across ranks)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", help="kernel backend: auto | reference | cpu | cuda | triton")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    p.add_argument("--summary", choices=("causal", "paper"), default="causal", help="GCLA summary mode")
    p.add_argument("--no-atm", action="store_true", help="disable adaptive token merging")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--dist", choices=("ddp", "fsdp"), default="ddp", help="wrapper under torchrun")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="checkpoints/wiola-tiny", help="checkpoint folder")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--losses-json", default=None, help="write the loss curve here (rank 0)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    rank, world = dist_setup()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the world size {world}")
    device = torch.device(args.device if world == 1 or args.device == "cpu" else f"cuda:{rank}")
    precision = default_precision(device) if args.precision == "auto" else args.precision
    config = WiolaConfig.from_name(args.preset, kernel_backend=args.backend, gcla_summary=args.summary,
                                   atm_enabled=not args.no_atm)
    model = build_model(config, args.seed).to(device)
    if args.grad_ckpt:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    wrapped = wrap_distributed(model, args.dist) if world > 1 else model
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"wiola train: {args.preset} ({n / 1e6:.2f}M parameters), backend={args.backend}, "
              f"precision={precision}, world={world} ({args.dist if world > 1 else 'single process'}), "
              f"batch={args.batch_size}x{args.seq_len}", flush=True)
    data = corpus_tensor()
    batches = batch_iterator(data, args.batch_size, args.seq_len, args.seed)

    def save(step: int, losses: list[float]) -> None:
        state = full_state_dict(wrapped, args.dist if world > 1 else None)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            model.save_pretrained(args.out, state_dict=state)
            with open(os.path.join(args.out, "train_state.json"), "w") as f:
                json.dump({"step": step, "losses": losses, "args": vars(args)}, f)

    losses: list[float] = []

    def on_step(step: int, loss: float) -> None:
        losses.append(loss)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(step + 1, losses)

    start = time.perf_counter()
    train_steps(wrapped, config, batches, args.steps, lr=args.lr, warmup=args.warmup, precision=precision,
                rank=rank, world=world, progress=not args.no_progress, on_step=on_step)
    elapsed = time.perf_counter() - start
    save(args.steps, losses)
    if rank == 0:
        tokens = args.steps * args.batch_size * args.seq_len
        print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {tokens / elapsed:,.0f} tokens/s, "
              f"checkpoint in {args.out}", flush=True)
        if args.losses_json:
            with open(args.losses_json, "w") as f:
                json.dump(losses, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    return losses


def generate_main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m wiola generate", description="continue a prompt")
    p.add_argument("prompt")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default=None, help="override the checkpoint's kernel backend")
    args = p.parse_args(argv)
    model = WiolaForCausalLM.from_pretrained(args.checkpoint).eval()
    if args.backend is not None:
        model.config.kernel_backend = args.backend
    torch.manual_seed(args.seed)
    ids = torch.tensor([encode(args.prompt)])
    sample = args.temperature > 0
    kwargs = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k) if sample else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             eos_token_id=EOS, pad_token_id=PAD, **kwargs)
    text = decode(out[0, ids.shape[1]:].tolist())
    print(args.prompt + text)
    return text

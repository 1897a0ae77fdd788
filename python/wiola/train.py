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

from wiola_kernels._cli import (CommandError, HelpFormatter, non_negative_float, non_negative_int, positive_float,
                                positive_int)

from .configuration_wiola import KERNEL_BACKENDS, PRESETS, WiolaConfig
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
    kernel backend, like the forward. The progress bar's ``tok_s`` is the global tokens
    trained so far over the time since the first step began — the same average as the
    summary ``python -m wiola train`` prints at the end.
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
    start, tokens_done = time.perf_counter(), 0
    for step in range(steps):
        batch = next(batches)
        local = batch[rank::world].to(device) if world > 1 else batch.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
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
        tokens_done += batch.numel()
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_done / (time.perf_counter() - start):,.0f}")
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


def check_device(name: str) -> None:
    """``--device cuda`` needs a CUDA device that torch can use."""
    if name == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device cuda: torch reports no CUDA device here (torch {torch.__version__}); "
                           "use --device cpu")


def check_backend(backend: str, device: torch.device) -> None:
    """``--backend`` must be able to run on ``device``: refused up front with the reason,
    not after the model is built and the first step fails."""
    if backend in ("auto", "reference"):
        return
    from wiola_kernels import dispatch

    reason = dispatch.BACKENDS[backend].unavailable_reason(device)
    if reason is not None:
        raise CommandError(f"--backend {backend} cannot run on {device.type}: {reason} (use --backend auto)")


def main(argv: list[str] | None = None) -> list[float]:
    """``python -m wiola train``: returns the per-step losses."""
    p = argparse.ArgumentParser(prog="python -m wiola train", formatter_class=HelpFormatter,
                                description="Train a Wiola preset (default: the tiny one) on the English text "
                                            "shipped in wiola/data, and save a checkpoint.")
    p.add_argument("--preset", default="wiola-tiny", choices=sorted(PRESETS), help="model size")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=8, help="global batch (split across ranks)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per training row")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=non_negative_int, default=20, help="linear warm-up steps before the cosine decay")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    p.add_argument("--backend", default="auto", choices=KERNEL_BACKENDS, help="kernel backend of the ops")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 autocast on CUDA with bf16, else fp32")
    p.add_argument("--summary", choices=("causal", "paper"), default="causal", help="GCLA summary mode")
    p.add_argument("--no-atm", action="store_true", help="disable adaptive token merging")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--dist", choices=("ddp", "fsdp"), default="ddp", help="wrapper under torchrun")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device to train on (default: cuda if torch sees a GPU, else cpu)")
    p.add_argument("--out", default="checkpoints/wiola-tiny", help="checkpoint folder")
    p.add_argument("--save-every", type=non_negative_int, default=0,
                   help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--losses-json", default=None, metavar="FILE", help="write the loss curve here (rank 0)")
    p.add_argument("--threads", type=non_negative_int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(args.device)
    check_backend(args.backend, torch.device(args.device))
    config = WiolaConfig.from_name(args.preset, kernel_backend=args.backend, gcla_summary=args.summary,
                                   atm_enabled=not args.no_atm)
    if args.seq_len > config.max_position_embeddings:
        raise CommandError(f"--seq-len {args.seq_len} exceeds the preset's max_position_embeddings = "
                           f"{config.max_position_embeddings}")
    data = corpus_tensor()
    if args.seq_len >= data.numel():
        raise CommandError(f"--seq-len {args.seq_len} must be shorter than the corpus ({data.numel()} tokens)")
    if args.threads:
        torch.set_num_threads(args.threads)

    rank, world = dist_setup()
    if args.batch_size % world:
        raise CommandError(f"--batch-size {args.batch_size} must be divisible by the world size {world}")
    device = torch.device(args.device if world == 1 or args.device == "cpu" else f"cuda:{rank}")
    precision = default_precision(device) if args.precision == "auto" else args.precision
    model = build_model(config, args.seed).to(device)
    if args.grad_ckpt:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    wrapped = wrap_distributed(model, args.dist) if world > 1 else model
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"wiola train: {args.preset} ({n / 1e6:.2f}M parameters), backend={args.backend}, "
              f"precision={precision}, world={world} ({args.dist if world > 1 else 'single process'}), "
              f"batch={args.batch_size}x{args.seq_len}", flush=True)
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


class _PrintStreamer:
    """Prints generated tokens as they come (Hugging Face's streamer interface: ``put``
    receives the prompt first, then each new token; ``end`` once at the finish). Bytes
    go through an incremental UTF-8 decoder, so a character split across tokens prints whole."""

    def __init__(self, out=None):
        import codecs
        import sys

        self.out = out if out is not None else sys.stdout
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.prompt_seen = False

    def put(self, value: Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt, already printed
            self.prompt_seen = True
            return
        ids = [int(i) for i in value.reshape(-1).tolist() if int(i) >= OFFSET]
        self.out.write(self.decoder.decode(bytes(i - OFFSET for i in ids)))
        self.out.flush()

    def end(self) -> None:
        self.out.write(self.decoder.decode(b"", final=True) + "\n")
        self.out.flush()


def generate_main(argv: list[str] | None = None) -> str:
    """``python -m wiola generate``: prints the prompt, then the continuation as it is
    generated; returns the continuation."""
    p = argparse.ArgumentParser(prog="python -m wiola generate", formatter_class=HelpFormatter,
                                description="Continue a prompt with a trained checkpoint (byte-level tokens), "
                                            "printing tokens as they are generated.")
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="checkpoint folder (config.json + model.safetensors), e.g. from python -m wiola train --out")
    p.add_argument("--max-new-tokens", type=positive_int, default=200, help="tokens to generate at most")
    p.add_argument("--temperature", type=non_negative_float, default=0.8,
                   help="sampling temperature; 0 for greedy decoding")
    p.add_argument("--top-k", type=non_negative_int, default=40, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--backend", default=None, choices=KERNEL_BACKENDS,
                   help="kernel backend (default: the checkpoint's, or auto when that cannot run here)")
    p.add_argument("--no-stream", action="store_true", help="print the whole text at the end instead")
    args = p.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        raise CommandError(f"--checkpoint {args.checkpoint!r}: no such folder (looked in "
                           f"{os.path.abspath(args.checkpoint)}); train one with python -m wiola train --out DIR")
    if args.backend is not None:
        check_backend(args.backend, torch.device("cpu"))
    model = WiolaForCausalLM.from_pretrained(args.checkpoint).eval()
    if args.backend is not None:
        model.config.kernel_backend = args.backend
    torch.manual_seed(args.seed)
    ids = torch.tensor([encode(args.prompt)])
    limit = model.config.max_position_embeddings
    if ids.shape[1] + args.max_new_tokens > limit:
        raise CommandError(f"the prompt ({ids.shape[1]} tokens) + --max-new-tokens {args.max_new_tokens} exceed the "
                           f"model's max_position_embeddings = {limit}")
    sample = args.temperature > 0
    kwargs = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k) if sample else dict(do_sample=False)
    streamer = None
    if not args.no_stream:
        print(args.prompt, end="", flush=True)
        streamer = _PrintStreamer()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             eos_token_id=EOS, pad_token_id=PAD, streamer=streamer, **kwargs)
    text = decode(out[0, ids.shape[1]:].tolist())
    if args.no_stream:
        print(args.prompt + text)
    return text

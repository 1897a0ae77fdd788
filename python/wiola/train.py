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

from wiola_kernels.cli import (CommandError, HelpFormatter, non_negative_float, non_negative_int, positive_float,
                                positive_int)

from .checkpoint import load_training_state, save_training_state
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


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def train_steps(model: torch.nn.Module, config: WiolaConfig, batches, steps: int, lr: float = 1e-3,
                warmup: int = 10, weight_decay: float = 0.1, precision: str = "fp32", rank: int = 0,
                world: int = 1, progress: bool = False, on_step=None, optimizer: torch.optim.Optimizer | None = None,
                start: int = 0, stop: int | None = None) -> list[float]:
    """Run AdamW steps ``start … min(stop, steps) − 1`` of a ``steps``-step schedule on
    ``batches`` (an iterator of global ``(B, T)`` id batches).

    Each rank trains on rows ``rank::world`` of the global batch; the returned losses are
    the global-batch means (all-reduced across ranks). Backward runs inside the configured
    kernel backend, like the forward. ``optimizer`` (default: a fresh :func:`make_optimizer`)
    and ``start`` let a run resume from a checkpoint. The progress bar's ``tok_s`` is the
    global tokens trained in this call over the time since its first step began — the same
    average as the summary ``python -m wiola train`` prints at the end.
    """
    opt = optimizer if optimizer is not None else make_optimizer(model, lr, weight_decay)
    device = next(model.parameters()).device
    use_bf16 = precision == "bf16"
    losses: list[float] = []
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="train", unit="step")
        bar.update(start)
    model.train()
    t0, tokens_done = time.perf_counter(), 0
    for step in range(start, steps if stop is None else min(stop, steps)):
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
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_done / (time.perf_counter() - t0):,.0f}")
            bar.update(1)
        if on_step is not None:
            on_step(step, losses[-1])
    if bar is not None:
        bar.close()
    return losses


def batch_iterator(data: Tensor, batch_size: int, seq_len: int, seed: int | torch.Generator):
    """Endless random batches; ``seed`` may be the generator itself (its state is the data
    position a resumable checkpoint records)."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    while True:
        yield get_batch(data, batch_size, seq_len, gen)


#: Arguments a resumed run must share with the run it continues (they fix the data, the
#: model and the learning-rate schedule).
RESUME_MUST_MATCH = ("preset", "steps", "batch_size", "seq_len", "lr", "warmup", "seed", "summary", "no_atm",
                     "tokenizer_vocab")


def corpus_and_tokenizer(vocab: int, resume_dir: str | None = None):
    """``(ids, tokenizer)``: the bundled text as a 1-D id tensor, with a byte-level BPE of
    ``vocab`` ids trained on it (read back from ``resume_dir`` when resuming), or byte ids
    (``vocab`` 0, tokenizer None)."""
    if vocab == 0:
        return corpus_tensor(), None
    from .tokenizer import encode as tok_encode, has_tokenizer, train_bpe

    if resume_dir is not None and has_tokenizer(resume_dir):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resume_dir)
    else:
        tokenizer = train_bpe(load_corpus(), vocab)
    return torch.tensor(tok_encode(tokenizer, load_corpus()), dtype=torch.long), tokenizer


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
    p.add_argument("--tokenizer-vocab", type=non_negative_int, default=512,
                   help="train a byte-level BPE tokenizer of this many ids on the text and save it with the model "
                        "(0: byte ids, vocabulary 259)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run checkpointed in --out (model, optimizer, data position, RNG)")
    p.add_argument("--stop-after", type=non_negative_int, default=0,
                   help="stop after this many steps of the schedule, with a resumable checkpoint (0: run to --steps)")
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
    if args.tokenizer_vocab and args.tokenizer_vocab < 259:
        raise CommandError(f"--tokenizer-vocab must be 0 (byte ids) or at least 259, got {args.tokenizer_vocab}")

    rank, world = dist_setup()
    if args.batch_size % world:
        raise CommandError(f"--batch-size {args.batch_size} must be divisible by the world size {world}")
    device = torch.device(args.device if world == 1 or args.device == "cpu" else f"cuda:{rank}")
    precision = default_precision(device) if args.precision == "auto" else args.precision
    data, tokenizer = corpus_and_tokenizer(args.tokenizer_vocab, args.out if args.resume else None)
    if world > 1:  # every rank trains the tokenizer itself: make sure they agree on the data
        digests: list[object] = [None] * world
        dist.all_gather_object(digests, hash(tuple(data.tolist())))
        if len(set(digests)) != 1:
            raise RuntimeError("ranks tokenized the corpus differently; train with --tokenizer-vocab 0 (byte ids)")
    if args.seq_len >= data.numel():
        raise CommandError(f"--seq-len {args.seq_len} must be shorter than the tokenized corpus ({data.numel()} "
                           f"tokens); lower --seq-len or --tokenizer-vocab")
    vocab = {} if tokenizer is None else {"vocab_size": len(tokenizer)}
    config = WiolaConfig.from_name(args.preset, kernel_backend=args.backend, gcla_summary=args.summary,
                                   atm_enabled=not args.no_atm, **vocab)
    if args.resume:
        if not os.path.isfile(os.path.join(args.out, "train_state.json")):
            raise CommandError(f"--resume: {args.out!r} holds no resumable run (no train_state.json); "
                               f"start one with --out {args.out}")
        if world > 1 and args.dist == "fsdp":
            raise CommandError("--resume is supported in single-process and DDP runs (not --dist fsdp)")
        with open(os.path.join(args.out, "train_state.json")) as f:
            before = json.load(f).get("args", {})
        changed = [k for k in RESUME_MUST_MATCH if k in before and before[k] != vars(args)[k]]
        if changed:
            raise CommandError("--resume: " + ", ".join(f"--{k.replace('_', '-')} was {before[k]!r}, now "
                                                      f"{vars(args)[k]!r}" for k in changed))
        model = WiolaForCausalLM.from_pretrained(args.out)
        model.config.kernel_backend = args.backend
        model = model.to(device)
    else:
        model = build_model(config, args.seed).to(device)
    if args.grad_ckpt:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    wrapped = wrap_distributed(model, args.dist) if world > 1 else model
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"wiola train: {args.preset} ({n / 1e6:.2f}M parameters), backend={args.backend}, "
              f"precision={precision}, world={world} ({args.dist if world > 1 else 'single process'}), "
              f"batch={args.batch_size}x{args.seq_len}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    opt = make_optimizer(wrapped, args.lr)
    start, losses = 0, []
    if args.resume:
        meta = load_training_state(args.out, opt, gen)
        start, losses = int(meta["step"]), list(meta["losses"])
    batches = batch_iterator(data, args.batch_size, args.seq_len, gen)

    def save(step: int, losses: list[float]) -> None:
        state = full_state_dict(wrapped, args.dist if world > 1 else None)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            model.save_pretrained(args.out, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(args.out)
            save_training_state(args.out, step, losses, opt, gen, vars(args))

    def on_step(step: int, loss: float) -> None:
        losses.append(loss)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(step + 1, losses)

    stop = min(args.steps, args.stop_after) if args.stop_after else args.steps
    t_start = time.perf_counter()
    train_steps(wrapped, config, batches, args.steps, lr=args.lr, warmup=args.warmup, precision=precision,
                rank=rank, world=world, progress=not args.no_progress, on_step=on_step, optimizer=opt, start=start,
                stop=stop)
    elapsed = time.perf_counter() - t_start
    save(max(stop, start), losses)
    if rank == 0 and losses:
        tokens = max(stop - start, 1) * args.batch_size * args.seq_len
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
    receives the prompt first, then each new token; ``end`` once at the finish). The text
    generated so far is decoded whole each time and only its new part printed, so a
    character split across tokens (byte-level BPE, byte ids) prints once it is complete."""

    def __init__(self, out=None, tokenizer=None):
        import sys

        from .tokenizer import ByteTokenizer

        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.out = out if out is not None else sys.stdout
        self.ids: list[int] = []
        self.printed = 0
        self.prompt_seen = False

    def _flush(self, final: bool) -> None:
        from .tokenizer import decode

        text = decode(self.tokenizer, self.ids)
        if not final and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next token
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def put(self, value: Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt, already printed
            self.prompt_seen = True
            return
        self.ids += [int(i) for i in value.reshape(-1).tolist()]
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)
        self.out.write("\n")
        self.out.flush()


def generate_main(argv: list[str] | None = None) -> str:
    """``python -m wiola generate``: prints the prompt, then the continuation as it is
    generated; returns the continuation."""
    p = argparse.ArgumentParser(prog="python -m wiola generate", formatter_class=HelpFormatter,
                                description="Continue a prompt with a trained checkpoint, printing tokens as they "
                                            "are generated.")
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
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="Hugging Face tokenizer directory (default: the one saved with the checkpoint, else byte ids)")
    p.add_argument("--no-stream", action="store_true", help="print the whole text at the end instead")
    args = p.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        raise CommandError(f"--checkpoint {args.checkpoint!r}: no such folder (looked in "
                           f"{os.path.abspath(args.checkpoint)}); train one with python -m wiola train --out DIR")
    if args.backend is not None:
        check_backend(args.backend, torch.device("cpu"))
    from .tokenizer import decode as tok_decode, encode as tok_encode, load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, args.checkpoint)
    model = WiolaForCausalLM.from_pretrained(args.checkpoint).eval()
    if len(tokenizer) > model.config.vocab_size:
        raise CommandError(f"--tokenizer has {len(tokenizer)} ids but the model's vocabulary is "
                         f"{model.config.vocab_size}: they were not trained together")
    if args.backend is not None:
        model.config.kernel_backend = args.backend
    torch.manual_seed(args.seed)
    ids = torch.tensor([tok_encode(tokenizer, args.prompt)])
    limit = model.config.max_position_embeddings
    if ids.shape[1] + args.max_new_tokens > limit:
        raise CommandError(f"the prompt ({ids.shape[1]} tokens) + --max-new-tokens {args.max_new_tokens} exceed the "
                           f"model's max_position_embeddings = {limit}")
    sample = args.temperature > 0
    kwargs = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k) if sample else dict(do_sample=False)
    streamer = None
    if not args.no_stream:
        print(args.prompt, end="", flush=True)
        streamer = _PrintStreamer(tokenizer=tokenizer)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             streamer=streamer, **kwargs)
    text = tok_decode(tokenizer, out[0, ids.shape[1]:].tolist())
    if args.no_stream:
        print(args.prompt + text)
    return text

"""``python -m wiola eval --text FILE [--model DIR]``: perplexity with a sliding window.

    python -m wiola eval --text book.txt --model checkpoints/wiola-tiny
    python -m wiola eval --text book.txt --window 512 --stride 256 --tokenizer DIR

The text is tokenized (the checkpoint's own tokenizer, ``--tokenizer DIR``, or byte ids)
into one sequence starting with bos. The first window scores its first ``--window``
tokens; each later window moves ``--stride`` tokens on and scores just those, with the
``window − stride`` tokens before them as context, so every token after the first is
scored exactly once, with at least ``window − stride`` tokens of context (or all before it).
Perplexity is ``exp`` of the mean negative log-likelihood over the scored tokens.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, scored_from)`` for a sequence of ``n`` tokens: the window is
    ``ids[begin:end]`` (at most ``window`` tokens) and it scores the predictions of tokens
    ``scored_from … end − 1``: the first window all of its tokens after bos, each later one
    the next ``stride`` tokens, with the ``window − stride`` tokens before them as context."""
    if window < 2 or not 1 <= stride < window:
        raise ValueError(f"need window ≥ 2 and 1 ≤ stride < window, got window={window}, stride={stride}")
    out, prev_end = [], 1  # token 0 (bos) is never predicted
    end = min(window, n)
    while prev_end < n:
        out.append((max(0, end - window), end, prev_end))
        prev_end, end = end, min(end + stride, n)
    return out


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int, stride: int, progress: bool = False) -> dict:
    """Sliding-window perplexity of the 1-D ``ids`` under ``model``; returns ``{"perplexity",
    "nll", "tokens", "windows"}`` (``nll``: mean negative log-likelihood in nats)."""
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(f"ids must be a 1-D sequence of at least 2 tokens, got shape {tuple(ids.shape)}")
    spans = windows(ids.numel(), window, stride)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=ids.numel() - 1, desc="eval", unit="tok")
    for begin, end, scored_from in spans:
        chunk = ids[begin:end].to(device)[None]
        logits = model(chunk, use_cache=False).logits[0, :-1].float()  # predicts chunk[1:]
        targets = chunk[0, 1:]
        keep = slice(scored_from - begin - 1, None)  # predictions of tokens scored_from … end − 1
        nll = F.cross_entropy(logits[keep], targets[keep], reduction="sum")
        total += float(nll)
        count += end - scored_from
        if bar is not None:
            bar.set_postfix(ppl=f"{math.exp(total / count):.3f}")
            bar.update(end - scored_from)
    if bar is not None:
        bar.close()
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count, "windows": len(spans)}


def main(argv: list[str] | None = None) -> dict:
    """Command line: print the perplexity of ``--text`` under ``--model``."""
    p = argparse.ArgumentParser(prog="python -m wiola eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--model", default="checkpoints/wiola-tiny", help="checkpoint directory")
    p.add_argument("--tokenizer", default=None,
                   help="Hugging Face tokenizer directory (default: the checkpoint's own, else byte ids)")
    p.add_argument("--window", type=int, default=0, help="tokens per window (default: max_position_embeddings)")
    p.add_argument("--stride", type=int, default=0,
                   help="new tokens scored per window, < window (default: window / 2)")
    p.add_argument("--backend", default=None, help="override the checkpoint's kernel backend")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .modeling_wiola import WiolaForCausalLM
    from .tokenizer import encode, load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer, args.model)
    model = WiolaForCausalLM.from_pretrained(args.model).eval()
    if args.backend is not None:
        model.config.kernel_backend = args.backend
    if len(tokenizer) > model.config.vocab_size:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} ids but the model's vocabulary is "
                         f"{model.config.vocab_size}: they were not trained together")
    with open(args.text, encoding="utf-8") as f:
        ids = torch.tensor(encode(tokenizer, f.read()), dtype=torch.long)
    window = args.window or model.config.max_position_embeddings
    stride = args.stride or max(1, window // 2)
    result = perplexity(model, ids, window, stride, progress=not args.no_progress)
    print(f"perplexity {result['perplexity']:.4f} (mean NLL {result['nll']:.4f} nats) over {result['tokens']:,} "
          f"tokens, {result['windows']} windows of ≤ {window} tokens every {stride}", flush=True)
    return result


__all__ = ["main", "perplexity", "windows"]

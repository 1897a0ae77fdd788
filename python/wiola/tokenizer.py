"""Text in, text out: a byte-level BPE tokenizer for the demo, and the byte-id fallback.

The demo trains a small byte-level BPE tokenizer with the ``tokenizers`` library on the
bundled text (:func:`train_bpe`) and saves it next to the model, where Hugging Face's
``AutoTokenizer.from_pretrained(DIR)`` reads it back. Any Hugging Face tokenizer works the
same way (:func:`load_tokenizer`). Special ids match :class:`~wiola.WiolaConfig`'s defaults:
``<pad>`` 0, ``<s>`` (bos) 1, ``</s>`` (eos) 2; every encoding starts with ``<s>``; padding
is on the left, as generation needs.

Without a tokenizer, :class:`ByteTokenizer` is the old path: id = UTF-8 byte + 3.
"""

from __future__ import annotations

import os

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
BYTE_OFFSET = 3  # byte b has id b + 3 in the byte-level fallback


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 after the bos id 1 (pad 0, eos 2); 259 ids."""

    vocab_size = 256 + BYTE_OFFSET
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        """``[bos] + [byte + 3 …]``."""
        return [self.bos_token_id] + [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        """Inverse of :meth:`encode`; special ids dropped, broken UTF-8 replaced."""
        return bytes(int(i) - BYTE_OFFSET for i in ids if int(i) >= BYTE_OFFSET).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


def train_bpe(text: str, vocab_size: int = 512, min_frequency: int = 2):
    """A byte-level BPE tokenizer trained on ``text``, as a Hugging Face fast tokenizer.

    ``vocab_size`` counts the 3 special tokens and the 256 byte symbols, so it must be at
    least 259. ``save_pretrained(DIR)`` writes it; ``AutoTokenizer.from_pretrained(DIR)``
    reads it back.
    """
    if not isinstance(vocab_size, int) or vocab_size < 259:
        raise ValueError(f"vocab_size must be an int ≥ 259 (3 special tokens + 256 bytes), got {vocab_size!r}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[PAD, BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   padding_side="left", clean_up_tokenization_spaces=False)


def has_tokenizer(directory: str) -> bool:
    """Whether ``directory`` holds a saved Hugging Face tokenizer."""
    return os.path.isfile(os.path.join(directory, "tokenizer.json")) or \
        os.path.isfile(os.path.join(directory, "tokenizer_config.json"))


def load_tokenizer(directory: str | None, fallback_dir: str | None = None):
    """``AutoTokenizer.from_pretrained(directory)``; without ``directory``, the tokenizer saved
    in ``fallback_dir`` (a checkpoint) when there is one, else :class:`ByteTokenizer`."""
    from transformers import AutoTokenizer

    if directory is not None:
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"--tokenizer {directory}: no such directory")
        return AutoTokenizer.from_pretrained(directory)
    if fallback_dir is not None and os.path.isdir(fallback_dir) and has_tokenizer(fallback_dir):
        return AutoTokenizer.from_pretrained(fallback_dir)
    return ByteTokenizer()


def encode(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` starting with bos, for either kind of tokenizer."""
    ids = list(tokenizer.encode(text))
    bos = tokenizer.bos_token_id
    return ids if bos is None or (ids and ids[0] == bos) else [bos] + ids


def decode(tokenizer, ids) -> str:
    """Text of ``ids`` without special tokens, for either kind of tokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids)
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


__all__ = ["ByteTokenizer", "decode", "encode", "has_tokenizer", "load_tokenizer", "train_bpe"]

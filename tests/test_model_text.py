"""Text in, text out: the BPE tokenizer saved with the model, generate and
eval reading it back, sliding-window perplexity, resumable training."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoTokenizer

from wiola_kernels.cli import CommandError

from wiola.evaluate import main as eval_main
from wiola.evaluate import perplexity, windows
from wiola.tokenizer import ByteTokenizer, decode, encode, train_bpe
from wiola.train import generate_main, load_corpus
from wiola.train import main as train_main


pytestmark = pytest.mark.usefixtures("one_thread")  # small shapes: threads only add overhead


def test_bpe_tokenizer_trained_on_the_bundled_text_round_trips(tmp_path):
    text = load_corpus()
    tok = train_bpe(text, 400)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    assert len(back) == 400
    assert (back.pad_token_id, back.bos_token_id, back.eos_token_id) == (0, 1, 2)  # WiolaConfig's ids
    assert back.padding_side == "left"
    sample = "The keeper climbed — ünïcode,  two spaces\nand a line."
    ids = encode(back, sample)
    assert ids[0] == 1 and decode(back, ids) == sample
    corpus_ids = encode(back, text)
    assert len(corpus_ids) < 0.6 * len(text.encode("utf-8"))  # merges learnt: fewer ids than bytes
    batch = back(["a b c d", "a"], padding=True, return_tensors="pt")
    assert batch["attention_mask"].tolist()[1][:3] == [0, 0, 0]  # left padding for generation


def test_bpe_vocab_must_hold_the_bytes():
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe("abc", 100)


def test_byte_tokenizer_is_the_old_encoding():
    tok = ByteTokenizer()
    assert encode(tok, "hé") == [1, ord("h") + 3, 0xC3 + 3, 0xA9 + 3] and decode(tok, encode(tok, "hé")) == "hé"


@pytest.mark.parametrize("n, window, stride", [(10, 4, 3), (10, 4, 1), (11, 5, 2), (3, 8, 4), (9, 2, 1)])
def test_windows_score_every_token_once_with_bounded_context(n, window, stride):
    scored = []
    for begin, end, first in windows(n, window, stride):
        assert 0 <= begin < first < end <= n and end - begin <= window
        assert first - begin >= min(window - stride, first)  # context before the first scored token
        scored += range(first, end)
    assert scored == list(range(1, n))
    with pytest.raises(ValueError, match="stride"):
        windows(n, window, window)


class Bigram(torch.nn.Module):
    """A model whose next-token logits depend only on the current token: each token's NLL is
    then the same whatever the window, so the perplexity has a closed form."""

    def __init__(self, vocab: int, seed: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)))
        self.seen: list[int] = []

    def forward(self, ids, use_cache=False):
        self.seen.append(ids.shape[1])
        return type("Out", (), {"logits": self.table[ids]})()


@pytest.mark.parametrize("window, stride", [(64, 32), (16, 5), (7, 6), (8, 1)])
def test_perplexity_of_a_bigram_model_has_its_closed_form(window, stride):
    ids = torch.randint(0, 11, (50,), generator=torch.Generator().manual_seed(3))
    model = Bigram(11, seed=4)
    got = perplexity(model, ids, window, stride)
    logp = torch.log_softmax(model.table.detach().double(), -1)
    want = math.exp(-float(logp[ids[:-1], ids[1:]].mean()))
    assert got["tokens"] == 49 and abs(got["perplexity"] - want) <= 1e-5 * want
    assert max(model.seen) <= window


def test_train_with_bpe_then_generate_and_eval_read_its_tokenizer(tmp_path, capsys):
    out = tmp_path / "ckpt"
    train_main(["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--out", str(out), "--no-progress",
                "--tokenizer-vocab", "300"])
    assert (out / "tokenizer.json").exists() and json.load(open(out / "config.json"))["vocab_size"] == 300
    text = generate_main(["--checkpoint", str(out), "--max-new-tokens", "5", "--temperature", "0", "Hi"])
    assert "Hi" + text in capsys.readouterr().out
    sample = tmp_path / "sample.txt"
    sample.write_text("The lighthouse keeper kept the light.", encoding="utf-8")
    result = eval_main(["--text", str(sample), "--model", str(out), "--window", "8", "--stride", "3",
                        "--no-progress"])
    assert "perplexity" in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(out)
    assert result["tokens"] == len(encode(tok, sample.read_text())) - 1
    assert 1.0 < result["perplexity"] < 10 * 300  # an untrained model: about uniform over 300 ids


def test_resume_reaches_the_same_losses_as_an_uninterrupted_run(tmp_path):
    common = ["--steps", "5", "--batch-size", "2", "--seq-len", "16", "--no-progress", "--tokenizer-vocab", "300",
              "--warmup", "2"]
    whole = train_main(common + ["--out", str(tmp_path / "a")])
    first = train_main(common + ["--out", str(tmp_path / "b"), "--stop-after", "2"])
    assert first == whole[:2]
    state = json.load(open(tmp_path / "b" / "train_state.json"))
    assert state["step"] == 2 and (tmp_path / "b" / "optimizer.safetensors").exists()
    resumed = train_main(common + ["--out", str(tmp_path / "b"), "--resume"])
    assert len(resumed) == 5
    for step, (a, b) in enumerate(zip(whole, resumed)):
        assert abs(a - b) <= 1e-6 * abs(a), (step, a, b)
    with pytest.raises(CommandError, match="--seq-len was 16, now 32"):
        train_main(["--steps", "5", "--batch-size", "2", "--seq-len", "32", "--no-progress", "--tokenizer-vocab",
                    "300", "--warmup", "2", "--out", str(tmp_path / "b"), "--resume"])

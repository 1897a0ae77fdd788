"""llama.cpp as a contender in ``python -m wiola bench --decode``: the same Llama it already
times through Hugging Face, written as a GGUF file and decoded by llama.cpp's ``llama-bench``.

Issue 24's target is tokens/s × parameters ahead of llama.cpp at equal precision on the same
machine; this module makes that one reproducible command instead of a hand-made model file:

* :func:`write_gguf` writes ``llama_like(config)`` (a ``LlamaForCausalLM``, tied embeddings)
  as llama.cpp's own converter (``convert_hf_to_gguf.py``) would: architecture ``llama``,
  matrices in the run's precision (F32, F16 or BF16), norms in F32, Q and K rows permuted to
  llama.cpp's rotary layout, and a SentencePiece vocabulary of the special and byte tokens
  and numbered fillers (the benchmark feeds token ids, never text). The ``gguf`` package
  (the ggml project's reader and writer) is imported only here, when a file is written.
* :func:`run_llama_bench` runs ``llama-bench`` on that file — decoding after a filled context,
  as our benchmark decodes after its prompt — and returns its tokens/s and what it says about
  the model and the build.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import torch

#: The GGUF names of a Llama block's weights, by their Hugging Face module.
BLOCK_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
#: <unk>, <s>, </s> and the 256 byte tokens: the least a SentencePiece vocabulary holds.
MIN_VOCAB = 3 + 256
#: What a llama-bench JSON record must hold (its own names).
BENCH_KEYS = ("avg_ts", "samples_ts", "model_n_params", "model_size", "build_commit", "type_k")


def _gguf():
    """The ``gguf`` package, or an ImportError that says how to get it."""
    try:
        import gguf
    except ImportError:
        raise ImportError("the llama.cpp comparison writes its model with the gguf package, which is not "
                          "installed: pip install gguf (it is in requirements.txt)") from None
    return gguf


def rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``w`` (a Q or K projection, ``n_head`` heads of rows) with each head's rows in llama.cpp's
    rotary order. Hugging Face rotates the pair (i, i + d_h/2) of a head (``rotate_half``),
    llama.cpp's ``llama`` rope the pair (2i, 2i + 1); ``convert_hf_to_gguf.py`` interleaves the
    two halves of every head's rows, and so does this."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).transpose(1, 2).reshape(rows, cols)


def filler_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """``(tokens, scores, types)`` of a SentencePiece vocabulary of ``size`` tokens: ``<unk>``,
    ``<s>``, ``</s>``, the byte tokens ``<0x00>``..``<0xFF>``, then ``▁tok{i}`` with score ``-i``.
    llama.cpp wants the special and byte tokens to exist; the rest only fills the size."""
    if size < MIN_VOCAB:
        raise ValueError(f"a SentencePiece vocabulary holds at least {MIN_VOCAB} tokens (3 special, 256 bytes), "
                         f"the model has {size}")
    gguf = _gguf()
    kind = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [kind.UNKNOWN, kind.CONTROL, kind.CONTROL] + [kind.BYTE] * 256
    fill = size - len(tokens)
    tokens += [f"\u2581tok{i}" for i in range(fill)]
    scores = [0.0] * MIN_VOCAB + [-float(i) for i in range(fill)]
    types += [kind.NORMAL] * fill
    return tokens, scores, [int(t) for t in types]


def write_gguf(model, path, dtype: torch.dtype) -> None:
    """Write ``model`` (the ``LlamaForCausalLM`` of :func:`wiola.bench.decode.llama_like`) to
    ``path`` as a GGUF file llama.cpp runs, its matrices in ``dtype`` (float32, float16 or
    bfloat16; norms stay F32, as llama.cpp's converter keeps them). The values are the
    model's, rounded to ``dtype`` as torch rounds; the tied output head is not written
    (llama.cpp then reads ``token_embd`` as the head, as the model does)."""
    gguf = _gguf()
    types = {torch.float32: (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
             torch.float16: (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
             torch.bfloat16: (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16)}
    if dtype not in types:
        raise ValueError(f"write_gguf writes float32, float16 or bfloat16, not {dtype}")
    c = model.config
    if not c.tie_word_embeddings:
        raise ValueError("write_gguf writes llama_like's model, whose output head is the tied embedding")
    matrix_type, file_type = types[dtype]
    tokens, scores, token_types = filler_vocab(c.vocab_size)

    state = model.state_dict()
    named = {"token_embd.weight": state.pop("model.embed_tokens.weight"),
             "output_norm.weight": state.pop("model.norm.weight")}
    state.pop("lm_head.weight", None)  # the tied embedding itself
    for i in range(c.num_hidden_layers):
        for hf, name in BLOCK_TENSORS.items():
            w = state.pop(f"model.layers.{i}.{hf}.weight")
            # Permuted as llama.cpp's converter does, so that the file is the same model, not only
            # one of the same shape: llama.cpp then decodes what the Hugging Face Llama decodes.
            if name == "attn_q":
                w = rotary_rows(w, c.num_attention_heads)
            elif name == "attn_k":
                w = rotary_rows(w, c.num_key_value_heads)
            named[f"blk.{i}.{name}.weight"] = w
    if state:  # biases, an untied head: nothing llama.cpp's llama architecture would read
        raise ValueError(f"write_gguf cannot place {sorted(state)}")

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("llama_like (python -m wiola bench --decode)")
    writer.add_file_type(file_type)
    writer.add_vocab_size(c.vocab_size)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    for name, w in named.items():
        a = w.detach().float().numpy()
        if a.ndim == 1 or matrix_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, a)
        elif matrix_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, a.astype("float16"))  # round to nearest even, as torch's .half()
        else:  # numpy has no bfloat16: gguf rounds to nearest even (as torch) and stores the raw 16 bits
            writer.add_tensor(name, gguf.quants.quantize(a, matrix_type), raw_dtype=matrix_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def find_llama_bench(binary: str) -> str:
    """The path of ``binary`` (a path, or a name on ``PATH``), or a ValueError that names
    ``--llama-cpp`` when there is no such executable."""
    found = shutil.which(str(binary))
    if found is None:
        raise ValueError(f"--llama-cpp {binary}: no such executable (the path to llama.cpp's llama-bench)")
    return found


def run_llama_bench(binary: str, gguf_path, threads: int, prompt: int, new_tokens: int, repeats: int = 1) -> dict:
    """Decode ``new_tokens`` tokens with llama.cpp's ``llama-bench`` (``binary``) on ``gguf_path``
    after a context of ``prompt`` tokens (``-d``; no prompt test, ``-p 0``), ``threads`` threads,
    ``repeats`` runs. Returns ``tokens_per_s`` (llama-bench's mean, ``avg_ts``; wall clock) and,
    under llama-bench's names, ``samples_ts`` (each run's), ``model_n_params``, ``model_size``
    (bytes), ``build_commit`` and ``type_k`` (the KV cache's type)."""
    cmd = [find_llama_bench(binary), "-m", str(gguf_path), "-t", str(threads), "-p", "0", "-n", str(new_tokens),
           "-d", str(prompt), "-r", str(repeats), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-10:])
        raise RuntimeError(f"{' '.join(cmd)} exited with status {done.returncode}:\n{tail}")
    try:
        records = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"llama-bench's output is not JSON ({exc}): {done.stdout[:200]!r}") from None
    # -p 0 with one -n and one -d is one test: one record
    if not (isinstance(records, list) and len(records) == 1 and isinstance(records[0], dict)):
        raise RuntimeError(f"expected llama-bench to report one test, got {done.stdout[:200]!r}")
    missing = [k for k in BENCH_KEYS if k not in records[0]]
    if missing:
        raise RuntimeError(f"llama-bench's JSON record lacks {missing}: {done.stdout[:200]!r}")
    r = records[0]
    return {"tokens_per_s": float(r["avg_ts"]), **{k: r[k] for k in BENCH_KEYS if k != "avg_ts"}}


__all__ = ["find_llama_bench", "rotary_rows", "run_llama_bench", "filler_vocab", "write_gguf"]

"""Small Hugging Face models of every family patch_hf supports, and training batches, shared by the
``patch_hf`` tests (tests/test_hf*.py). The models are built from the families' own
config classes (the sizes of Hugging Face's model-tester configs: a few layers, d 64),
seeded, with non-trivial RMSNorm weights; nothing is downloaded."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")

FAMILIES = ["llama", "mistral", "qwen2"]
# The families added after the first three (tests/test_hf_families.py), by model_type.
NEW_FAMILIES = ["qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3"]
VOCAB = 101
CONFIGS = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig,
           "phi3": transformers.Phi3Config, "olmo2": transformers.Olmo2Config,
           "smollm3": transformers.SmolLM3Config}
CAUSAL_LM = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
             "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
             "gemma2": transformers.Gemma2ForCausalLM, "gemma3_text": transformers.Gemma3ForCausalLM,
             "phi3": transformers.Phi3ForCausalLM, "olmo2": transformers.Olmo2ForCausalLM,
             "smollm3": transformers.SmolLM3ForCausalLM}
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# What each new family needs to be small and to exercise its own conventions: Gemma's head
# size is set (its default is 256), its sliding window shorter than the batches (so the two
# layer types differ), its final-logit soft-cap small enough to bend these small logits;
# Gemma 3 has one sliding and one full layer with their own θ₀; SmolLM3's second layer has
# no RoPE.
FAMILY_OVERRIDES = {
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=0.25,
                   attn_logit_softcapping=5.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=0.5,
                        layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                        hidden_activation="gelu_pytorch_tanh"),
    "smollm3": dict(no_rope_layers=[1, 0]),
}


def config(family: str, attn: str = "eager", **overrides):
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
              rope_parameters=dict(_DEFAULT_ROPE), tie_word_embeddings=False, pad_token_id=0)
    if family in NEW_FAMILIES:  # their default special tokens lie outside this vocabulary (HF warns)
        kw.update(bos_token_id=1, eos_token_id=2)
    kw.update(FAMILY_OVERRIDES.get(family, {}))
    kw.update(overrides)
    cfg = CONFIGS[family](**kw)
    cfg._attn_implementation = attn
    return cfg


def randomise_norms(model, seed: int) -> None:
    """HF initialises RMSNorm weights to 1, which would hide a wrong γ: draw them in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def model(family: str, seed: int = 0, cls=None, attn: str = "eager", **overrides):
    """A seeded random ``<Family>ForCausalLM`` (or ``cls``) in eval mode, with HF's ``attn``
    attention implementation."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        m = (cls or CAUSAL_LM[family])(config(family, attn, **overrides))
    randomise_norms(m, seed + 1)
    return m.eval()


def ids(batch: int = 2, length: int = 9, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def training_batch(case: str, seed: int = 3) -> dict:
    """Forward keyword arguments of one training batch (B 3, T 10) for ``case``:

    * ``plain``: labels = input ids;
    * ``ignore_index``: a third of the labels are -100 (HF's ignore index);
    * ``num_items_in_batch``: as ``ignore_index``, with the token count of a larger
      (gradient-accumulated) batch, so the loss is a sum divided by it;
    * ``right_padding``: rows of lengths 10, 7, 4 padded on the right, attention_mask
      zero and labels -100 on the padding;
    * ``left_padding``: the same padded on the left, with per-row ``position_ids``
      (``cumsum(mask) − 1``, as ``generate`` makes them), so rows see different positions.
      Run it with SDPA attention (``ATTENTION[case]``): a padding query attends to no key,
      and HF's eager attention in float64 (the oracle) turns that row into NaN (its float32
      softmax makes float64's mask value −inf), which then spreads through the zero weights.
    """
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 10
    input_ids = torch.randint(1, VOCAB, (b, t), generator=g)
    labels = input_ids.clone()
    kw = {}
    if case in ("ignore_index", "num_items_in_batch"):
        labels[torch.rand(b, t, generator=g) < 1 / 3] = -100
        if case == "num_items_in_batch":
            kw["num_items_in_batch"] = torch.tensor(int((labels[:, 1:] != -100).sum()) * 2 + 3)
    elif case in ("right_padding", "left_padding"):
        lengths = torch.tensor([10, 7, 4])
        cols = torch.arange(t)
        mask = cols[None, :] < lengths[:, None] if case == "right_padding" \
            else cols[None, :] >= (t - lengths)[:, None]
        mask = mask.long()
        input_ids = input_ids.masked_fill(mask == 0, 0)
        labels = input_ids.masked_fill(mask == 0, -100)
        kw["attention_mask"] = mask
        if case == "left_padding":
            kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    elif case != "plain":
        raise ValueError(case)
    return dict(input_ids=input_ids, labels=labels, **kw)


TRAINING_CASES = ["plain", "ignore_index", "num_items_in_batch", "right_padding", "left_padding"]
ATTENTION = {case: "sdpa" if case == "left_padding" else "eager" for case in TRAINING_CASES}


def loss_and_grads(m, **batch):
    """``(loss, logits, {name: grad})`` of one forward + backward (logits None: a patched model
    in training mode computed the loss without them)."""
    m.zero_grad(set_to_none=True)
    out = m(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    return out.loss.detach(), None if out.logits is None else out.logits.detach(), grads


def recording_backend():
    """``(backend, graphs)``: a ``torch.compile`` backend (``aot_eager``) that appends to
    ``graphs`` the set of ops of each graph it compiles, its autograd bodies included."""
    graphs: list[set[str]] = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append({str(node.target) for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
                       for node in sub.graph.nodes if node.op == "call_function"})
        return aot_eager(gm, example_inputs)

    return backend, graphs


#: The fused ops a patched model's training step runs (patch_hf swaps all four).
FUSED_STEP_OPS = {"wiola.srpe.default", "wiola.rms_norm.default", "wiola.glu.default",
                  "wiola.linear_cross_entropy.default"}


def assert_compiled_step_matches_eager(m, batch: dict) -> None:
    """``torch.compile(m, fullgraph=True)``'s training step on ``batch`` is one graph that runs
    the fused ops, and its loss and gradients match the eager patched model's."""
    from wiola_kernels.testing import rel_err

    torch._dynamo.reset()
    want = loss_and_grads(m, **batch)
    backend, graphs = recording_backend()
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    loss, logits, grads = loss_and_grads(compiled, **batch)
    assert len(graphs) == 1 and FUSED_STEP_OPS <= graphs[0]  # fused, one graph
    assert rel_err(loss, want[0]) <= 1e-6 and logits is None and want[1] is None
    grads = {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
    assert grads.keys() == want[2].keys()
    for name, grad in grads.items():
        assert rel_err(grad, want[2][name]) <= 1e-5, name
    del compiled
    torch._dynamo.reset()


def model_tester_case(family: str, seed: int = 0):
    """The model and inputs of Hugging Face's own ``<Family>ModelTester`` (its test suite's
    tiny config: d 32, 4 heads of 8, no GQA, MLP width 37, vocabulary 99, batch 13 × 7
    tokens, the lower-triangular ``attention_mask`` it draws, token labels), seeded."""
    g = torch.Generator().manual_seed(seed)
    cfg = CONFIGS[family](vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, intermediate_size=37, max_position_embeddings=512,
                          initializer_range=0.02, pad_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        m = CAUSAL_LM[family](cfg)
    randomise_norms(m, seed + 1)
    input_ids = torch.randint(0, 99, (13, 7), generator=g)
    batch = dict(input_ids=input_ids, attention_mask=torch.tril(torch.ones(13, 7, dtype=torch.long)),
                 labels=torch.randint(0, 99, (13, 7), generator=g))
    return m.eval(), batch


def module_ids(m):
    return [(name, id(sub)) for name, sub in m.named_modules()]

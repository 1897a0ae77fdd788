"""wiola-kernels' own model tester for transformers' ``ModelTesterMixin`` (hf_suite.py --from-release).

transformers' per-family test files (``tests/models/<family>/test_modeling_<family>.py``)
are not in its source archive; its common mixin (``tests/test_modeling_common.py``) is. The
family test modules hf_suite.py writes combine that mixin, exactly as released, with this
tester: a small model of the family (``bench --hf``'s small config: d 64, 2 layers,
vocabulary 256) and random inputs, in the form the mixin calls
(``prepare_config_and_inputs_for_common`` and a few sizes).
"""

from __future__ import annotations

import importlib

import torch


def model_classes(model_type: str) -> tuple:
    """The family's base model and causal-LM classes, the two every family has."""
    from wiola_kernels.hf import _FAMILIES, _modeling_name

    modeling = importlib.import_module(_modeling_name(model_type))
    prefix = _FAMILIES[model_type].prefix
    base = getattr(modeling, f"{prefix}TextModel", None) if model_type == "gemma3_text" else None
    return (base or getattr(modeling, f"{prefix}Model"), getattr(modeling, f"{prefix}ForCausalLM"))


class FamilyTester:
    """What ``ModelTesterMixin`` reads from ``self.model_tester``."""

    batch_size = 2
    seq_length = 8
    is_training = True

    def __init__(self, parent, model_type: str):
        self.parent, self.model_type = parent, model_type
        config = self.get_config()
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.num_hidden_layers = config.num_hidden_layers
        self.num_attention_heads = config.num_attention_heads

    def get_config(self):
        from wiola_kernels.bench.hf import hf_case

        config = hf_case(self.model_type, "cpu", small=True).config()
        config.pad_token_id = 0
        config._attn_implementation = "eager"  # the mixin's attention-output tests need it
        return config

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = torch.randint(1, self.vocab_size, (self.batch_size, self.seq_length))
        attention_mask = torch.ones(self.batch_size, self.seq_length, dtype=torch.long)
        # one right-padded row (a training batch's; left padding would leave fully masked query
        # rows, where eager and SDPA attention — a reloaded model's default — give different values)
        attention_mask[0, -2:] = 0
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}

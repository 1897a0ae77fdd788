"""Resumable training checkpoints without pickle (SECURITY.md: nothing here unpickles).

A checkpoint folder holds the model (``model.safetensors`` + ``config.json``, read back by
the strict ``from_pretrained``), the tokenizer when there is one, and:

* ``optimizer.safetensors`` — every tensor of the optimizer state (AdamW's ``step``,
  ``exp_avg``, ``exp_avg_sq`` per parameter), the data stream's generator state
  (``rng.batches``: where in the data the run is) and torch's global RNG state
  (``rng.torch``);
* ``train_state.json`` — the step reached, the losses so far, the optimizer's parameter
  groups (hyper-parameters) and the command-line arguments.

The learning-rate schedule is a pure function of the step (``train.lr_at``), so the step
restores it.
"""

from __future__ import annotations

import json
import os

import torch

STATE_FILE = "train_state.json"
TENSOR_FILE = "optimizer.safetensors"


def save_training_state(folder: str, step: int, losses: list[float], optimizer: torch.optim.Optimizer,
                        batch_generator: torch.Generator, args: dict) -> None:
    """Write ``optimizer.safetensors`` and ``train_state.json`` into ``folder`` (which exists)."""
    from safetensors.torch import save_file

    sd = optimizer.state_dict()
    tensors = {f"state.{idx}.{key}": value.detach().cpu().contiguous()
               for idx, entry in sd["state"].items() for key, value in entry.items() if torch.is_tensor(value)}
    tensors["rng.batches"] = batch_generator.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, os.path.join(folder, TENSOR_FILE))
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    with open(os.path.join(folder, STATE_FILE), "w") as f:
        json.dump({"step": step, "losses": losses, "param_groups": groups, "args": args}, f)


def load_training_state(folder: str, optimizer: torch.optim.Optimizer, batch_generator: torch.Generator) -> dict:
    """Restore the optimizer, the data position and torch's RNG from ``folder``; returns the
    JSON state (``step``, ``losses``, ``args``). ``FileNotFoundError`` when the folder holds
    no resumable checkpoint."""
    from safetensors.torch import load_file

    state_path, tensor_path = os.path.join(folder, STATE_FILE), os.path.join(folder, TENSOR_FILE)
    for path in (state_path, tensor_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--resume: {folder} holds no resumable checkpoint ({os.path.basename(path)} "
                                    "missing; checkpoints written by `python -m wiola train` have it)")
    with open(state_path) as f:
        meta = json.load(f)
    tensors = load_file(tensor_path)
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("state."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = value
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    state = {i: {k: (v if k == "step" else v.to(device)) for k, v in entry.items()} for i, entry in state.items()}
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    batch_generator.set_state(tensors["rng.batches"])
    torch.set_rng_state(tensors["rng.torch"])
    return meta


__all__ = ["load_training_state", "save_training_state"]

"""Distributed training of the Wiola model on CPU (gloo): 2 ranks with DDP and with FSDP2
``fully_shard`` keep identical parameters and reproduce a single-process run on the same
global batch (python/wiola/train.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port, fsdp2_available

STEPS, BATCH, SEQ = 4, 4, 32


def _config():
    from wiola import WiolaConfig

    return WiolaConfig.from_name("wiola-tiny", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, dsff_narrow_size=64, dsff_wide_size=128)


def _run(rank: int, world: int, mode: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    from wiola.train import batch_iterator, build_model, corpus_tensor, train_steps, wrap_distributed

    config = _config()
    model = build_model(config, seed=0)
    wrapped = wrap_distributed(model, mode) if mode else model
    batches = batch_iterator(corpus_tensor(), BATCH, SEQ, seed=0)
    losses = train_steps(wrapped, config, batches, STEPS, lr=3e-3, warmup=2, rank=rank, world=world)
    # Every rank gathers the full parameters (FSDP2 holds DTensor shards).
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return losses, {k: v.detach().clone() for k, v in state.items()}


def _worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        losses, state = _run(rank, world, mode)
        torch.save({"losses": losses, "state": state}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", pytest.param("fsdp", marks=pytest.mark.skipif(
    not fsdp2_available(), reason="FSDP2 fully_shard needs torch >= 2.6"))])
def test_two_ranks_match_one_process(mode, tmp_path):
    if not dist.is_gloo_available():
        pytest.skip("gloo backend not built into this torch")
    mp.start_processes(_worker, args=(2, free_port(), mode, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single_losses, single_state = _run(0, 1, None)
    finally:
        torch.set_num_threads(before)
    # Ranks agree exactly: same all-reduced gradients, same optimizer steps.
    assert r0["losses"] == r1["losses"]
    for name, value in r0["state"].items():
        assert torch.equal(value, r1["state"][name]), name
    # And they reproduce the single-process run on the same global batch, up to the
    # rounding of averaging two half-batch gradients instead of one full-batch gradient.
    for step, (a, b) in enumerate(zip(r0["losses"], single_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: 2 ranks {a:.7f} vs 1 process {b:.7f}"
    for name, value in single_state.items():
        err = float((r0["state"][name] - value).norm() / value.norm().clamp_min(1e-12))
        assert err <= 1e-4, f"{name}: relative difference {err:.2e}"

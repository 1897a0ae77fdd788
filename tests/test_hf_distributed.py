"""A ``patch_hf``-patched Hugging Face Llama under FSDP2 (``fully_shard``, gloo, 2 processes on
CPU): the fused loss (``linear_cross_entropy`` on ``lm_head.weight``, sharded with the root)
gives the loss and every parameter gradient of the single-process run on the same global
batch, and both match the unpatched model run in float64 — with the head sharded in the root
unit, and as its own unit (torchtitan's recipe: the fused loss then runs as a method of the
head registered with FSDP, which gathers its weight as for ``lm_head(...)``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import WiolaOpCalls, free_port, fsdp2_available
from hf_helpers import VOCAB, model  # noqa: E402  (skips without transformers)

WORLD, BATCH, SEQ = 2, 4, 10


def _batch() -> tuple[torch.Tensor, torch.Tensor, int]:
    """The global batch: ids (B, T), labels with -100 rows and holes, and the number of
    counted (shifted) labels, which every rank divides its sum by (``num_items_in_batch``)."""
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(BATCH, SEQ, generator=g) < 0.3] = -100
    labels[1, :] = -100  # a rank whose first row counts nothing
    return ids, labels, int((labels[:, 1:] != -100).sum())


def _model(patched: bool):
    import wiola_kernels as wk

    m = model("llama", seed=20).train()
    return wk.patch_hf(m) if patched else m


def _step(m, ids, labels, n_items, scale: float = 1.0):
    """One forward + backward; returns the loss (before ``scale``)."""
    out = m(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(n_items))
    (out.loss * scale).backward()
    return out.loss.detach()


def _worker(rank: int, port: int, out: str, head_unit: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        m = _model(patched=True)
        for layer in m.model.layers:
            fully_shard(layer)
        if head_unit:
            fully_shard(m.lm_head)  # the head its own unit (torchtitan's recipe)
        fully_shard(m)  # the root group: embeddings, final norm (and the head), sharded across ranks
        assert type(m.lm_head.weight).__name__ == "DTensor"
        ids, labels, n_items = _batch()
        rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        # Each rank's loss is its sum ÷ the global count; FSDP averages gradients over the
        # ranks, so the loss is scaled by the world size (what HF's Trainer does).
        with WiolaOpCalls() as ops:
            loss = _step(m, ids[rows], labels[rows], n_items, scale=WORLD)
        dist.all_reduce(loss)
        grads = {n: p.grad.full_tensor().detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        torch.save({"loss": loss, "grads": grads, "calls": dict(ops.calls)}, f"{out}/rank{rank}.pt")
        import wiola_kernels as wk

        wk.unpatch_hf(m)  # takes the head's registered loss method with it
        assert not [k for k in vars(m.lm_head) if k.startswith("wiola")], vars(m.lm_head).keys()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not fsdp2_available(), reason="needs torch.distributed with gloo and FSDP2 (torch >= 2.6)")
@pytest.mark.parametrize("head_unit", [False, True], ids=["head_in_root", "head_unit"])
def test_fsdp2_fused_loss_on_a_sharded_head_matches_one_process(tmp_path, head_unit):
    from wiola_kernels.testing import rel_err, tolerance

    mp.start_processes(_worker, args=(free_port(), str(tmp_path), head_unit), nprocs=WORLD, join=True,
                       start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    # The fused loss ran on every rank (the head's logits never made), forward and backward.
    for r in (r0, r1):
        assert r["calls"]["linear_cross_entropy"] == 1 and r["calls"]["linear_cross_entropy_backward"] == 1
        assert r["calls"]["rms_norm"] == 5 and r["calls"]["srpe"] == 2 and r["calls"]["glu"] == 2
    assert torch.equal(r0["loss"], r1["loss"])
    ids, labels, n_items = _batch()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _model(patched=True)
        want_loss = _step(single, ids, labels, n_items)
        want = {n: p.grad for n, p in single.named_parameters() if p.grad is not None}
        ref64 = _model(patched=False).double()
        ref_loss = _step(ref64, ids, labels, n_items)
        ref = {n: p.grad for n, p in ref64.named_parameters() if p.grad is not None}
    finally:
        torch.set_num_threads(before)
    # Two ranks = one process on the whole batch (float32 sums in another order) ...
    assert rel_err(r0["loss"], want_loss) <= 1e-6, (r0["loss"], want_loss)
    assert r0["grads"].keys() == want.keys() == ref.keys() and "lm_head.weight" in want
    for name, grad in want.items():
        assert rel_err(r0["grads"][name], grad) <= 1e-5, name
        assert torch.equal(r0["grads"][name], r1["grads"][name]), name
    # ... = the unpatched model in float64 (SPEC §9, whole model: the attention tolerance).
    tol = tolerance(torch.float32, "attention")
    assert rel_err(r0["loss"], ref_loss) <= tol
    for name, grad in ref.items():
        assert rel_err(r0["grads"][name], grad) <= tol, name

"""The GPU benchmark's logic, checked without a GPU: device time (bench/device_time.py) through a
stub timer, the device-time table's rows (bench/gpu_cases.py), the peers' status when they are
missing (bench/peers.py), the Llama-3.2-1B case of ``bench --hf llama --size 1b`` and the
wiola-360m GPU step's same-size Llama (python/wiola/bench/gpu.py)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from wiola_kernels.bench import device_time as dt
from wiola_kernels.bench import gpu_cases, peers


class StubTimer:
    """A :class:`device_time.Timer` that runs what it is given on the CPU and returns scripted times.

    ``event_times``: what successive ``event_ms`` calls return (the first one is the estimate);
    ``capture_error``: raised by ``capture``; ``backlog``: ``(device ms, host ms)`` per backlog.
    """

    def __init__(self, event_times=(), l2=50 * 2**20, free=80 * 2**30, capture_error=None, backlog=()):
        self.events = list(event_times)
        self.l2, self.free = l2, free
        self.capture_error = capture_error
        self.backlog = list(backlog)
        self.log: list[str] = []
        self.spins: list[float] = []

    def l2_bytes(self):
        return self.l2

    def free_bytes(self):
        return self.free

    def flush(self):
        self.log.append("flush")

    def synchronize(self):
        pass

    def enqueue_us(self, fn, calls):
        for _ in range(calls):
            fn()
        return 7.0  # 7 µs per call of fn (one round over the sets)

    def event_ms(self, fn):
        fn()
        self.log.append("event")
        return self.events.pop(0) if self.events else 1.0

    def capture(self, fn):
        if self.capture_error is not None:
            raise self.capture_error
        fn()  # a capture runs the calls once
        self.log.append("capture")
        return fn

    def backlog_ms(self, fn, spin_ms):
        fn()
        self.spins.append(spin_ms)
        self.log.append("backlog")
        return self.backlog.pop(0) if self.backlog else (1.0, 0.0)


# ------------------------------------------------------------------------------ arithmetic

def test_median_picks_the_middle_and_averages_an_even_pair():
    assert dt.median([5.0, 1.0, 3.0]) == 3.0
    assert dt.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert dt.median([9.0]) == 9.0
    with pytest.raises(ValueError, match="samples"):
        dt.median([])


@pytest.mark.parametrize("pass_bytes, l2, kwargs, want", [
    (1 << 30, 50 << 20, {}, 1),                     # one 1 GiB pass moves far more than 2 × L2
    (101 << 20, 50 << 20, {}, 1),                   # just over 2 × L2
    (100 << 20, 50 << 20, {}, 2),                   # exactly 2 × L2: one more set
    (10 << 20, 50 << 20, {}, 11),                   # ⌈100/10⌉ + 1
    (3 << 20, 60 << 20, {}, 41),                    # H200's 60 MiB: ⌈120/3⌉ + 1
    (1 << 10, 50 << 20, {}, dt.MAX_SETS),           # capped
    (10 << 20, 50 << 20, dict(memory_budget=35 << 20), 3),            # memory: 35 MiB / 10 MiB
    (10 << 20, 50 << 20, dict(memory_budget=35 << 20, set_bytes=5 << 20), 7),
    (10 << 20, 50 << 20, dict(memory_budget=1), 1),  # at least one
    (10 << 20, 0, {}, 1),                           # no L2 to defeat
])
def test_rotation_sets_move_more_than_twice_the_l2_between_uses(pass_bytes, l2, kwargs, want):
    sets = dt.rotation_sets(pass_bytes, l2, **kwargs)
    assert sets == want
    if not kwargs and l2 and sets < dt.MAX_SETS and sets > 1:
        assert (sets - 1) * pass_bytes >= 2 * l2  # the traffic between two uses of one set


def test_rotation_sets_rejects_bad_sizes():
    with pytest.raises(ValueError, match="pass_bytes"):
        dt.rotation_sets(0, 1)
    with pytest.raises(ValueError, match="l2_bytes"):
        dt.rotation_sets(1, -1)


@pytest.mark.parametrize("est_ms, sets, want", [
    (0.01, 1, 256),      # 500 wanted, capped
    (0.01, 3, 255),      # capped to a multiple of the sets
    (0.1, 1, 50),        # 5 ms / 0.1 ms
    (0.1, 4, 52),        # rounded up to whole rounds of 4
    (10.0, 1, 1),        # one call is already more than the target
    (10.0, 3, 3),        # at least one round
    (0.0, 2, 256),       # no estimate: as many as allowed
    (float("nan"), 5, 255),
    (0.01, 300, 300),    # more sets than the cap: one round still
])
def test_calls_per_replay(est_ms, sets, want):
    calls = dt.calls_per_replay(est_ms, sets)
    assert calls == want and calls % sets == 0


def test_bandwidth_and_percent_of_copy():
    assert dt.gbps(3 * 10**9, 1.0) == pytest.approx(3000.0)
    assert math.isnan(dt.gbps(1, 0.0))
    # 1 GB in 0.5 ms against a copy of 2 GB in 0.8 ms: 2000 / 2500 GB/s.
    assert dt.pct_of_copy(10**9, 0.5, 2 * 10**9, 0.8) == pytest.approx(80.0)


# ------------------------------------------------------------------------------ time_device

def _counting_runs(sets_seen: list[int]):
    def make_run(i):
        return lambda: sets_seen.append(i)
    return make_run


def test_graph_replays_give_the_median_per_call_without_the_warmup():
    # est 0.1 ms/call on 1 set -> 50 calls per replay; 3 warm-up replays (huge: excluded), then 5 timed.
    replays = [1000.0, 1000.0, 1000.0, 5.0, 6.0, 4.0, 50.0, 5.5]
    timer = StubTimer(event_times=[0.1, *replays])
    seen: list[int] = []
    t = dt.time_device(_counting_runs(seen), 1 << 30, timer=timer, replays=5, warmup=3)
    assert (t.method, t.calls, t.sets, t.replays) == ("graph", 50, 1, 5)
    assert t.samples == [x / 50 for x in replays[3:]]
    assert t.ms == pytest.approx(5.5 / 50)  # the median, not the mean (the 50 ms outlier)
    assert t.host_us == pytest.approx(7.0) and not t.host_bound and t.note == ""
    # The L2 is flushed before every replay, and before the estimate.
    log = timer.log
    assert log.count("capture") == 1 and log.count("event") == 1 + 8
    after = log[log.index("capture") + 1:]
    assert after == ["flush", "event"] * 8


def test_inputs_rotate_over_the_sets_each_used_equally():
    # 10 MiB passes, 50 MiB L2: 11 sets; a round of them 1.1 ms (0.1 ms a call): 5 ms / 0.1 ms -> 55 calls.
    timer = StubTimer(event_times=[1.1])
    seen: list[int] = []
    t = dt.time_device(_counting_runs(seen), 10 << 20, timer=timer, replays=2, warmup=1)
    assert t.sets == 11 and t.calls == 55
    counts = {i: seen.count(i) for i in range(t.sets)}
    assert len(set(counts.values())) == 1  # every set equally often
    assert seen[:11] == list(range(11))   # in turn


def test_rotation_limited_by_device_memory_is_noted():
    timer = StubTimer(event_times=[0.1], free=4 * (10 << 20))  # a quarter of it: 10 MiB, one set
    t = dt.time_device(_counting_runs([]), 10 << 20, timer=timer, replays=1, warmup=0)
    assert t.sets == 1 and "rotation limited to 1 of 11" in t.note


def test_a_pass_that_cannot_be_captured_is_timed_as_a_backlog_and_says_why():
    timer = StubTimer(event_times=[0.2], capture_error=RuntimeError("operation not permitted when stream is capturing"),
                      backlog=[(99.0, 0.0), (2.5, 0.1), (2.0, 0.1), (3.0, 0.1)])
    t = dt.time_device(_counting_runs([]), 1 << 30, timer=timer, replays=3, warmup=1)
    assert t.method == "backlog" and t.calls == 25
    assert "not capturable (RuntimeError: operation not permitted" in t.note
    assert t.ms == pytest.approx(2.5 / 25) and not t.host_bound
    assert timer.log.count("backlog") == 4 and "capture" not in timer.log
    # The spin outlasts the host's queueing of the backlog (7 µs a call -> 25 calls: 2 ms + 2 × 0.175 ms).
    assert timer.spins[0] == pytest.approx(2.0 + 2 * 7.0 * 25 / 1e3)


def test_a_backlog_the_host_could_not_keep_queued_is_flagged_and_the_spin_grows():
    # Warm-up: the host took 10 ms to queue, longer than the spin: the next spins are 20 ms.
    timer = StubTimer(event_times=[0.2], capture_error=RuntimeError("x"),
                      backlog=[(5.0, 10.0), (5.0, 1.0), (5.0, 30.0)])
    t = dt.time_device(_counting_runs([]), 1 << 30, timer=timer, replays=2, warmup=1)
    assert timer.spins[1:] == [20.0, 20.0]
    assert t.host_bound  # the last backlog took 30 ms to queue behind a 20 ms spin


def test_allow_graph_false_never_captures():
    timer = StubTimer(event_times=[0.2])
    t = dt.time_device(_counting_runs([]), 1 << 30, timer=timer, replays=1, warmup=0, allow_graph=False)
    assert t.method == "backlog" and "not attempted" in t.note and "capture" not in timer.log


def test_time_device_needs_a_cuda_device_or_a_timer():
    with pytest.raises(ValueError, match="CUDA device"):
        dt.time_device(_counting_runs([]), 1, device="cpu")
    with pytest.raises(ValueError, match="replays"):
        dt.time_device(_counting_runs([]), 1, timer=StubTimer(), replays=0)


def test_pass_time_runs_the_case_pass_on_fresh_input_sets():
    """Each input set from case.make_inputs(); the forward+backward pass runs its forward on
    leaves that want gradients and returns the input gradients."""
    from wiola_kernels.bench.cases import BenchCase
    from wiola_kernels.bench.runner import min_bytes

    made, calls = [], []

    def make_inputs():
        made.append(1)
        g = torch.Generator().manual_seed(len(made))
        return torch.randn(4, 8, generator=g), torch.rand(8, generator=g) + 0.5

    def fused(x, w):
        calls.append(x.requires_grad and w.requires_grad)
        return x * w

    case = BenchCase(op="scale", shape="x (4, 8)", dtype=torch.float32, make_inputs=make_inputs, fused=fused,
                     eager=lambda x, w: x * w)
    nbytes = min_bytes(case, "fwd+bwd", make_inputs())
    made.clear()
    calls.clear()  # min_bytes's own no-grad call
    # 9 sets (⌈8⌉ + 1); a slow estimate keeps the replays to one round of them.
    timer = StubTimer(event_times=[1000.0], l2=4 * nbytes)
    t = dt.pass_time(case, "fwd+bwd", fused, torch.device("cpu"), timer=timer, nbytes=nbytes, replays=1)
    assert t.sets == 9 and len(made) == 9  # one make_inputs per set
    # The probes for the output gradients' shapes run without gradients; every timed call with them.
    assert calls.count(True) >= t.sets and calls.count(False) == t.sets
    with pytest.raises(ValueError, match="pass_"):
        dt.device_pass(case, fused, "bwd", make_inputs())


def test_the_runner_hook_is_empty_off_cuda():
    from wiola_kernels.bench.cases import all_cases

    case = all_cases("cpu", small=True, ops=["glu"])[0]
    assert dt.record_fields(case, "fwd", 100, torch.device("cpu")) == {}


# ------------------------------------------------------------------------------ peers

def test_a_missing_peer_is_reported_not_raised(monkeypatch):
    real = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("liger_kernel", "cut_cross_entropy") else real(name, *a))
    peers.clear_cache()
    try:
        for name in peers.PEERS:
            st = peers.status(name, "cuda")
            assert not st.available and st.reason == "not installed"
        assert peers.versions() == {"liger": "Liger-Kernel: not installed", "cce": "Cut Cross-Entropy: not installed"}
    finally:
        peers.clear_cache()


def test_a_peer_that_fails_to_import_or_has_no_gpu_says_so(monkeypatch):
    fake = types.ModuleType("liger_kernel")
    fake.__spec__ = types.SimpleNamespace(name="liger_kernel")
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name, *a: fake.__spec__)
    real_import = peers.importlib.import_module

    def broken(name, *a):
        if name == "cut_cross_entropy":
            raise ImportError("triton is too old")
        if name == "liger_kernel":
            return fake
        return real_import(name, *a)

    monkeypatch.setattr(peers.importlib, "import_module", broken)
    peers.clear_cache()
    try:
        cce = peers.status("cce", "cuda")
        assert not cce.available and cce.reason == "import failed: ImportError: triton is too old"
        cpu = peers.status("liger", "cpu")
        assert not cpu.available and "needs a CUDA device" in cpu.reason
        assert peers.status("liger", "cuda").available
        with pytest.raises(ValueError, match="name must be one of"):
            peers.status("quack")
    finally:
        peers.clear_cache()


# ------------------------------------------------------------------------------ the table

def test_table_rows_with_a_missing_peer_and_the_copy(monkeypatch):
    """rms_norm's row group on tiny CPU tensors through a stub timer: the copy row first, ours,
    eager, ours with δ, then Liger skipped as not installed; % copy and x wiola from the times."""
    real = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    peers.clear_cache()
    group = gpu_cases.rms_norm_case(torch.device("cpu"), shape=(8, 64))
    # Each timing: the estimate (1 ms: 5 calls a replay), 3 warm-up replays, 1 timed replay.
    # Order: copy, wiola, eager, wiola+δ (fwd only).
    timed = [2.0, 4.0, 8.0, 5.0]
    timer = StubTimer(event_times=[x for t in timed for x in (1.0, 99.0, 99.0, 99.0, t)], l2=0)
    try:
        rows = gpu_cases.run_group(group, torch.device("cpu"), replays=1, passes=("fwd",), timer=timer)
    finally:
        peers.clear_cache()
    assert [r["impl"] for r in rows] == ["copy", "wiola", "eager", "wiola+δ", "liger"]
    copy, ours, eager, shift, liger = rows
    assert liger["skipped"] == "Liger-Kernel: not installed" and "ms" not in liger
    nbytes = ours["bytes"]
    assert nbytes == 2 * 8 * 64 * 2 + 64 * 2  # bf16 x read, y written, γ read
    calls = 5  # 5 ms target / 1 ms estimate
    assert ours["ms"] == pytest.approx(4.0 / calls) and eager["ms"] == pytest.approx(8.0 / calls)
    assert eager["x_wiola"] == pytest.approx(2.0) and ours["x_wiola"] == 1.0
    copy_bytes = 2 * 4 * (nbytes // 2 // 4)
    assert ours["pct_of_copy"] == pytest.approx(100 * (nbytes / 4.0) / (copy_bytes / 2.0))
    line = gpu_cases.format_row(liger)
    assert "skipped: Liger-Kernel: not installed" in line


def test_real_rows_move_at_least_256_mb_a_pass():
    """Every memory-bound real row's forward moves ≥ 256 MiB (counted from its shapes, nothing allocated)."""
    assert 2 * math.prod(gpu_cases.RMS_NORM_REAL) * 2 >= gpu_cases.MIN_REAL_PASS_BYTES
    assert 4 * math.prod(gpu_cases.ADD_RMS_NORM_REAL) * 2 >= gpu_cases.MIN_REAL_PASS_BYTES
    tokens, n = gpu_cases.GLU_REAL
    assert (2 * tokens * n + tokens * n) * 2 >= gpu_cases.MIN_REAL_PASS_BYTES
    b, h, h_kv, t, dh = gpu_cases.ROPE_REAL
    assert 2 * b * t * (h + h_kv) * dh * 2 >= gpu_cases.MIN_REAL_PASS_BYTES
    assert gpu_cases.LCE_REAL == (8192, 2048, 128256)
    assert gpu_cases.GCLA_REAL == dict(B=4, H=16, H_kv=4, T=4096, L=2) and gpu_cases.GCLA_REAL_HEAD_DIMS == (64, 128)


def test_the_plan_lists_every_row_group_without_a_gpu(capsys):
    assert gpu_cases.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    real = [ln for ln in lines if " real " in ln]
    assert {ln.split()[0] for ln in real} == set(gpu_cases.REAL_FACTORIES)
    assert any(ln.startswith("linear_cross_entropy") and "liger" in ln and "cce" in ln for ln in real)
    assert any(" today " in ln for ln in lines)
    if not torch.cuda.is_available():
        assert gpu_cases.main([]) == 2 and "needs a CUDA device" in capsys.readouterr().err


# ------------------------------------------------------------------------------ HF and wiola steps

def test_size_1b_is_llama_3_2_1b():
    """meta-llama/Llama-3.2-1B's config.json: the fields that fix shapes and work, and its 1.24 B parameters."""
    import transformers

    from wiola_kernels.bench.hf import hf_case

    case = hf_case("llama", "cuda", size="1b")
    c = case.config_kwargs
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == \
        (2048, 16, 32, 8)
    assert (c["intermediate_size"], c["vocab_size"], c["head_dim"], c["tie_word_embeddings"]) == \
        (8192, 128256, 64, True)
    assert c["rms_norm_eps"] == 1e-5 and c["rope_parameters"]["rope_theta"] == 500000.0
    assert (case.batch, case.length, case.dtype, case.sequential) == (4, 2048, torch.bfloat16, True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**c))
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied head
    with pytest.raises(ValueError, match="--size"):
        hf_case("llama", "cpu", size="8b")


def test_liger_variants_are_skipped_with_the_reason_where_liger_cannot_run():
    from wiola_kernels.bench.hf import HFStepCase, format_hf_records, run_hf_bench

    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    case = HFStepCase("llama", torch.device("cpu"), torch.float32, 1, 16, cfg, size="default", sequential=True)
    seen = []
    records = run_hf_bench(case, repeats=1, warmup=1, variants=("liger_eager", "unpatched_eager"),
                           on_record=seen.append)
    assert [r["variant"] for r in records] == ["liger_eager", "unpatched_eager"] and seen == records
    assert records[0]["skipped"].startswith("Liger-Kernel: ")
    assert records[1]["speedup_vs_unpatched_eager"] == 1.0
    assert "liger_eager        skipped: Liger-Kernel" in format_hf_records(records)


def test_wiola_gpu_step_compares_with_a_llama_of_the_same_size():
    from wiola.bench.gpu import llama_config_like, llama_parameters, split_device, wiola_config
    from wiola.modeling_wiola import WiolaForCausalLM
    import transformers

    cfg = wiola_config()
    with torch.device("meta"):
        n = sum(p.numel() for p in WiolaForCausalLM(cfg).parameters())
        like = llama_config_like(cfg, n)
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**like))
    counted = sum(p.numel() for p in llama.parameters())
    assert counted == llama_parameters(like)  # the formula is Hugging Face's count
    assert abs(counted - n) / n < 0.01
    assert (like["hidden_size"], like["num_hidden_layers"], like["num_key_value_heads"]) == (1024, 16, 4)
    assert split_device(["--steps", "3", "--device", "cuda"]) == ("cuda", ["--steps", "3"])
    assert split_device(["--device=cuda:1"]) == ("cuda:1", [])
    assert split_device(["--decode"]) == ("cpu", ["--decode"])


def test_wiola_gpu_step_refuses_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    import wiola.__main__ as wiola_cli

    assert wiola_cli.main(["bench", "--device", "cuda"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err

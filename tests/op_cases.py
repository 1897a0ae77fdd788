"""The one description of every registered op that the shared suites run: ``CASES`` has
an :class:`OpCase` per op of :mod:`wiola_kernels.dispatch` (tests/test_all_ops.py fails when
one is missing), saying how to make the op's inputs at a shape, call it, and — with an
oracle of tests/oracles.py — check it; and, per public function of the op, its autograd
``Function`` and its registered ``wiola::`` ops (tests/test_op_layer.py: opcheck,
gradcheck, ``torch.compile``, the bad-input messages)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

import wiola_kernels as wk
from helpers import gen
from oracles import add_rms_norm_oracle, atm_oracle, atm_unmerge_oracle, gcla_oracle, glu_oracle, lce_oracle, rms_oracle, srpe_oracle
from wiola_kernels import dispatch, reference
from wiola_kernels.testing import srpe_tolerance, tolerance

F64 = torch.float64


def _randn(*shape, g, scale=1.0):
    return scale * torch.randn(*shape, generator=g, dtype=F64)


# --- one entry per registered op ---------------------------------------------------------------

@dataclass(frozen=True)
class Public:
    """One public function of an op (``wk.<name>``; ``reference.<name>`` is its float64
    reference), as tests/test_op_layer.py sees it."""

    name: str
    function: type                                   # its torch.autograd.Function
    op_calls: Callable                               # (arguments, ops namespace) -> [(registered op, args)]:
                                                     # the forward, then the backward
    bad: Callable[[dict], list] = lambda a: []       # float32 arguments -> [(changes, error, message)]:
                                                     # one of each kind of check
    make: Callable[[torch.dtype], dict] | None = None  # its arguments, when not the op's make (below)

    @property
    def public(self) -> Callable:
        return getattr(wk, self.name)

    @property
    def reference(self) -> Callable:
        return getattr(reference, self.name)


@dataclass(frozen=True)
class OpCase:
    """How the shared suites exercise one registered op."""

    make: Callable[..., dict]    # (shape, dtype, seed, **variant) -> the public function's arguments: the
                                 # seed draws the numbers, the variant's keywords choose the options
    call: Callable[[dict], tuple]                    # those arguments -> the outputs
    shapes: dict[str, list]   # "default" or a backend's own ("triton": the interpreter is slow, tiny),
                              # "gradcheck", "threads", "views", "dynamic" (two sizes), "concurrent",
                              # "gpu", "layer" (the op layer's)
    functions: tuple[Public, ...] = ()               # the op's public functions
    variants: tuple[dict, ...] = ({},)               # make's option sets, cycled over each list of shapes
    view_variants: tuple[dict, ...] = ({},)          # views' option sets, likewise
    layer_variant: dict = field(default_factory=dict)  # the options of the op layer's arguments
    oracle: Callable[[dict], tuple] | None = None    # float64 arguments -> float64 outputs, differentiable
    views: Callable[[tuple, torch.dtype, int], tuple[dict, list]] | None = None  # strided (arguments, grads)
    in_place: tuple[str, ...] = ()                   # backends that read `views` without a copy
    kind: str = "elementwise"                        # SPEC §9's tolerance row
    out_dtype: Callable[[torch.dtype], torch.dtype] = lambda dtype: dtype  # the float outputs' dtype
    tol: Callable[[torch.dtype, dict], float] | None = field(default=None)  # instead of the kind's

    def inputs(self, shape: tuple, dtype: torch.dtype, i: int, variant: int | None = None) -> dict:
        """The arguments for the ``i``-th shape of a list: seed ``i`` and the variant ``i``
        cycles to (or the ``variant``-th)."""
        return self.make(shape, dtype, seed=i, **self.variants[(i if variant is None else variant) % len(self.variants)])

    def view_inputs(self, shape: tuple, dtype: torch.dtype, i: int) -> tuple[dict, list]:
        """``views``' (arguments, output gradients) for the ``i``-th shape of ``shapes["views"]``."""
        return self.views(shape, dtype, seed=i, **self.view_variants[i % len(self.view_variants)])

    def tolerance(self, dtype: torch.dtype, args: dict) -> float:
        return self.tol(dtype, args) if self.tol else tolerance(dtype, self.kind)

    def layer_args(self, function: Public, dtype: torch.dtype) -> dict:
        """``function``'s arguments for the op layer's tests: every parameter of its
        signature, in order (``Function.apply`` takes them positionally)."""
        if function.make is not None:
            return function.make(dtype)
        bound = inspect.signature(function.public).bind(**self.make(self.shapes["layer"][0], dtype, seed=0, **self.layer_variant))
        bound.apply_defaults()
        return dict(bound.arguments)


def _rms_make(shape, dtype, seed, shift=True):
    """``shift=False``: no δ (its own kernel path)."""
    g = gen(seed)
    d = shape[-1]
    x, w, s = _randn(*shape, g=g), torch.rand(d, generator=g, dtype=F64) + 0.5, _randn(d, g=g, scale=0.3)
    return dict(x=x.to(dtype), weight=w.to(dtype), shift=s.to(dtype) if shift else None, eps=1e-6)


def _rms_views(shape, dtype, seed):
    """x a strided view both ways (transposed, every other column), γ and δ every other
    element of one tensor, the output gradient transposed."""
    g = gen(seed)
    rows, d = shape
    x = _randn(2 * d, rows, g=g).t()[:, ::2]
    wd = torch.rand(2 * d, generator=g, dtype=F64) + 0.5
    grad = _randn(d, rows, g=g).t()
    return dict(x=x.to(dtype), weight=wd[::2].to(dtype), shift=(0.1 * wd[1::2]).to(dtype), eps=1e-6), [grad.to(dtype)]


SRPE_SPEC_PARAMS = (10000.0, 8.0, 0.1, 0.01)


def _srpe_make(shape, dtype, seed, max_position=2**20, params=SRPE_SPEC_PARAMS):
    """Positions in ``[0, max_position)`` (below 256, float64 is within 1e-12 and every index
    dtype, uint8 too, holds them); ``params``: (θ₀, k_s, a_s, f_s)."""
    b, h, h_kv, t, dh = shape
    g = gen(seed)
    q, k = _randn(b, h, t, dh, g=g), _randn(b, h_kv, t, dh, g=g)
    pos = torch.randint(0, max_position, (b, t), generator=g)  # not monotonic, may repeat
    return dict(q=q.to(dtype), k=k.to(dtype), position_ids=pos,
                **dict(zip(("theta", "spiral_divisor", "radial_amplitude", "radial_frequency"), params)))


def _srpe_views(shape, dtype, seed):
    """q, k as the model makes them: ``Linear(x).view(B, T, H, d_h).transpose(1, 2)``, int64
    positions expanded from (1, T) (stride 0 over the batch), output gradients alike."""
    b, h, h_kv, t, dh = shape
    args = _srpe_make(shape, dtype, seed)
    g = gen(seed + 1)
    view = {n: _randn(b, t, n_h, dh, g=g).to(dtype).transpose(1, 2) for n, n_h in (("q", h), ("k", h_kv))}
    pos = torch.randperm(4 * t, generator=g)[:t].sort().values[None].expand(b, t)
    grads = [_randn(b, t, n_h, dh, g=g).to(dtype).transpose(1, 2) for n_h in (h, h_kv)]
    return dict(args, **view, position_ids=pos), grads


def _srpe_oracle(a):
    params = (a["theta"], a["spiral_divisor"], a["radial_amplitude"], a["radial_frequency"])
    return srpe_oracle(a["q"], a["position_ids"], *params), srpe_oracle(a["k"], a["position_ids"], *params)


def _add_make(shape, dtype, seed, shift=True):
    """rms_norm's inputs and a residual twice x's scale."""
    return dict(_rms_make(shape, dtype, seed, shift), residual=_randn(*shape, g=gen(seed + 1), scale=2.0).to(dtype))


def _add_views(shape, dtype, seed, residual="transposed"):
    """x a half of a (rows, 2d) tensor (row stride 2d); the residual its other half
    (``residual="half"``) or transposed; γ every other element, no δ; the output gradients
    transposed."""
    g = gen(seed)
    rows, d = shape
    both = _randn(rows, 2 * d, g=g)
    residual = both[:, d:] if residual == "half" else _randn(d, rows, g=g).t()
    wd = torch.rand(2 * d, generator=g, dtype=F64) + 0.5
    grads = [_randn(d, rows, g=g).t().to(dtype) for _ in range(2)]
    return dict(x=both[:, :d].to(dtype), residual=residual.to(dtype), weight=wd[::2].to(dtype), shift=None,
                eps=1e-6), grads


_GLU_LAYOUTS = ("halves", "separate", "packed")


def _glu_make(shape, dtype, seed, activation="gelu_tanh", layout="halves"):
    """``layout``: the two halves of one projection's output (row stride 2n, read in place),
    two tensors (``separate``), or that output itself (``packed``: b None)."""
    n = shape[-1]
    u = _randn(*shape[:-1], 2 * n, g=gen(seed), scale=2.0).to(dtype)
    if layout == "packed":
        return dict(a=u, b=None, activation=activation)
    a, b = u[..., :n], u[..., n:]
    if layout == "separate":
        a, b = a.contiguous(), b.contiguous()
    return dict(a=a, b=b, activation=activation)


def _lce_make(shape, dtype, seed, reduction="mean", options=False):
    """(N, d, V): hidden rows, the head, labels with every fourth row ignored (from row 1:
    N = 1 still counts a row). ``options``: label smoothing, softcap and z-loss all on."""
    n, d, vocab = shape
    g = gen(seed)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[1::4] = -100
    args = dict(h=_randn(n, d, g=g).to(dtype), W=_randn(vocab, d, g=g, scale=0.5).to(dtype), labels=labels)
    if reduction != "mean":
        args["reduction"] = reduction
    if options:
        args.update(label_smoothing=0.1, softcap=4.0, z_loss=1e-2)
    return args


def _lce_oracle(a):
    return (lce_oracle(a["h"], a["W"], a["labels"], **{n: v for n, v in a.items() if n not in ("h", "W", "labels")}),)


GCLA_NAMES = ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate")


def _gcla_make(shape, dtype, seed):
    """(B, H, H_kv, T, d_h, S, Λ', lengths or None): S = 1 (one summary per sequence) or T."""
    b, h, h_kv, t, dh, s, lam, lens = shape
    g = gen(seed)
    sizes = ((b, h, t, dh), (b, h_kv, t, dh), (b, h_kv, t, dh), (b, h, t, dh), (b, h, s, lam, dh), (b, h, s, lam, dh),
             (h,))
    args = {n: _randn(*size, g=g).to(dtype) for n, size in zip(GCLA_NAMES, sizes)}
    return dict(args, lengths=None if lens is None else torch.tensor(lens))


def _gcla_views(shape, dtype, seed, broadcast_grad=False):
    """The model's views (S = T): q_rot, q, k_rot, v transposed from (B, T, heads, d_h), kc, vc
    permuted from the context projection's (B, T, Λ', H, d_h), a float32 gate (a parameter;
    float64 beside float64), the output gradient transposed alike (``broadcast_grad``: stride 0
    over the batch, the gradient of a sum). S = 1's layouts: tests/test_gcla_attention.py."""
    b, h, h_kv, t, dh, s, lam, lens = shape
    g = gen(seed)
    args = dict(_gcla_make(shape, dtype, seed), gate=_randn(h, g=g).to(F64 if dtype == F64 else torch.float32))
    for n, n_h in (("q_rot", h), ("k_rot", h_kv), ("v", h_kv), ("q", h)):
        args[n] = _randn(b, t, n_h, dh, g=g).to(dtype).transpose(1, 2)
    for n in ("kc", "vc"):
        args[n] = _randn(b, s, lam, h, dh, g=g).to(dtype).permute(0, 3, 1, 2, 4)
    grad = _randn(1 if broadcast_grad else b, t, h, dh, g=g).to(dtype).transpose(1, 2).expand(b, h, t, dh)
    return args, [grad]


def _gcla_oracle(a):
    return (gcla_oracle(*(a[n] for n in GCLA_NAMES), lengths=a["lengths"]),)


def _atm_make(shape, dtype, seed):
    """Runs of repeated tokens (cosine 1) of every length among random neighbours (cosine far
    below τ = 0.9 for d ≥ 16), so the greedy rule decides; per-row lengths (row 0 full, the
    others anything in [0, T]) and positions of any order."""
    b, t, d = shape
    g = gen(seed)
    x = _randn(b, t, d, g=g)
    repeat = torch.rand(b, t, generator=g) < 0.6
    for j in range(1, t):
        x[:, j] = torch.where(repeat[:, j, None], x[:, j - 1], x[:, j])
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[:1] = t
    return dict(x=x.to(dtype), position_ids=torch.randint(0, 2**20, (b, t), generator=g), threshold=0.9,
                lengths=lengths)


def _atm_views(shape, dtype, seed):
    """x every other column of a (T, B, 2d) buffer, positions expanded from (1, T) (stride 0
    over the batch), lengths every other element; the output gradients: merged's expanded
    from one row (stride 0), restored's transposed."""
    b, t, d = shape
    args = _atm_make(shape, dtype, seed)
    wide = torch.zeros(t, b, 2 * d, dtype=dtype)
    wide[..., ::2] = args["x"].transpose(0, 1)
    g = gen(seed + 1)
    grads = [_randn(1, t, d, g=g).to(dtype).expand(b, t, d), _randn(b, d, t, g=g).to(dtype).transpose(1, 2)]
    return dict(args, x=wide.transpose(0, 1)[..., ::2], position_ids=args["position_ids"][:1].expand(b, t),
                lengths=torch.stack([args["lengths"], args["lengths"]], 1).flatten()[::2]), grads


def _atm_call(a):
    merged, merged_positions, merged_lengths, index_map = wk.atm_merge(**a)
    return merged, merged_positions, merged_lengths, index_map, wk.atm_unmerge(merged * 2, index_map)


def _atm_oracle(a):
    merged, merged_positions, merged_lengths, index_map = atm_oracle(**a)
    return merged, merged_positions, merged_lengths, index_map, atm_unmerge_oracle(merged * 2, index_map)


# --- the op layer: each public function's registered ops and bad inputs ---------------------------

def _rms_calls(a, ops):
    fwd = (a["x"], a["weight"], a["shift"], a["eps"], a["hf_order"])
    _, rstd = ops.rms_norm(*fwd)
    return [(ops.rms_norm.default, fwd),
            (ops.rms_norm_backward.default, (torch.randn_like(a["x"]), a["x"], a["weight"], a["shift"], rstd))]


def _rms_bad(a):
    return [
        (dict(x=a["x"].long()), TypeError, r"^x must have dtype in \(float32, float64, bfloat16, float16\), got int64"),
        (dict(weight=a["weight"][:4]), ValueError, r"^weight must have shape \(d,\) = \(8,\), got \(4,\)"),
        (dict(shift=a["shift"][None]), ValueError, r"^shift must have shape \(d,\) = \(8,\), got \(1, 8\)"),
        (dict(x=torch.tensor(1.0)), ValueError, r"^x must have shape \(\.\.\., d\) \(at least 1 dimension\), got a 0-d tensor"),
        (dict(x=torch.zeros(3, 0), weight=torch.ones(0), shift=torch.zeros(0)), ValueError, r"^x must have a non-empty last dimension d, got d = 0"),
        (dict(eps=-1e-6), ValueError, r"^eps must be a finite number > 0, got -1e-06"),
        (dict(eps=float("nan")), ValueError, r"^eps must be a finite number > 0, got nan"),
    ]


def _add_calls(a, ops):
    fwd = (a["x"], a["residual"], a["weight"], a["shift"], a["eps"], a["hf_order"])
    _, s, rstd = ops.add_rms_norm(*fwd)
    return [(ops.add_rms_norm.default, fwd),
            (ops.add_rms_norm_backward.default,
             (torch.randn_like(a["x"]), torch.randn_like(a["x"]), s, a["weight"], a["shift"], rstd))]


def _add_bad(a):
    return [
        (dict(residual=a["residual"][..., :7]), ValueError, r"^residual must have the shape of x \(\.\.\., d\) = \(3, 5, 8\), got \(3, 5, 7\)"),
        (dict(residual=a["residual"].double()), TypeError, r"^residual must have dtype torch.float32 like x, got torch.float64"),
        (dict(shift=a["shift"][:4]), ValueError, r"^shift must have shape \(d,\) = \(8,\), got \(4,\)"),
        (dict(eps=0.0), ValueError, r"^eps must be a finite number > 0, got 0.0"),
        (dict(weight=a["weight"][:7]), ValueError, r"^weight must have shape \(d,\) = \(8,\), got \(7,\)"),
        (dict(residual=[0.0] * 8), TypeError, r"^residual must be a torch.Tensor"),
    ]


def _glu_calls(a, ops):
    fwd = (a["a"], a["b"], a["activation"])
    return [(ops.glu.default, fwd), (ops.glu_backward.default, (torch.randn_like(a["a"]), *fwd))]


def _glu_bad(a):
    return [
        (dict(b=a["b"][..., :7]), ValueError, r"^b must have the shape of a \(\.\.\., n\) = \(3, 5, 8\), got \(3, 5, 7\)"),
        (dict(b=a["b"].double()), TypeError, r"^b must have dtype torch.float32 like a, got torch.float64"),
        (dict(a=a["a"][..., :7].contiguous(), b=None), ValueError, r"^a must have an even last dimension 2n when b is None"),
        (dict(activation="gelu"), ValueError, r"^activation must be 'silu' or 'gelu_tanh', got 'gelu'"),
        (dict(a=a["a"].long()), TypeError, r"^a must have dtype in \(float32, float64, bfloat16, float16\), got int64"),
        (dict(a=torch.randn(()), b=torch.randn(())), ValueError, r"^a must have shape \(\.\.\., n\) \(at least 1 dimension\)"),
        (dict(a=[1.0, 2.0], b=None), TypeError, r"^a must be a torch.Tensor"),
        (dict(activation=3), TypeError, r"^activation must be a str, got int"),
    ]


def _srpe_calls(a, ops):
    params = (a["theta"], a["spiral_divisor"], a["radial_amplitude"], a["radial_frequency"])
    return [(ops.srpe.default, (a["q"], a["k"], a["position_ids"], *params)),
            (ops.srpe_backward.default, (torch.randn_like(a["q"]), torch.randn_like(a["k"]), a["position_ids"], *params))]


def _srpe_bad(a):
    return [
        (dict(k=a["k"][:, :, :3]), ValueError, r"^k must have shape \(B, H_kv, T, d_h\) = \(2, H_kv, 5, 8\) to match q, got \(2, 2, 3, 8\)"),
        (dict(k=a["k"].double()), TypeError, r"^k must have dtype torch.float32 like q, got torch.float64"),
        (dict(q=a["q"][..., :7], k=a["k"][..., :7]), ValueError, r"^q must have an even, non-zero head dim d_h \(last dim\), got d_h = 7"),
        (dict(k=torch.randn(2, 3, 5, 8)), ValueError, r"^q's heads H = 4 \(dim 1\) must be a multiple of k's heads H_kv = 3 \(dim 1\)"),
        (dict(q=a["q"].transpose(1, 2).contiguous(), k=a["k"].transpose(1, 2).contiguous()),
         ValueError, r"these look like \(B, T, H, d_h\) = \(2, 5, 4, 8\), but the layout is \(B, H, T, d_h\)"),
        (dict(theta=0.0), ValueError, r"^theta must be a finite number > 0, got 0.0"),
        (dict(spiral_divisor=0.0), ValueError, r"^spiral_divisor must be non-zero"),
        (dict(radial_amplitude=float("inf")), ValueError, r"^radial_amplitude must be finite, got inf"),
        (dict(position_ids=torch.full((2, 5), 2**40)), ValueError, r"^position_ids must lie within ±\d+ \(float32 SRPE outputs lose SPEC accuracy beyond it for spiral_divisor=8.0\), got \|p\| = 1099511627776"),
    ]


def _gcla_calls(a, ops):
    ins = [a[n] for n in ("q_rot", "k_rot", "v", "q", "kc", "vc", "gate")]
    out, lse = ops.gcla_attention(*ins, a["lengths"])
    return [(ops.gcla_attention.default, (*ins, a["lengths"])),
            (ops.gcla_attention_backward.default, (torch.randn_like(out), *ins, a["lengths"], out, lse))]


def _gcla_bad(a):
    return [
        (dict(v=a["v"][:, :1]), ValueError, r"^v must have shape \(B, H_kv, T, d_h\) = \(2, 2, 5, 64\), got \(2, 1, 5, 64\)"),
        (dict(kc=a["kc"][:, :, :2]), ValueError, r"^kc must have shape \(B, H, S, Λ', d_h\) = \(2, 4, S, Λ', 64\) with S in \{1, T = 5\}, got \(2, 4, 2, 2, 64\)"),
        (dict(vc=a["vc"][..., :1, :]), ValueError, r"^vc must have the shape of kc"),
        (dict(gate=a["gate"][:3]), ValueError, r"^gate must have shape \(H,\) = \(4,\), got \(3,\)"),
        (dict(q=a["q"].double()), TypeError, r"^q must have dtype torch.float32 like q_rot, got torch.float64"),
        (dict(kc=a["kc"][0]), ValueError, r"^kc must have shape \(B, H, S, Λ', d_h\) \(5-D\), got \(4, 5, 2, 64\)"),
    ]


def _atm_tokens(dtype, seed):
    """(2, 6, 4) tokens whose neighbour cosines are 1 (repeats) or at most ~0.1: far from τ."""
    basis = torch.tensor([[0, 0, 1, 2, 2, 3], [1, 1, 1, 0, 3, 3]])
    x = torch.nn.functional.one_hot(basis, 4).to(F64) * (1 + torch.rand(2, 6, 1, generator=gen(seed)))
    return (x + 0.01 * torch.randn(2, 6, 4, generator=gen(seed + 1), dtype=F64)).to(dtype)


def _merge_make(dtype):
    return dict(x=_atm_tokens(dtype, 20), position_ids=torch.arange(6).expand(2, 6) + 3, threshold=0.5,
                lengths=torch.tensor([6, 4]))


def _merge_calls(a, ops):
    fwd = (a["x"], a["position_ids"], a["threshold"], a["lengths"])
    merged, _, merged_lengths, index_map = ops.atm_merge(*fwd)
    return [(ops.atm_merge.default, fwd),
            (ops.atm_merge_backward.default, (torch.randn_like(merged), index_map, merged_lengths))]


def _merge_bad(a):
    return [
        (dict(x=a["x"][0]), ValueError, r"^x must have shape \(B, T, d\) \(3-D\), got \(6, 4\)"),
        (dict(threshold=1.5), ValueError, r"^threshold must lie in \[-1, 1\] \(a cosine similarity\), got 1.5"),
        (dict(x=a["x"][..., :0]), ValueError, r"^x must have a non-empty last dimension d, got shape \(2, 6, 0\)"),
    ]


def _unmerge_make(dtype):
    index_map = reference.atm_merge(_atm_tokens(F64, 20), torch.arange(6), 0.5)[3]
    return dict(y=_randn(2, 6, 4, g=gen(30)).to(dtype), index_map=index_map)


def _unmerge_calls(a, ops):
    return [(ops.atm_unmerge.default, (a["y"], a["index_map"])),
            (ops.atm_unmerge_backward.default, (torch.randn_like(a["y"]), a["index_map"]))]


def _unmerge_bad(a):
    return [
        (dict(index_map=a["index_map"].int()), TypeError, r"^index_map must have dtype in \(int64\), got int32"),
        (dict(index_map=a["index_map"][:, :4]), ValueError, r"^index_map must have shape \(B, T\) = \(2, 6\) to match y, got \(2, 4\)"),
        (dict(index_map=a["index_map"] + 6), ValueError, r"^index_map values must lie in \[0, T\) = \[0, 6\), got values in"),
    ]


def _lce_calls(a, ops):
    opts = (a["ignore_index"], a["reduction"], a["label_smoothing"], a["softcap"], a["z_loss"], a["num_items"])
    fwd = (a["h"], a["W"], a["labels"], *opts, [True, True])
    loss, lse, grad_h, grad_W = ops.linear_cross_entropy(*fwd)
    bwd = (torch.randn_like(loss), a["h"], a["W"], a["labels"], lse, a["num_items"], grad_h, grad_W, *opts[:5], True)
    return [(ops.linear_cross_entropy.default, fwd), (ops.linear_cross_entropy_backward.default, bwd)]


def _lce_bad(a):
    return [
        (dict(W=a["W"][:, :5]), ValueError, r"^W must have shape \(V, d\) = \(V, 6\) to match h, got \(13, 5\)"),
        (dict(h=a["h"][0]), ValueError, r"^h must have shape \(\.\.\., d\) \(at least 2 dimensions\), got \(6,\)"),
        (dict(W=a["W"].double()), TypeError, r"^W must have dtype torch.float32 like h, got torch.float64"),
        (dict(labels=a["labels"].float()), TypeError, r"^labels must have dtype in \(int64, int32, int16, uint8\), got float32"),
        (dict(labels=a["labels"][:5]), ValueError, r"^labels must have shape h.shape\[:-1\] = \(7,\) or \(N,\) = \(7,\), got \(5,\)"),
        (dict(reduction="avg"), ValueError, r"^reduction must be one of 'mean', 'sum', 'none', got 'avg'"),
        (dict(label_smoothing=1.5), ValueError, r"^label_smoothing must lie in \[0, 1\], got 1.5"),
        (dict(softcap=0.0), ValueError, r"^softcap must be a finite number > 0, got 0.0"),
        (dict(z_loss=-0.5), ValueError, r"^z_loss must be a finite number >= 0, got -0.5"),
        (dict(num_items=torch.ones(3)), ValueError, r"^num_items must be a number > 0 or a real tensor of one element"),
        (dict(labels=torch.full((7,), 13)), ValueError, r"^labels must lie in \[0, V\) = \[0, 13\) or equal ignore_index = -100, got 13"),
        (dict(labels=torch.full((7,), -3)), ValueError, r"^labels must lie in \[0, V\) .* got -3"),
        (dict(W=a["W"][None]), ValueError, r"^W must have shape \(V, d\) \(2-D\), got \(1, 13, 6\)"),
        (dict(h=a["h"].long()), TypeError, r"^h must have dtype in \(float32, float64, bfloat16, float16\), got int64"),
        (dict(label_smoothing=-0.1), ValueError, r"^label_smoothing must lie in \[0, 1\], got -0.1"),
        (dict(label_smoothing=float("nan")), ValueError, r"^label_smoothing must be finite, got nan"),
        (dict(softcap=-2.0), ValueError, r"^softcap must be a finite number > 0, got -2.0"),
        (dict(num_items=0), ValueError, r"^num_items must be a finite number > 0, got 0"),
        (dict(num_items=torch.tensor(0.0)), ValueError, r"^num_items must be a finite number > 0, got 0.0"),
        (dict(num_items="4"), TypeError, r"^num_items must be a real number, got str"),
    ]


CASES: dict[str, OpCase] = {
    "rms_norm": OpCase(
        _rms_make, lambda a: (wk.rms_norm(**a),),
        dict(default=[(1, 3), (7,), (37, 192), (5, 760), (2, 3, 50), (1151, 33)],
             triton=[(1, 3), (3, 7), (9, 130), (2, 3, 50)], gradcheck=[(2, 3, 9)], threads=[(3001, 320)],
             views=[(30, 20)], dynamic=[(2, 3, 16), (2, 5, 16)], concurrent=[(64, 200)], gpu=[(5, 33)],
             layer=[(3, 5, 8)]),
        (Public("rms_norm", wk.RMSNormFunction, _rms_calls, _rms_bad),),
        variants=(dict(shift=True), dict(shift=False)),
        oracle=lambda a: (rms_oracle(a["x"], a["weight"], a["shift"], a["eps"]),), views=_rms_views),
    "srpe": OpCase(
        _srpe_make, lambda a: wk.srpe(**a),
        # (B, H, H_kv, T, d_h): T = 1, odd B, H/H_kv in {1, 4}, d_h not a power of two, 64, 128
        dict(default=[(1, 1, 1, 1, 6), (3, 4, 1, 7, 10), (3, 4, 4, 5, 66), (2, 4, 1, 9, 64), (1, 2, 2, 3, 128)],
             triton=[(1, 1, 1, 1, 6), (3, 4, 1, 7, 10), (1, 2, 2, 3, 128)], gradcheck=[(3, 2, 1, 3, 4)],
             threads=[(2, 4, 2, 300, 64)], views=[(2, 4, 2, 37, 16), (3, 2, 1, 5, 66), (1, 4, 4, 1, 64)],
             dynamic=[(2, 2, 1, 3, 4), (2, 2, 1, 5, 4)], concurrent=[(2, 4, 2, 33, 16)], gpu=[(2, 4, 2, 7, 16)],
             layer=[(2, 4, 2, 5, 8)]),
        (Public("srpe", wk.SRPEFunction, _srpe_calls, _srpe_bad),),
        variants=(dict(), dict(max_position=256), dict(params=(500.0, 3.0, 0.3, 0.05))),
        layer_variant=dict(max_position=256),
        oracle=_srpe_oracle, views=_srpe_views, in_place=("cpu", "triton"),
        # float64 at positions ~2^20: the angle p·ω itself carries ~1e-10 of rounding (SPEC §9)
        tol=lambda dtype, a: srpe_tolerance(dtype, a["position_ids"], a["spiral_divisor"])),
    "add_rms_norm": OpCase(
        _add_make, lambda a: wk.add_rms_norm(**a),
        dict(default=[(1, 3), (37, 192), (2, 3, 50), (7,)], triton=[(3, 37), (2, 5)], gradcheck=[(2, 5), (2, 3, 4)],
             threads=[(601, 96)], views=[(30, 20), (7, 33)], dynamic=[(2, 3, 16), (2, 5, 16)],
             concurrent=[(64, 200)], gpu=[(5, 33)], layer=[(3, 5, 8)]),
        (Public("add_rms_norm", wk.AddRMSNormFunction, _add_calls, _add_bad),),
        variants=(dict(shift=True), dict(shift=False)),
        view_variants=(dict(residual="transposed"), dict(residual="half")),
        oracle=lambda a: add_rms_norm_oracle(a["x"], a["residual"], a["weight"], a["shift"], a["eps"]),
        views=_add_views),
    "glu": OpCase(
        _glu_make, lambda a: (wk.glu(**a),),
        # six shapes: the six (activation, layout) pairs; n not a multiple of any vector width;
        # Triton's n = 1100: more than one column tile in every dtype (BLOCK_N ≤ 1024)
        dict(default=[(1, 3), (37, 40), (2, 5, 130), (7,), (3, 2, 17), (5, 33)],
             triton=[(3, 37), (1, 3), (2, 5), (5,), (2, 2, 9), (4, 6), (3, 1100)], gradcheck=[(2, 3)] * 6,
             threads=[(301, 100)], dynamic=[(2, 3, 16), (2, 5, 16)], concurrent=[(64, 200)], gpu=[(5, 33)],
             layer=[(3, 5, 8)]),
        (Public("glu", wk.GLUFunction, _glu_calls, _glu_bad),),
        variants=tuple(dict(activation=act, layout=layout) for layout in _GLU_LAYOUTS for act in ("gelu_tanh", "silu")),
        oracle=lambda a: (glu_oracle(a["a"], a["b"], a["activation"]),)),
    "linear_cross_entropy": OpCase(
        _lce_make, lambda a: (wk.linear_cross_entropy(**a),),
        # (N, d, V); the lists cycle the variants
        dict(default=[(7, 6, 13), (37, 16, 75), (1, 8, 5), (64, 32, 300), (9, 3, 1000), (2, 1, 2)],
             triton=[(7, 6, 13), (5, 4, 9), (9, 8, 37)], gradcheck=[(6, 4, 7)] * 6,
             dynamic=[(6, 8, 11), (9, 8, 11)], concurrent=[(64, 32, 300)], gpu=[(33, 64, 1000)], threads=[(300, 64, 1000)], layer=[(7, 6, 13)]),
        (Public("linear_cross_entropy", wk.LinearCrossEntropyFunction, _lce_calls, _lce_bad),),
        variants=(dict(), dict(options=True), dict(reduction="none"), dict(options=True), dict(),
                  dict(reduction="none", options=True)),
        layer_variant=dict(options=True),
        oracle=_lce_oracle, kind="attention",
        out_dtype=lambda dtype: torch.float64 if dtype == F64 else torch.float32),  # SPEC §10.1: a float32 loss
    "gcla_attention": OpCase(
        _gcla_make, lambda a: (wk.gcla_attention(**a),),
        # (B, H, H_kv, T, d_h, S, Λ', lengths): odd B, rows of length 0 and 1, Λ' ∈ {0, 1, 2}, GQA
        # pairs where h mod H_kv and h // (H/H_kv) differ ((6, 3), (4, 2)), d_h not a power of two
        # (T = 1, where dq̃ = dk̃ = 0 exactly: tests/test_gcla_attention.py).
        # The C++ kernel's blocks are 64 query × 128 key rows (T = 257: five and three, lengths off
        # their edges); the interpreter's are 32 × 16 (dk/dv: 16 × 32); cuda_emu takes d_h 64, 128.
        dict(default=[(3, 4, 1, 2, 16, 1, 1, (2, 0, 1)), (3, 6, 3, 7, 24, 7, 2, (7, 3, 0)),
                      (2, 4, 2, 7, 10, 1, 0, None), (2, 4, 2, 40, 64, 1, 2, (37, 40)), (2, 4, 4, 64, 16, 64, 1, (64, 23)),
                      (2, 4, 1, 257, 8, 257, 2, (250, 100)), (1, 6, 3, 257, 8, 1, 2, None)],
             triton=[(3, 6, 3, 20, 16, 1, 2, (20, 9, 0)), (2, 4, 2, 7, 64, 7, 0, None), (2, 6, 3, 33, 16, 1, 2, (33, 20)),
                     (2, 4, 1, 40, 8, 40, 1, (17, 40)), (1, 2, 2, 20, 24, 20, 2, None)],
             cuda_emu=[(2, 4, 1, 2, 64, 1, 1, (2, 0)), (2, 6, 3, 7, 128, 1, 2, (7, 4)), (2, 4, 2, 257, 64, 257, 2, (254, 86)),
                       (1, 6, 3, 257, 64, 1, 0, None)],
             gradcheck=[(2, 2, 1, 5, 4, 1, 2, (5, 2))], threads=[(2, 4, 2, 200, 24, 1, 3, (200, 77))],
             views=[(2, 6, 3, 21, 64, 21, 2, (21, 0)), (2, 4, 2, 9, 64, 9, 2, None)],
             dynamic=[(2, 2, 1, 3, 4, 3, 2, (3, 1)), (2, 2, 1, 5, 4, 5, 2, (5, 2))],
             concurrent=[(1, 4, 2, 40, 16, 40, 2, None)], gpu=[(2, 4, 2, 19, 64, 19, 2, (19, 14))], layer=[(2, 4, 2, 5, 64, 5, 2, (5, 2))]),
        (Public("gcla_attention", wk.GCLAAttentionFunction, _gcla_calls, _gcla_bad),),
        view_variants=(dict(), dict(broadcast_grad=True)),
        oracle=_gcla_oracle, views=_gcla_views, in_place=("cpu", "triton"), kind="attention"),
    "atm": OpCase(
        _atm_make, _atm_call,
        # (B, T, d): T = 1, B = 0, odd B; T across the CUDA kernels' 8-token and 16-token blocks, d odd
        # (their element-wise path) and across the C++ unmerge backward's 512-column blocks
        dict(default=[(1, 1, 16), (0, 4, 16), (3, 7, 16), (2, 37, 24), (5, 20, 33), (2, 9, 520)],
             threads=[(1, 257, 48)],  # one row: 1 thread streams it, 2 threads run the phased steps
             views=[(3, 19, 16)], dynamic=[(2, 6, 16), (2, 9, 16)],
             concurrent=[(2, 50, 24)], gpu=[(3, 21, 48)]),
        (Public("atm_merge", wk.ATMMergeFunction, _merge_calls, _merge_bad, make=_merge_make),
         Public("atm_unmerge", wk.ATMUnmergeFunction, _unmerge_calls, _unmerge_bad, make=_unmerge_make)),
        oracle=_atm_oracle, views=_atm_views),
}
WITH_ORACLE = [op for op in dispatch.ops() if op in CASES and CASES[op].oracle is not None]

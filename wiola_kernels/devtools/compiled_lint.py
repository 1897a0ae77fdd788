"""Lint of compiled Triton kernels, read from the compiler's own output (``gpu-report``).

Two hazards no interpreter test can see, found in the text Triton leaves in
``compiled.asm`` (no GPU, no Triton import here: plain text in, findings out):

* **32-bit address products** (:func:`i32_address_products`, on the TTIR): an ``arith.muli``
  on ``i32`` that multiplies an *index* (derived from ``tl.program_id``, a loop induction
  variable, or a value loaded from memory) by a *size* (derived from an integer kernel
  argument: a stride, a row count), whose result reaches the offset of a ``tt.addptr``.
  ``rows * stride`` of that kind wraps once the product passes 2³¹ (T ≥ 1,048,576 rows at a
  row stride of 2,048). Not flagged: a ``tl.arange`` tile (bounded by its constexpr width)
  times a stride — the base offset of the tile carries the unbounded part in 64 bits — and
  products of sizes or of constants. A product in ``i64`` (an index widened with
  ``.to(tl.int64)`` first) is not flagged; one widened *after* the product still is.
* **Narrow stores where the layout allows 128-bit ones** (:func:`narrow_stores`, on the
  TTGIR and the PTX): a ``tt.store`` whose tile gives each thread ≥ 16 bytes, ≥ 16 bytes
  along its contiguous dimension (so a 128-bit store per thread fits), lowered to
  ``st.global`` instructions (one-to-one with the SASS ``STG``) of 32 bits or fewer: the
  compiler could not prove the address 16-byte aligned. Matched by source line (``loc`` in
  the TTGIR, ``.loc`` in the PTX). gpu-report applies it to memory-bound kernels at the
  bench shapes, whose sizes and strides are multiples of 16 (so only the kernel's own
  addressing can leave a store unaligned).

Both parsers read the textual IR that Triton 3.6 and 3.9 print (SSA names ``%0`` or
``%rows_12``; multi-result ``%x:3`` used as ``%x#1``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ------------------------------------------------------------------------------ locations

_LOC_ALIAS = re.compile(r"^(#loc\d*)\s*=\s*loc\((.*)\)\s*$")
_LOC_FILE = re.compile(r'"([^"]+)":(\d+)(?::\d+)?')


def _loc_aliases(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in map(_LOC_ALIAS.match, text.splitlines()) if m}


def _resolve_loc(body: str, aliases: dict[str, str], depth: int = 0) -> tuple[str, int] | None:
    """``(file, line)`` of a ``loc(...)`` body: a call site's callee, a named location's
    inner one, or ``"file":line:col``."""
    if depth > 50:
        return None
    m = re.match(r'\s*callsite\(\s*(#loc\d*|"[^"]*"[^ ]*)', body)
    if m:
        inner = m.group(1)
        return _resolve_loc(aliases.get(inner, inner), aliases, depth + 1)
    m = re.match(r'\s*"[^"]*"\((#loc\d*)\)\s*$', body)  # a named location: "rows"(#loc12)
    if m:
        return _resolve_loc(aliases.get(m.group(1), ""), aliases, depth + 1)
    m = _LOC_FILE.search(body)
    if m:
        return m.group(1), int(m.group(2))
    m = re.search(r"#loc\d*", body)
    if m and m.group(0) in aliases:
        return _resolve_loc(aliases[m.group(0)], aliases, depth + 1)
    return None


def _line_loc(line: str, aliases: dict[str, str]) -> tuple[str, int] | None:
    m = re.search(r"\bloc\((#loc\d*)\)\s*$", line)
    if m:
        return _resolve_loc(aliases.get(m.group(1), ""), aliases)
    m = re.search(r"\bloc\((.*)\)\s*$", line)
    return _resolve_loc(m.group(1), aliases) if m else None


def _short(loc: tuple[str, int] | None) -> str:
    return "?" if loc is None else f"{loc[0].rsplit('/', 1)[-1]}:{loc[1]}"


# ------------------------------------------------------------------------------ TTIR

_VALUE = re.compile(r"%[\w.$-]+(?:#\d+)?")
_RESULT = re.compile(r'^\s*(%[\w.$-]+)(?::(\d+))?\s*=\s*"?([\w.]+)"?(.*)$')


def _strip_loc(text: str) -> str:
    i = text.rfind(" loc(")
    return text[:i] if i >= 0 else text


def _result_type(rest: str) -> str:
    body = _strip_loc(rest)
    i = body.rfind(" : ")
    return body[i + 3:] if i >= 0 else ""


def _is_i32(ty: str) -> bool:
    return bool(re.fullmatch(r"\s*(i32|tensor<[\dx]*xi32(,.*)?>)\s*", ty))


@dataclass(frozen=True)
class Finding:
    """One lint finding: which check, where in the source, what it says."""

    check: str      # "i32-address-product" | "narrow-store"
    where: str      # "gcla_attention.py:212"
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class _Op:
    results: list[str]
    name: str
    operands: list[str]
    type: str
    loc: tuple[str, int] | None
    defines: list[tuple[str, str]]  # (value, flag source) block arguments it defines: loop variables


def _parse_function(text: str):
    """``(args {name: type}, ops, yields)`` of the first ``tt.func`` of a TTIR module: every op
    with its results and operands, and for every ``scf.yield`` (and loop init) the values it
    passes on: ``[(sources, [receivers])]``. Sibling regions may reuse SSA names, so every
    definition gets a scope-unique id (``%name@N``) and uses resolve innermost scope first."""
    aliases = _loc_aliases(text)
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if re.match(r"\s*tt\.func\b", l))
    sig = lines[start]
    args = {}
    for m in re.finditer(r"(%[\w.$-]+)\s*:\s*([^{,()]+?(?:<[^>]*>)?)\s*(?:\{[^}]*\})?\s*(?:loc\([^)]*\)\)?)?\s*[,)]",
                         sig[sig.index("(") + 1:]):
        args[m.group(1)] = m.group(2).strip()
    scopes: list[dict[str, str]] = [{name: name for name in args}]
    counter = [0]

    def define(name: str, scope: dict) -> str:
        counter[0] += 1
        scope[name] = f"{name}@{counter[0]}"
        return scope[name]

    def use(name: str) -> str:
        for scope in reversed(scopes):
            if name in scope:
                return scope[name]
        return name + "@?"  # a block argument of a reduction region: untracked

    ops: list[_Op] = []
    yields: list[tuple[list[str], list[str]]] = []
    # Open regions, innermost last: (op, results, iter args); the function's own body first.
    stack: list[tuple[str, list[str], list[str]]] = [("tt.func", [], [])]
    scopes.append({})
    for line in lines[start + 1:]:
        stripped = line.strip()
        if stripped.startswith("}"):
            owner = stack.pop()
            scopes.pop()
            if re.match(r"}\s*else\s*{", stripped):
                stack.append(owner)  # the else region of the same scf.if
                scopes.append({})
            if not stack:
                break
            continue
        loc = _line_loc(line, aliases)
        m = _RESULT.match(line)
        if m:
            base, count, name, rest = m.group(1), m.group(2), m.group(3), m.group(4)
            names = [f"{base}#{i}" for i in range(int(count))] if count else [base]
        else:
            m2 = re.match(r'^\s*"?([a-z_][\w.]*)"?(.*)$', line)
            if not m2:
                continue  # a block label (^bb0(...)) or blank
            names, name, rest = [], m2.group(1), m2.group(2)
        body = _strip_loc(rest)
        opens = stripped.endswith("{")  # a region follows: `{`, or `({` in the generic form
        if name == "scf.for":
            fm = re.match(r"\s*(%[\w.$-]+)\s*=\s*(%[\w.$-]+(?:#\d+)?)\s+to\s+(%[\w.$-]+(?:#\d+)?)\s+step\s+"
                          r"(%[\w.$-]+(?:#\d+)?)(.*)", body)
            if fm:
                operands = [use(fm.group(i)) for i in (2, 3, 4)]
                inits = re.findall(r"(%[\w.$-]+)\s*=\s*(%[\w.$-]+(?:#\d+)?)", fm.group(5))
                init_ids = [use(init) for _, init in inits]
                results = [define(n, scopes[-1]) for n in names]
                scopes.append({})
                iv = define(fm.group(1), scopes[-1])
                iter_args = [define(a, scopes[-1]) for a, _ in inits]
                for a, init in zip(iter_args, init_ids):
                    yields.append(([init], [a]))
                ops.append(_Op(results, name, operands, "", loc, [(iv, "loop")]))
                stack.append((name, results, iter_args))
                continue
        if name == "scf.yield":
            _, res, iters = stack[-1]
            for i, v in enumerate(_VALUE.findall(body.split(" : ")[0])):
                receivers = ([res[i]] if i < len(res) else []) + ([iters[i]] if i < len(iters) else [])
                yields.append(([use(v)], receivers))
            continue
        operands = [use(v) for v in _VALUE.findall(body.split(" : ")[0])]
        results = [define(n, scopes[-1]) for n in names]
        ops.append(_Op(results, name, operands, _result_type(rest), loc, []))
        if opens:
            stack.append((name, results, []))  # its block arguments (^bb0(...)) stay untracked
            scopes.append({})
    return args, ops, yields


def i32_address_products(ttir: str) -> list[Finding]:
    """Every ``i32`` product of an index and a size that reaches a ``tt.addptr`` offset (see
    the module docstring), once per source line."""
    args, ops, yields = _parse_function(ttir)
    flags: dict[str, frozenset] = {}
    for name, ty in args.items():
        if re.fullmatch(r"i\d+", ty):
            flags[name] = frozenset({("size", name.lstrip("%"))})
    products: dict[str, tuple[_Op, frozenset]] = {}  # muli result -> (op, size names)

    def get(v):
        return flags.get(v, frozenset())

    changed = True
    passes = 0
    while changed and passes < 50:
        changed = False
        passes += 1

        def put(v, f):
            nonlocal changed
            old = flags.get(v, frozenset())
            if not f <= old:
                flags[v] = old | f
                changed = True

        for op in ops:
            for v, _ in op.defines:
                put(v, frozenset({("index", "loop")}))
            if op.name in ("tt.get_program_id",):
                new = frozenset({("index", "program_id")})
            elif op.name == "tt.make_range":
                new = frozenset({("range", "arange")})
            elif op.name in ("arith.constant", "tt.get_num_programs"):
                new = frozenset({("size", "num_programs")}) if op.name == "tt.get_num_programs" else frozenset()
            elif op.name == "tt.load":
                new = frozenset({("index", "load")}) if re.search(r"\bi(32|64)\b|xi(32|64)>", op.type) else frozenset()
            elif op.name in ("arith.cmpi", "arith.cmpf") or op.name.startswith("tt.store"):
                new = frozenset()
            elif op.name == "tt.addptr":
                new = frozenset()  # a pointer: products feeding it are reported here, not downstream
            else:
                new = frozenset().union(*(get(v) for v in op.operands)) if op.operands else frozenset()
                if op.name == "arith.muli" and _is_i32(op.type) and len(op.operands) == 2:
                    a, b = (get(v) for v in op.operands)
                    for x, y in ((a, b), (b, a)):
                        if any(k == "index" for k, _ in x) and any(k == "size" for k, _ in y):
                            sizes = frozenset(n for k, n in y if k == "size")
                            products[op.results[0]] = (op, sizes)
                            new = new | {("product", op.results[0])}
                            break
            for r in op.results:
                put(r, new)
        for sources, receivers in yields:
            f = frozenset().union(*(get(v) for v in sources))
            for r in receivers:
                put(r, f)

    reached: dict[str, set] = {}
    for op in ops:
        if op.name == "tt.addptr" and len(op.operands) >= 2:
            for k, name in get(op.operands[1]):
                if k == "product":
                    reached.setdefault(name, set())
    out: dict[str, Finding] = {}
    for name in reached:
        op, sizes = products[name]
        where = _short(op.loc)
        idx = sorted({n for v in op.operands for k, n in get(v) if k == "index"})
        msg = (f"32-bit product of an index ({', '.join(idx)}) and {', '.join(sorted(sizes))} "
               f"({op.type.strip()}) reaches a pointer offset: it wraps past 2^31; widen the index "
               "to int64 first, or offset a 64-bit base by a tl.arange tile")
        out.setdefault(where, Finding("i32-address-product", where, msg))
    return [out[k] for k in sorted(out)]


# ------------------------------------------------------------------------------ stores

_LAYOUT = re.compile(r"^(#[\w]+)\s*=\s*#ttg\.blocked<\{(.*)\}>\s*$")


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _blocked_layouts(ttgir: str) -> dict[str, tuple[list[int], list[int]]]:
    """``{#name: (sizePerThread, order)}`` of the module's blocked layouts."""
    out = {}
    for line in ttgir.splitlines():
        m = _LAYOUT.match(line.strip())
        if m:
            spt = re.search(r"sizePerThread\s*=\s*\[([^\]]*)\]", m.group(2))
            order = re.search(r"order\s*=\s*\[([^\]]*)\]", m.group(2))
            if spt and order:
                out[m.group(1)] = (_ints(spt.group(1)), _ints(order.group(1)))
    return out


def _layout_of(encoding: str, blocked: dict) -> tuple[list[int], list[int]] | None:
    """(sizePerThread, order) of a blocked layout or a (nested) slice of one."""
    encoding = encoding.strip()
    if encoding in blocked:
        return blocked[encoding]
    m = re.match(r"#ttg\.slice<\{dim\s*=\s*(\d+),\s*parent\s*=\s*(.*)\}>$", encoding)
    if not m:
        return None
    parent = _layout_of(m.group(2), blocked)
    if parent is None:
        return None
    dim = int(m.group(1))
    spt, order = parent
    spt = spt[:dim] + spt[dim + 1:]
    order = [o - (o > dim) for o in order if o != dim]
    return spt, order


_ELEM_BITS = {"f64": 64, "i64": 64, "f32": 32, "i32": 32, "bf16": 16, "f16": 16, "i16": 16, "i8": 8, "i1": 8,
              "f8E4M3FN": 8, "f8E5M2": 8}


def _store_tiles(ttgir: str) -> list[tuple[tuple[str, int] | None, int, int]]:
    """``[(source line, bytes per thread, bytes along the contiguous dimension)]`` of every
    tensor ``tt.store`` of the TTGIR: what its tile would allow, whatever layout the
    compiler gave it (the layout follows what the compiler could prove about alignment)."""
    aliases = _loc_aliases(ttgir)
    blocked = _blocked_layouts(ttgir)
    m = re.search(r'"ttg\.num-warps"\s*=\s*(\d+)', ttgir)
    t = re.search(r'"ttg\.threads-per-warp"\s*=\s*(\d+)', ttgir)
    threads = (int(m.group(1)) if m else 4) * (int(t.group(1)) if t else 32)
    out = []
    for line in ttgir.splitlines():
        if not re.match(r"\s*tt\.store\b", line):
            continue
        m = re.search(r":\s*tensor<([\dx]+)x!tt\.ptr<(\w+)>,\s*(.*)>\s*loc\(", line)
        if not m:
            continue
        shape = _ints(m.group(1).replace("x", " "))
        bits = _ELEM_BITS.get(m.group(2), 32)
        layout = _layout_of(m.group(3), blocked)
        inner = layout[1][0] if layout and layout[1] and len(layout[1]) == len(shape) else len(shape) - 1
        numel = 1
        for n in shape:
            numel *= n
        out.append((_line_loc(line, aliases), numel * bits // 8 // threads, shape[inner] * bits // 8))
    return out


def _ptx_store_bits(ptx: str) -> dict[tuple[str, int], list[int]]:
    """``{(file, line): [bits of each st.global]}`` from the PTX and its ``.loc`` directives."""
    files = {int(m.group(1)): m.group(2) for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M)}
    out: dict[tuple[str, int], list[int]] = {}
    current = None
    for line in ptx.splitlines():
        m = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)\s+\d+", line)
        if m:
            current = (files.get(int(m.group(1)), "?"), int(m.group(2)))
            continue
        m = re.search(r"\bst\.global(?:\.[\w]+)*?(?:\.v(\d))?\.(?:b|u|s|f)(\d+)\b", line)
        if m and current is not None:
            out.setdefault(current, []).append(int(m.group(1) or 1) * int(m.group(2)))
    return out


def narrow_stores(ttgir: str, ptx: str) -> list[Finding]:
    """Every ``tt.store`` whose tile gives each thread ≥ 16 bytes and is ≥ 16 bytes along its
    contiguous dimension, but whose ``st.global`` instructions are 32 bits or narrower (see
    the module docstring)."""
    ptx_bits = _ptx_store_bits(ptx)
    out: dict[str, Finding] = {}
    for loc, per_thread, inner_bytes in _store_tiles(ttgir):
        if min(per_thread, inner_bytes) < 16 or loc is None:
            continue
        widths = [w for (f, ln), ws in ptx_bits.items() if ln == loc[1] and f.endswith(loc[0].rsplit("/", 1)[-1])
                  for w in ws]
        if widths and max(widths) <= 32:
            where = _short(loc)
            out.setdefault(where, Finding(
                "narrow-store", where,
                f"stores of {max(widths)} bits where the tile gives each thread {per_thread} bytes, contiguous "
                "along its last dimension: the address is not provably 16-byte aligned (an offset or stride "
                "not a multiple of 16 bytes?)"))
    return [out[k] for k in sorted(out)]

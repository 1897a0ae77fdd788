#!/usr/bin/env python3
"""The bugs planted in test-only copies of the CUDA kernels: the one table.

Each plant rewrites one site of ``csrc/cuda/<source>.cu`` so that it reads a switch of
``csrc/tests/planted.h`` (``WIOLA_PLANT(kFlag)``); with every switch off a copy is the
shipped kernel. Two consumers, and each plant must be caught by both:

* the emulator (``wiola_cuda_emu_planted <name>`` in CMakeLists.txt, planted_main in
  csrc/tests/cuda_emu_test.cpp): a wrong result under some thread order, a guard-page or
  alignment fault, a divergent barrier, a NaN read from never-written (0xFF) memory;
* compute-sanitizer on a GPU (``scripts/planted_gpu.sh``, csrc/tests/planted_gpu.cu): the
  tool named here must report it, and the unplanted copy must run clean under every tool.

    python3 csrc/tests/planted_bugs.py --list          one line per plant: name, tool, flag, what
    python3 csrc/tests/planted_bugs.py --names         the names, space-separated
    python3 csrc/tests/planted_bugs.py --races         the names of the data races (TSan reports them)
    python3 csrc/tests/planted_bugs.py --write DIR     DIR/<source>_planted.cu for each source

Stdlib only: CMake runs it at configure time, the GPU image runs it bare.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Plant:
    name: str      # the ctest / planted_gpu mode
    tool: str      # the compute-sanitizer tool that must report it
    flag: str      # its switch in planted.h
    source: str    # csrc/cuda/<source>.cu
    site: str      # the shipped text (must occur exactly once)
    planted: str   # the text with the switch
    what: str
    race: bool = False  # a data race (the ThreadSanitizer build reports it; other plants need the plain build)


PLANTS = [
    Plant("missing-sync", "racecheck", "kMissingSync", "gcla_attention",
          "if (lane == 0) gate_s[warp] = gate_acc;\n  __syncthreads();",
          "if (lane == 0) gate_s[warp] = gate_acc;\n  if (!WIOLA_PLANT(kMissingSync)) __syncthreads();",
          "GCLA summary backward: thread 0 sums the warps' gate partials in shared memory without the barrier "
          "after they are written", race=True),
    Plant("select-race", "racecheck", "kSelectRace", "atm",
          "if (threadIdx.x == 0) taken_shared[0] = last_taken;\n    __syncthreads();",
          "if (threadIdx.x == 0) taken_shared[0] = last_taken;\n    if (!WIOLA_PLANT(kSelectRace)) __syncthreads();",
          "ATM select: each thread reads the previous thread's taken flag in shared memory without the barrier "
          "after the flags are written", race=True),
    Plant("overrun", "memcheck", "kLookAhead", "atm",
          "const bool look_ahead = t0 + n < T;",
          "const bool look_ahead = WIOLA_PLANT(kLookAhead) ? t0 + n <= T : t0 + n < T;",
          "ATM norms_and_dots: the look-ahead token one past a row's last (<= for <): past the end of x in the "
          "last row"),
    Plant("misaligned", "memcheck", "kIgnoreAlignment", "atm",
          "bool rows_vectorizable(int64_t d, const void* a, const void* b) {\n",
          "bool rows_vectorizable(int64_t d, const void* a, const void* b) {\n"
          "  if (WIOLA_PLANT(kIgnoreAlignment)) return d % kPerChunk<scalar_t> == 0;\n",
          "ATM rows_vectorizable without its base-address test: 16-byte vector accesses at 4 mod 16"),
    Plant("divergent-barrier", "synccheck", "kDivergentBarrier", "gcla_attention",
          "for (int i = 0; i < V; ++i) hs[j * DH + i * 32] = acc[j][i];\n    }\n    __syncthreads();\n",
          "for (int i = 0; i < V; ++i) hs[j * DH + i * 32] = acc[j][i];\n"
          "      if (WIOLA_PLANT(kDivergentBarrier)) __syncthreads();\n    }\n"
          "    if (!WIOLA_PLANT(kDivergentBarrier)) __syncthreads();\n",
          "GCLA summary backward, S = 1: the barrier between the two halves' sums moved into the writing half "
          "(the reading half waits at the next __syncthreads instead)"),
    Plant("unwritten-partial", "initcheck", "kUnwrittenPartial", "gcla_attention",
          "  if (threadIdx.x == 0) {\n    float g = 0.f;",
          "  if (threadIdx.x == 0 && !(WIOLA_PLANT(kUnwrittenPartial) && t0 >= len)) {\n    float g = 0.f;",
          "GCLA summary backward: a block whose rows are all padding writes no gate partial, which dgate_kernel "
          "then reads (never-written global memory)"),
]

SOURCES = sorted({p.source for p in PLANTS})


def planted_source(source: str) -> str:
    """csrc/cuda/<source>.cu with every plant of it switched by planted.h."""
    text = (ROOT / "csrc" / "cuda" / f"{source}.cu").read_text()
    for p in PLANTS:
        if p.source != source:
            continue
        count = text.count(p.site)
        if count != 1:
            raise SystemExit(f"planted_bugs.py: the site of plant {p.name} occurs {count} times in "
                             f"csrc/cuda/{source}.cu (expected once): update the table\n{p.site}")
        text = text.replace(p.site, p.planted)
    return '#include "planted.h"\n' + text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--list", action="store_true")
    group.add_argument("--names", action="store_true")
    group.add_argument("--races", action="store_true")
    group.add_argument("--write", metavar="DIR", type=Path)
    args = ap.parse_args(argv)
    if args.list:
        for p in PLANTS:
            print(f"{p.name}\t{p.tool}\t{p.flag}\t{p.what}")
    elif args.names:
        print(" ".join(p.name for p in PLANTS))
    elif args.races:
        print(" ".join(p.name for p in PLANTS if p.race))
    else:
        args.write.mkdir(parents=True, exist_ok=True)
        for source in SOURCES:
            out = args.write / f"{source}_planted.cu"
            text = planted_source(source)
            if not out.exists() or out.read_text() != text:  # unchanged files keep their time stamps
                out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

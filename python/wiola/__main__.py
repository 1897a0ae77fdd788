"""``python -m wiola {train,generate,bench}`` (see ``--help`` of each)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m wiola COMMAND [options]

commands:
  train      train the tiny preset on the shipped English text (torchrun-ready)
  generate   continue a prompt from a checkpoint: generate --checkpoint DIR "prompt"
  bench      training-step benchmark: fused vs reference backends, ATM on vs off
  eval       perplexity of a text file: eval --text FILE [--model DIR]
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .train import main as train_main

        train_main(rest)
    elif command == "generate":
        from .train import generate_main

        generate_main(rest)
    elif command == "eval":
        from .evaluate import main as eval_main

        eval_main(rest)
    elif command == "bench":
        from .bench import main as bench_main

        bench_main(rest)
    else:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

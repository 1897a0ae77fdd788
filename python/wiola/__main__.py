"""``python -m wiola {train,generate,bench,eval}`` (see ``--help`` of each)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m wiola COMMAND [options]

commands:
  train      train the tiny preset on the shipped English text (torchrun-ready)
  generate   continue a prompt from a checkpoint: generate --checkpoint DIR "prompt"
  bench      training-step benchmark: fused vs reference backends, ATM on vs off
  eval       perplexity of a text file: eval --text FILE [--model DIR]

Run python -m wiola COMMAND --help for a command's options. A mistake prints one line
and exits with status 2 (WIOLA_TRACEBACK=1 shows the traceback).
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a command; no command prints the usage and exits with status 2."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .train import main as run_command
    elif command == "generate":
        from .train import generate_main as run_command
    elif command == "eval":
        from .evaluate import main as run_command
    elif command == "bench":
        from .bench import main as run_command
    else:
        print(f"python -m wiola: error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from wiola_kernels.cli import run

    def go() -> int:
        run_command(rest)  # returns its results (losses, text, records) for Python callers
        return 0

    return run(f"python -m wiola {command}", go)


if __name__ == "__main__":
    sys.exit(main())

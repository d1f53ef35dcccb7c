"""`vllm-oscar` command line: one subcommand per module in vllm_oscar.commands.

Each command module defines ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their command runs, so
``vllm-oscar --help`` stays fast and needs neither vLLM nor transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

#: subcommand name -> (module under vllm_oscar.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bits": ("bits", "bits per element of an OSCAR configuration at given context lengths"),
    "eval": ("eval", "quality of OSCAR vs BF16 and baselines on held-out text, with exact bits"),
    "calibrate": ("calibrate", "calibrate OSCAR rotations for a model (or import RotationZoo files)"),
    "info": ("info", "summary of a rotation file"),
    "env": ("env", "what this machine gives OSCAR (versions, plugin, GPUs, plan tables, rotations) and its problems"),
    "bench": ("bench", "OSCAR decode benchmark on a CUDA GPU: vs BF16 SDPA and paged BF16 Triton"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-oscar", description="OSCAR 2-bit KV cache for vLLM: tools."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage / the error and exits
        return 2
    module_name, help_text = COMMANDS[argv[0]]
    module = importlib.import_module(f"vllm_oscar.commands.{module_name}")
    command_parser = argparse.ArgumentParser(prog=f"vllm-oscar {argv[0]}", description=help_text)
    module.add_arguments(command_parser)
    return int(module.run(command_parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())

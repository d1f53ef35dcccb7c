"""`vllm-oscar env`: what this machine gives OSCAR (versions, plugin, GPUs and kernels, plan tables, rotations,
variables; with --model, the rotation file the backend would load for that model) and the problems found, each with
its fix. Exit status 1 when there is a problem."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE ('-': stdout only)")
    parser.add_argument("--model", help="also check a model (Hugging Face folder): the rotation file the backend "
                                        "would load for it, checked against its shapes")
    parser.add_argument("--rotations", help="with --model: the rotation file you would pass (oscar.rotations)")


def run(args: argparse.Namespace) -> int:
    from vllm_oscar.environment import collect, report_json, report_lines

    if args.rotations and not args.model:
        print("vllm-oscar env: error: --rotations is checked against a model: give --model too.", file=sys.stderr)
        return 2
    report = collect(args.model, args.rotations)
    if args.json == "-":
        json.dump(report_json(report), sys.stdout, indent=2)
        print()
    else:
        print("\n".join(report_lines(report)))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(report_json(report), handle, indent=2)
    return 1 if report.problems else 0

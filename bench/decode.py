#!/usr/bin/env python3
"""OSCAR decode benchmark (CUDA GPU). Same as `vllm-oscar bench decode ...`; see
vllm_oscar/commands/bench.py for the options, e.g.

    python bench/decode.py decode --json decode.json --png decode.png
    python bench/decode.py tune --geometry qwen3-8b --contexts 32768 --batches 1 32
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_oscar.commands import bench  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bench/decode.py", description=bench.__doc__)
    bench.add_arguments(parser)
    sys.exit(bench.run(parser.parse_args()))

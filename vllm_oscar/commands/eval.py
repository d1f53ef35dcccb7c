"""`vllm-oscar eval`: OSCAR against BF16 and baselines on held-out text, with exact bits.

Writes the JSON (--json), and beside it a markdown table (.md) and a plot (.png): the
JSON and table after every method, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_oscar.config import DEFAULT_CALIBRATION_SEQ_LEN, DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_oscar.evaluation.variants import ALL_METHODS, BASELINES

    parser.add_argument("--model", required=True, help="Hugging Face model folder (e.g. from smollm2_folder())")
    parser.add_argument("--rotations", default=None, help="rotation file for the method oscar-file")
    parser.add_argument("--data", nargs="+", required=True, help="text corpora (.txt or .txt.xz); held-out part used")
    parser.add_argument("--calib-data", nargs="+", default=None,
                        help="corpora for the OSCAR variants' calibration (default: --data)")
    parser.add_argument("--json", required=True, help="output JSON; .md and .png are written beside it")
    parser.add_argument("--methods", nargs="+", default=list(BASELINES), choices=ALL_METHODS, metavar="METHOD",
                        help=f"methods (default: the baselines); known: {' '.join(ALL_METHODS)}")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--num-seqs", type=int, default=4)
    parser.add_argument("--sink", type=int, default=DEFAULT_SINK_TOKENS)
    parser.add_argument("--recent", type=int, default=DEFAULT_RECENT_TOKENS)
    parser.add_argument("--stress", action="store_true",
                        help="also measure with the stress windows (4 sink / 16 recent)")
    parser.add_argument("--calib-tokens", type=int, default=32768)
    parser.add_argument("--calib-seq-len", type=int, default=DEFAULT_CALIBRATION_SEQ_LEN)
    parser.add_argument("--clip-sequences", type=int, default=4, help="calibration sequences kept for the clip search")
    parser.add_argument("--passkey", type=int, nargs="*", default=[], metavar="LEN", help="passkey haystack lengths")
    parser.add_argument("--passkey-depths", type=float, nargs="+", default=[0.25, 0.5, 0.75], metavar="D",
                        help="where the key sits in the haystack, as a fraction of it")
    parser.add_argument("--greedy-prompts", type=int, default=0, help="prompts for greedy-generation agreement")
    parser.add_argument("--greedy-new-tokens", type=int, default=64)
    parser.add_argument("--passkey-methods", nargs="+", default=None, metavar="METHOD",
                        help="run passkey only for these methods (default: all of --methods)")
    parser.add_argument("--greedy-methods", nargs="+", default=None, metavar="METHOD",
                        help="run greedy agreement only for these methods (default: all of --methods)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="sequences per forward pass in the perplexity metrics (GPU: 8)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no new (stage, method) after this many seconds; skipped work is "
                             "listed in the JSON (meta.skipped)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice). On a CPU shared with other "
                             "runs, 1 can be many times faster: 2 threads on 2 loaded cores made the "
                             "quantizer 25x slower in one measurement (docs/notes/quality.md)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def run(args: argparse.Namespace) -> int:
    from vllm_oscar.evaluation.report import markdown_table, plot
    from vllm_oscar.evaluation.runner import EvalSettings, run_evaluation

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    settings = EvalSettings(
        model=args.model, data=args.data, seq_len=args.seq_len, num_seqs=args.num_seqs, sink=args.sink,
        recent=args.recent, stress=args.stress, calib_data=args.calib_data, calib_tokens=args.calib_tokens,
        calib_seq_len=args.calib_seq_len, clip_sequences=args.clip_sequences,
        passkey_lengths=args.passkey, passkey_depths=args.passkey_depths,
        greedy_prompts=args.greedy_prompts, greedy_new_tokens=args.greedy_new_tokens,
        device=args.device, dtype=args.dtype, rotations=args.rotations, batch_size=args.batch_size,
        passkey_methods=args.passkey_methods, greedy_methods=args.greedy_methods, max_seconds=args.max_seconds,
    )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    plotted_stages = [-1]

    def write(doc: dict) -> None:
        """JSON and table of what is measured so far (after every method); the plot
        after every finished stage (it takes about a second)."""
        out.write_text(json.dumps(doc, indent=2))
        out.with_suffix(".md").write_text(markdown_table(doc))
        stages = len(doc["meta"]["stages_done"])
        if stages != plotted_stages[0]:
            plot(doc, out.with_suffix(".png"))
            plotted_stages[0] = stages

    doc = run_evaluation(settings, args.methods, checkpoint=write)
    write(doc)
    print(markdown_table(doc))
    return 0

#!/usr/bin/env python3
"""A picture of gluon_decode's per-program timelines kept by `bench/split_timeline.py --raw DIR`: per cell, the
split programs' end times as histograms, one per dispatch tier (split_timeline.dispatch_tiers: an SM's programs in
grid order, SCHEDULERS_PER_SM to a tier), and the window programs' end times; no GPU needed.

    python bench/split_timeline_plot.py docs/perf/session31/raw_even/*.npz --out timeline_tiers.png
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from split_timeline import dispatch_tiers, relative_stamps  # noqa: E402


def end_times_by_tier(raw: np.ndarray, num_splits: int) -> tuple[list[np.ndarray], np.ndarray]:
    """([split program end times (us) of tier t for t = 0, 1, ...], window program end times (us)) of one launch;
    raw: [B, Hkv, programs, 5] as split_timeline.save_raw keeps it. Times after the first program's start."""
    ends = relative_stamps(raw)[..., 3] / 1000.0
    tiers = dispatch_tiers(raw[..., 4])
    split_ends, split_tiers = ends[:, :, :num_splits].reshape(-1), tiers[:, :, :num_splits].reshape(-1)
    by_tier = [split_ends[split_tiers == t] for t in range(int(split_tiers.max()) + 1)]
    return [ends for ends in by_tier if ends.size], ends[:, :, num_splits:].reshape(-1)


def plot(paths: list[str], out: str) -> None:
    """One panel per .npz file (its folder and name as the title), written as a PNG to out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(paths), 1, figsize=(9, 2.4 * len(paths)), squeeze=False)
    for ax, path in zip(axes[:, 0], paths):
        kept = np.load(path)
        by_tier, windows = end_times_by_tier(kept["raw"], kept["tiles"].shape[-1])
        top = max(float(windows.max()) if windows.size else 0.0, max(float(e.max()) for e in by_tier))
        bins = np.linspace(0.0, top, 80)
        for tier, ends in enumerate(by_tier):
            ax.hist(ends, bins=bins, histtype="step", linewidth=1.4, label=f"tier {tier} (mean {ends.mean():.1f} us)")
        if windows.size:
            ax.hist(windows, bins=bins, histtype="stepfilled", color="0.8", label="window programs")
        folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
        ax.set_title(f"{folder}/{os.path.splitext(os.path.basename(path))[0]}", fontsize=10)
        ax.set_ylabel("programs")
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("end time after the first program's start (us)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", nargs="+", help=".npz files of split_timeline.py --raw")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args()
    missing = [path for path in args.raw if not os.path.isfile(path)]
    if missing:
        parser.error(f"no such file: {', '.join(missing)} (write them with bench/split_timeline.py --raw DIR)")
    plot(args.raw, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

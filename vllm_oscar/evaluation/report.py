"""Markdown table and PNG plot (quality vs bits per element) of an evaluation JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(doc: dict[str, Any]) -> str:
    """One row per method: bits, standard-window metrics, stress, passkey, greedy."""
    settings, methods = doc["settings"], doc["methods"]
    base_ppl = methods["bf16"].get("ppl")
    has_stress = any("stress" in m for m in methods.values())
    lengths = sorted({k for m in methods.values() for k in m.get("passkey", {})}, key=int)
    has_greedy = any("greedy_prefix" in m for m in methods.values())
    header = ["method", "body bits", f"BPE@{settings['seq_len']}", "KL (nats)", "ppl", "Δppl", "top-1"]
    if has_stress:
        header += [f"stress KL ({settings['stress_sink']}/{settings['stress_recent']})", "stress ppl", "stress top-1"]
    header += [f"passkey {n}" for n in lengths]
    if has_greedy:
        header.append(f"greedy prefix (/{settings['greedy_new_tokens']})")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, m in methods.items():  # methods not measured (yet) show "-"
        delta = f"{100 * (m['ppl'] / base_ppl - 1):+.1f}%" if "ppl" in m and base_ppl else "-"
        row = [
            f"`{name}`", f"{m['body_bits']:.3f}", f"{m['bpe']:.3f}", _fmt(m.get("kld"), ".4f"),
            _fmt(m.get("ppl"), ".3f"), delta, _fmt(m.get("top1"), ".3f"),
        ]
        if has_stress:
            s = m.get("stress", {})
            row += [_fmt(s.get("kld"), ".4f"), _fmt(s.get("ppl"), ".3f"), _fmt(s.get("top1"), ".3f")]
        row += [_fmt(m.get("passkey", {}).get(n), ".2f") for n in lengths]
        if has_greedy:
            row.append(_fmt(m.get("greedy_prefix"), ".1f"))
        lines.append("| " + " | ".join(row) + " |")
    meta = doc["meta"]
    lines.append("")
    lines.append(
        f"{meta['device']}, commit {meta['commit']}, {meta['date_utc']} UTC, torch {meta['torch']}, "
        f"transformers {meta['transformers']}; model {settings['model']} ({settings['dtype']}); data "
        f"{', '.join(Path(p).name for p in settings['data'])} (held-out part), {settings['num_seqs']} x "
        f"{settings['seq_len']} tokens; windows {settings['sink']}/{settings['recent']}; scored: "
        f"{meta['scored_positions']}; {meta.get('seconds', '-')} s."
    )
    if meta.get("skipped"):
        lines.append(f"Not run (time budget): {', '.join(meta['skipped'])}.")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """PNG: KL and perplexity against body bits, one labelled point per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = {n: m for n, m in doc["methods"].items() if n != "bf16" and "kld" in m}
    panels = [("kld", "KL(BF16 || method), nats/token", True), ("ppl", "perplexity", True)]
    if all("stress" in m for m in methods.values()):
        panels.append(("stress", "stress-window KL, nats/token", True))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5))
    for ax, (key, label, log) in zip(axes, panels):
        for name, m in methods.items():
            y = m["stress"]["kld"] if key == "stress" else m[key]
            color = "tab:red" if name.startswith("oscar") else "tab:blue"
            ax.scatter(m["body_bits"], y, color=color)
            ax.annotate(name, (m["body_bits"], y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if key == "ppl" and "ppl" in doc["methods"]["bf16"]:
            ax.axhline(doc["methods"]["bf16"]["ppl"], color="k", ls="--", lw=1, label="BF16")
            ax.axhline(1.05 * doc["methods"]["bf16"]["ppl"], color="gray", ls=":", lw=1, label="BF16 +5%")
            ax.legend(fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("body bits per K/V element (scale/zero/norm included)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    settings = doc["settings"]
    fig.suptitle(
        f"{Path(settings['model']).name}: {settings['num_seqs']} x {settings['seq_len']} held-out tokens, "
        f"windows {settings['sink']}/{settings['recent']} "
        f"(stress {settings['stress_sink']}/{settings['stress_recent']}); "
        f"{doc['meta']['device']}, {doc['meta']['commit']}"
    , fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

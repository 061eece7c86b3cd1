"""Report: terminal table (rich), JSON with provenance, PNG plot (matplotlib)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import torch

PATH_ORDER = ("per_token", "grouped", "per_token_pad64")


def provenance(interpreted: bool) -> dict:
    """Command, git revision, GPU, date and versions for the JSON header."""
    try:
        rev = os.environ.get("GIT_REV") or subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL, cwd=os.path.dirname(__file__)).strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    import triton

    return {
        "command": " ".join(["sparse-mla", *sys.argv[1:]]),
        "git_revision": rev,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU, Triton interpreter)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timings_meaningful": not interpreted,
        "timing": "triton.testing.do_bench: CUDA events, L2 flushed between runs, median (p20/p80 kept)"
        if not interpreted else "one wall-clock run under TRITON_INTERPRET=1: not a performance number",
    }


def print_table(rows: list[dict], interpreted: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sparse-mla bench: time per path (ms), useful TFLOP/s, speedups" +
                  (" [INTERPRETER: timings not meaningful]" if interpreted else ""))
    for col in ("scenario", "H", "union", "auto", "per_token", "grouped", "pad64", "grp/pt", "grp/pad64", "pt/pad64",
                "union ms", "max err"):
        table.add_column(col, justify="right")
    for r in rows:
        p = r["paths"]

        def cell(name: str, p: dict = p) -> str:
            return f"{p[name]['ms']:.3f} ({p[name]['tflops']:.0f})" if name in p else "-"

        pad = p.get("per_token_pad64")
        table.add_row(
            r["scenario"], str(r["heads"]), f"{r['union_ratio']:.2f}", r["auto_path"],
            cell("per_token"), cell("grouped"), cell("per_token_pad64"),
            f"{p['grouped']['speedup_vs_per_token']:.2f}x",
            f"{pad['ms'] / p['grouped']['ms']:.2f}x" if pad else "-",
            f"{pad['ms'] / p['per_token']['ms']:.2f}x" if pad else "-",
            f"{r['union_build_ms']:.3f}",
            f"{max(v['rel_err'] for v in p.values()):.1e}",
        )
    Console().print(table)


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)


def plot(path: str, rows: list[dict], interpreted: bool) -> None:
    """Time per path vs prompt length (pure prefills, cached == 0), one panel per model/TP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["tp"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, (model, tp) in zip(axes[0], keys):
        pts = sorted((r for r in rows if r["model"] == model and r["tp"] == tp and r["cached"] == 0), key=lambda r: r["tokens"])
        for name in PATH_ORDER:
            xs = [r["tokens"] for r in pts if name in r["paths"]]
            ys = [r["paths"][name]["ms"] for r in pts if name in r["paths"]]
            if xs:
                ax.plot(xs, ys, marker="o", label=name)
        ax.set_title(f"{model}, TP{tp} ({pts[0]['heads'] if pts else '?'} heads/rank)")
        ax.set_xlabel("prompt tokens (pure prefill)")
        ax.set_ylabel("ms per layer" + (" (interpreter, not meaningful)" if interpreted else ""))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

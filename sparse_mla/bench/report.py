"""Report of ``sparse-mla bench``: its JSON's meta, terminal table (rich, through ``sparse_mla.bench.common``'s
renderer; compact to fit 80 columns, or ``wide``), README markdown table, PNG plot (matplotlib). rich and matplotlib
(the ``bench`` extra) are imported inside the functions.

JSON (``common.write_json``): {"meta": ``provenance`` (kind "layer") + run settings + ``FIELD_NOTES``, "rows": [row,
...]}, one row per scenario as ``runner.run_scenario`` returns it (keys described in ``FIELD_NOTES``).
``sparse_mla.bench.kinds`` renders it, and the JSON of every other bench, for ``sparse-mla report``.
"""

from __future__ import annotations

import math
import os
import sys

from .baselines import DEQUANT_NAME, PAD64_NAME, PATH_COLUMNS
from .common import load, make_table, markdown_cells, print_tables, rows_fit, run_meta, timing_note

SHORT = {"dense_mha": "dense", "masked_mha": "masked", "mqa_grouped": "grouped", "mqa_per_token": "per_tok",
         "mqa_per_token_pad64": "pad64", DEQUANT_NAME: "deq+bf16"}

# What the row keys mean (copied into the JSON's meta, so the file explains itself).
FIELD_NOTES = {
    "row": "scenario, model, tp, heads (per rank), dims, cached, new (= T), topk, kv_rows (N), useful_tflop, work_ratio "
           "(MHA FLOPs over causal windows / sparse FLOPs over top-k), floor_ms, group_size, union_ratio, union_build, "
           "union_backend, chosen_path, chosen_reason, chosen_ms, chosen_tflops, chosen_speedup_vs_per_token, "
           "chosen_speedup_vs_pad64, best_path, max_rel_err, failures, paths",
    "paths": "per path (dense_mha, masked_mha, mqa_grouped, mqa_per_token, mqa_per_token_pad64): supported, reason; when "
             "supported: rel_err, check_ok, ms (median of the trial medians), p20_ms / p80_ms (median over trials of each "
             "trial's 20 % / 80 % quantile: the spread within a trial), min_ms / max_ms (fastest / slowest trial median: the "
             "spread across trials), trials_ms (each trial's median), tflops, speedup_vs_per_token, speedup_vs_pad64 (None "
             "without a pad64 run, H >= 64); error if it raised a RuntimeError (out of memory, a CUDA error)",
    "best_path": "the fastest dispatcher path (sparse_mla.layer.dispatch.PATH_NAMES) whose check passed; never the pad64 "
                 "baseline",
    "chosen": "chosen_path = sparse_mla.layer.explain(step), the dispatcher's automatic choice (SPARSE_MLA_PATH ignored); "
              "chosen_ms is the time of that path measured in this run with path= forced, not a separate run",
    "mqa_per_token_pad64": "baseline, not a dispatcher path: absorbed q zero-padded to 64 heads (FlashMLA's minimum on "
                           "Hopper), our per-token kernel on all 64, W_UV on the real heads",
    "tflops": "useful TFLOP/s = sparse_mla.layer.dispatch.sparse_work(step) / ms: 2 H (kv_lora + qk_rope + kv_lora) "
              "sum_t min(topk, window_t), the same work for every path",
    "floor_ms": "max(sparse_work / 790 TFLOP/s, per-token gathered latent bytes / 4.3 TB/s) (H200)",
    "union_ratio": "kernel level: mean union rows of G = 128 // H consecutive queries (groups inside the request) / mean "
                   "valid rows per query; union_build: time of group plan + union builder without the overlap guard (ms, per "
                   "trial); union_backend: the builder sparse_mla.union.backends chose (cuda_smem or triton)",
    "rel_err": "relative Frobenius error vs the fp32 layer reference dsa_prefill_ref on 3 chunks of <= 16 tokens (start, "
               "middle, end), out NaN-poisoned before the call; check_ok = rel_err < check_tol, the dtype's tolerance "
               "(sparse_mla.bench.check.CHECK_TOLERANCE: bf16 1e-2, fp16 2e-3)",
    "kv_format": "meta.kv_format: None (the cache in the run's dtype) or fp8_ds_mla (--kv-dtype fp8: the cache quantized "
                 "once with ue8m0 scales, every path on it; rel_err is then against the reference on the dequantized "
                 "cache, rows and paths add rel_err_vs_bf16_cache / max_rel_err_vs_bf16_cache against the unquantized "
                 "cache's, the pad64 baseline dequantizes the windows first, and mqa_per_token_dequant = dequantize the "
                 "windows to bf16, then the bf16 per-token kernel)",
}


def path_columns(rows: list[dict]) -> tuple[str, ...]:
    """The path columns of a table of ``rows``: ``PATH_COLUMNS``, plus ``DEQUANT_NAME`` when some row has it
    (an FP8 cache run)."""
    extra = (DEQUANT_NAME,) if any(DEQUANT_NAME in r.get("paths", {}) for r in rows) else ()
    return (*PATH_COLUMNS, *extra)


def provenance(interpreted: bool, trials: int, kind: str = "layer") -> dict:
    """The JSON's meta (``common.run_meta``): its ``kind`` (``sparse_mla.bench.kinds``: what ``sparse-mla report``
    renders), the ``sparse-mla`` command, revision, GPU, date, versions, the timing method (``common.timing_note``),
    ``timings_meaningful``, ``trials`` and ``FIELD_NOTES``."""
    return run_meta(kind, command=" ".join(["sparse-mla", *sys.argv[1:]]),
                    timing=timing_note(trials=trials, interpreted=interpreted), timings_meaningful=not interpreted,
                    trials=trials, fields=FIELD_NOTES)


def _ms(v: float | None) -> str:
    """3 significant digits, at most 5 characters for times from 0.001 to 99999 ms."""
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v:.3g}" if v < 1000 else f"{v:.0f}"


def _ratio(v: float) -> str:
    return f"{v:.2f}" if math.isfinite(v) else "-"


def _x(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}x" if v < 10 else f"{v:.3g}x"


def _err(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def _path_ms(r: dict, name: str) -> str:
    rec = r["paths"].get(name, {})
    if "error" in rec:
        return "ERR"
    return _ms(rec.get("ms")) + ("!" if rec.get("check_ok") is False else "")


TABLE_CAPTION = {
    False: "chosen = the dispatcher's choice, ms its time; per_tok = mqa_per_token ms; vs pt / vs 64 = the chosen "
           "path's speedup over mqa_per_token / over pad64 (q padded to 64 heads); ! = failed check; --wide: every path",
    True: "chosen = dispatcher's choice; vs pt / vs 64 = its speedup over mqa_per_token / over pad64 (q padded to 64 "
          "heads)",
}


def table_cells(rows: list[dict], wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """(head, cells) of the terminal table of bench rows. Compact (fits 80 columns): scenario, H, chosen path, its
    ms, mqa_per_token ms, the chosen path's speedups vs per-token and vs pad-64, max rel err. ``wide``: union ratio
    and the ms of every path ("-" where unsupported, "!" after a failed check, ERR if it raised) as well."""
    if not wide:
        head = ["scenario", "H", "chosen", "ms", "per_tok", "vs pt", "vs 64", "max err"]
        cells = [[r["scenario"], str(r["heads"]), SHORT.get(r["chosen_path"], "-"), _ms(r["chosen_ms"]),
                  _path_ms(r, "mqa_per_token"), _x(r["chosen_speedup_vs_per_token"]), _x(r["chosen_speedup_vs_pad64"]),
                  _err(r["max_rel_err"])] for r in rows]
        return head, cells
    cols = path_columns(rows)
    head = ["scenario", "H", "union", "chosen (ms)", *(SHORT[p] for p in cols), "vs pt", "vs 64", "max err"]
    cells = [[r["scenario"], str(r["heads"]), _ratio(r["union_ratio"]),
              f"{SHORT.get(r['chosen_path'], '-')} {_ms(r['chosen_ms'])}", *(_path_ms(r, p) for p in cols),
              _x(r["chosen_speedup_vs_per_token"]), _x(r["chosen_speedup_vs_pad64"]), _err(r["max_rel_err"])]
             for r in rows]
    return head, cells


def bench_table(rows: list[dict], interpreted: bool, wide: bool = False):
    """The rich table of ``table_cells`` with its title and caption."""
    title = "sparse-mla bench: ms per layer call" + (" [INTERPRETER: timings not meaningful]" if interpreted else "")
    head, cells = table_cells(rows, wide)
    return make_table(title, head, cells, caption=TABLE_CAPTION[wide], left=(0,) if wide else (0, 2),
                      failed=[bool(r.get("failures")) for r in rows])


def print_table(rows: list[dict], interpreted: bool, width: int | None = None, wide: bool = False) -> None:
    """The terminal table of bench rows (``table_cells``: compact, fits 80 columns; ``wide``: every path).
    ``width``: the console's (``print_tables``)."""
    print_tables(bench_table(rows, interpreted, wide), width=width, wide=wide)


def markdown_table(rows: list[dict]) -> str:
    """The README table of a bench JSON's rows: ms per layer call (useful TFLOP/s of the chosen
    path), every path's ms, speedups of the chosen path, union figures, max rel err."""
    cols = path_columns(rows)
    fp8 = any("max_rel_err_vs_bf16_cache" in r for r in rows)
    head = ["scenario", "H", "union ratio (G)", "chosen path", "chosen ms (TFLOP/s)",
            *(f"{p} ms" for p in cols), "chosen vs per_token", "chosen vs pad-64", "union build ms", "max rel err",
            *(["max rel err vs bf16 cache"] if fp8 else [])]
    cells = []
    for r in rows:
        tf = r.get("chosen_tflops")
        cells.append([r["scenario"], str(r["heads"]), f"{_ratio(r['union_ratio'])} ({r['group_size']})",
                      r["chosen_path"] or "-", f"{_ms(r['chosen_ms'])} ({tf:.0f})" if tf is not None else "-",
                      *(_path_ms(r, p) for p in cols), _x(r["chosen_speedup_vs_per_token"]),
                      _x(r["chosen_speedup_vs_pad64"]), _ms(r["union_build"]["ms"]), _err(r["max_rel_err"]),
                      *([_err(r.get("max_rel_err_vs_bf16_cache"))] if fp8 else [])])
    return markdown_cells(head, cells)


def bench_rows(doc: object, path: str) -> tuple[dict, list[dict]]:
    """(meta, rows) of a loaded single-GPU ``sparse-mla bench`` JSON.

    Raises:
        ValueError: not the layer bench's layout (``path`` names the file in the message).
    """
    _, meta, rows = load(doc, path)
    if not rows_fit(rows, "layer"):
        raise ValueError(f"{path}: not a `sparse-mla bench` JSON (expected rows[] with 'paths' and 'chosen_path')")
    return meta, rows


def plot(path: str, rows: list[dict], interpreted: bool) -> dict:
    """One panel per model / TP of every layer path and the pad-64 baseline, the dispatcher's chosen path
    marked (a black ring on its point, or a black-edged hatched bar): ms per layer call vs prompt length
    (pure prefills, log x and y) where a panel has at least two pure-prefill points, else grouped bars per
    scenario (cached + new). The title says when the times come from the Triton interpreter.

    Returns:
        what was drawn, for tests: {"title": str, "panels": [{"title", "kind" ("lines" or "bars"),
        "x": scenario labels or token counts, "chosen": chosen path per x}]}.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    keys = list(dict.fromkeys((r["model"], r["tp"]) for r in rows))
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(6 * max(len(keys), 1), 5.2), squeeze=False)
    cols = path_columns(rows)
    colors = {name: f"C{i}" for i, name in enumerate(cols)}
    drawn, legend = [], {}  # one legend for the figure, below the panels
    for ax, (model, tp) in zip(axes[0], keys):
        mine = [r for r in rows if r["model"] == model and r["tp"] == tp]
        pure = sorted((r for r in mine if r["cached"] == 0), key=lambda r: r["new"])
        if len(pure) >= 2:
            for name in cols:
                xy = [(r["new"], r["paths"][name]["ms"]) for r in pure if "ms" in r["paths"].get(name, {})]
                if xy:
                    ax.plot(*zip(*xy), marker="o", color=colors[name],
                            linestyle="--" if name in (PAD64_NAME, DEQUANT_NAME) else "-", label=name)
            chosen = [(r["new"], r["chosen_ms"]) for r in pure if r.get("chosen_ms") is not None]
            if chosen:
                ax.scatter(*zip(*chosen), s=160, facecolors="none", edgecolors="black", linewidths=1.8, zorder=5,
                           label="chosen path (dispatcher)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens (pure prefill)")
            drawn.append({"title": "", "kind": "lines", "x": [r["new"] for r in pure],
                          "chosen": [r.get("chosen_path") for r in pure]})
        else:
            labels = [f"{r['cached']}+{r['new']}" if r["cached"] else str(r["new"]) for r in mine]
            names = [n for n in cols if any("ms" in r["paths"].get(n, {}) for r in mine)]
            width = 0.8 / max(len(names), 1)
            for j, name in enumerate(names):
                for i, r in enumerate(mine):
                    rec = r["paths"].get(name, {})
                    if "ms" not in rec:
                        continue
                    is_chosen = name == r.get("chosen_path")
                    ax.bar(i + (j - (len(names) - 1) / 2) * width, rec["ms"], width, color=colors[name],
                           edgecolor="black" if is_chosen else "none", linewidth=2 if is_chosen else 0,
                           hatch="//" if is_chosen else None)
            ax.set_xticks(range(len(mine)), labels)
            ax.set_xlabel("scenario: new tokens, or cached + new")
            for n in names:
                legend.setdefault(n, Patch(color=colors[n], label=n))
            legend["chosen path (dispatcher)"] = Patch(facecolor="white", edgecolor="black", hatch="//", linewidth=2,
                                                       label="chosen path (dispatcher)")
            drawn.append({"title": "", "kind": "bars", "x": labels, "chosen": [r.get("chosen_path") for r in mine]})
        heads = mine[0]["heads"] if mine else "?"
        drawn[-1]["title"] = f"{model}, TP{tp} ({heads} heads/rank)"
        ax.set_title(drawn[-1]["title"])
        ax.set_ylabel("ms per layer call")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        if drawn[-1]["kind"] == "lines":
            for h, lab in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(lab, h)
    if legend:
        fig.legend(handles=list(legend.values()), loc="lower center", ncol=min(len(legend), 6), fontsize=8, frameon=False)
    title = ("Triton interpreter run on the CPU (fp16): the times are NOT performance numbers" if interpreted
             else "sparse-mla bench: ms per layer call (GPU)")
    fig.suptitle(title, color="firebrick" if interpreted else "black")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"title": title, "panels": drawn}


__all__ = ["provenance", "print_table", "table_cells", "bench_table", "markdown_table", "bench_rows", "plot", "FIELD_NOTES",
           "SHORT", "path_columns"]

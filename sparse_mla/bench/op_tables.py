"""The op bench's tables (``sparse_mla.bench.op``, ``sparse_mla.bench.op_decode``), rendered by ``sparse-mla report``
(``sparse_mla.bench.kinds``) from the JSON that ``op.main`` / ``sparse-mla bench --op-suite`` wrote.

Up to three tables, each drawn only from the rows it concerns:

* the op table: the prefill-shaped calls (``sparse_mla_fwd`` per token / grouped / auto, ``flash_mla_sparse_fwd``,
  the baseline) of ``op.run_case`` rows;
* the decode table: ``flash_mla_with_kvcache`` (this package's drop-in) against FlashMLA's sparse decode, of
  ``op_decode.run_decode_case`` rows (``api`` = "flash_mla_with_kvcache");
* the kv-splits table: of every row that timed forced split counts (``split1``, ``split2``, ...): the automatic S
  (``kv_splits_auto``), the automatic call's time (``auto``, or ``drop_in`` for decode rows), each forced S's time and
  the fastest forced S that passed its check (what ``sparse_mla.mqa.kv_splits.KV_SPLIT_MODEL`` is fitted on).

Compact tables fit 80 columns (only the case name may fold); ``wide``: more columns. "!" after a failed check, ERR
for a call that raised, "-" for one that did not run. Imports nothing at module level beyond the standard library and
``common``.
"""

from __future__ import annotations

from .common import fmt, make_table, markdown_cells, render_text

DECODE_API = "flash_mla_with_kvcache"  # the ``api`` of op_decode's rows
PREFILL_CALLS = ("per_token", "grouped", "auto", "drop_in")  # the op table's call columns (then the baseline)
COMPACT_COLUMNS = ("case", "per_token", "grouped", "auto", "base", "auto vs", "max err")  # fits 80 columns
WIDE_COLUMNS = ("case", "T", "union (G)", "per_token", "grouped", "auto", "drop_in", "base", "baseline", "auto vs",
                "floor pt", "floor grp", "max err", "auto host us", "auto graph")
DECODE_COMPACT = ("case", "drop_in", "graph", "S", "base", "base gr", "vs base", "max err")
DECODE_WIDE = ("case", "T", "drop_in", "graph", "S", "best split", "base", "base gr", "baseline", "vs base", "gr vs base",
               "floor", "max err", "lse err", "host us")


def is_decode(row: dict) -> bool:
    """Whether a row is ``op_decode``'s (the decode call) rather than ``op.run_case``'s."""
    return row.get("api") == DECODE_API


def split_calls(rows: list[dict]) -> list[str]:
    """The forced-split call names of the rows (``split<S>``), by S."""
    names = {n for r in rows for n in r.get("calls", {}) if n.startswith("split") and n[5:].isdigit()}
    return sorted(names, key=lambda n: int(n[5:]))


def _ms_cell(rec: dict | None) -> str:
    """A call's ms ("!" after a failed check), ERR if it raised, "-" where it did not run."""
    if not rec:
        return "-"
    if "error" in rec:
        return "ERR"
    return fmt(rec.get("ms"), ".3g") + ("!" if rec.get("ok") is False else "")


def _speedup(v: float | None) -> str:
    return "-" if v is None else fmt(v, ".2f") + "x"


def _graph_cell(rec: dict | None) -> str:
    """A call's CUDA-graph replay ms ("!" after a failed check of the replay's output), ERR if the capture raised,
    "-" where none ran (off a GPU, or the call raised)."""
    if not rec or "error" in rec:
        return "-"
    if "graph_error" in rec:
        return "ERR"
    return fmt(rec.get("graph_ms"), ".3g") + ("!" if rec.get("graph_ok") is False else "")


def _failed(row: dict) -> bool:
    """Whether a call of the row failed its check or raised (its CUDA-graph replay's too)."""
    return any(rec.get("ok") is False or rec.get("graph_ok") is False or "error" in rec
               for rec in row.get("calls", {}).values())


def _max_err(row: dict, key: str = "max_row_err") -> str:
    errs = [rec[key] for rec in row.get("calls", {}).values() if rec.get(key) is not None]
    return (fmt(max(errs), ".1e") if errs else "-") + ("!" if _failed(row) else "")


def _row_figures(row: dict) -> dict[str, str]:
    calls = row.get("calls", {})
    union = "-" if row.get("union_ratio") is None else f"{row['union_ratio']:.2f} ({row.get('group_size')})"
    floors_ms = row.get("floor_ms", {})
    return {"case": row["case"], "T": str(row.get("tokens", "-")), "union (G)": union,
            **{name: _ms_cell(calls.get(name)) for name in PREFILL_CALLS},
            "base": _ms_cell(calls.get("flashmla")), "baseline": row.get("baseline", "-"),
            "auto vs": _speedup(calls.get("auto", {}).get("vs_flashmla")),
            "floor pt": fmt(floors_ms.get("per_token"), ".3g"), "floor grp": fmt(floors_ms.get("grouped"), ".3g"),
            "max err": _max_err(row), "auto host us": fmt(calls.get("auto", {}).get("host_us"), ".0f"),
            "auto graph": _graph_cell(calls.get("auto"))}


def row_cells(rows: list[dict], wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """(head, cells) of the op table (``op.run_case`` rows; decode rows are left out): ``COMPACT_COLUMNS`` (case, ms
    of per_token / grouped / auto and of the baseline, auto's speedup over the baseline, max row error over the calls)
    or with ``wide`` ``WIDE_COLUMNS`` (tokens, union ratio, drop_in, which baseline ran, the floors, auto's host time
    as well)."""
    head = list(WIDE_COLUMNS if wide else COMPACT_COLUMNS)
    return head, [[fig[h] for h in head] for fig in map(_row_figures, (r for r in rows if not is_decode(r)))]


def _auto_rec(row: dict) -> dict:
    """The automatic-S call of a row: ``drop_in`` for the decode call, ``auto`` for ``sparse_mla_fwd``."""
    return row.get("calls", {}).get("drop_in" if is_decode(row) else "auto", {})


def _split_ms(rec: dict | None) -> str:
    """The kv-splits table's figure of a call: its CUDA-graph replay ms (the device time) where measured, else its
    ms per call."""
    return _graph_cell(rec) if rec and ("graph_ms" in rec or "graph_error" in rec) else _ms_cell(rec)


def split_cells(rows: list[dict], wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """(head, cells) of the kv-splits table, of the rows with forced-split calls: case, the automatic S, the automatic
    call's ms, each forced S's ms (CUDA-graph replays where measured: ``_split_ms``), the fastest checked forced S
    (``best_split``); ``wide``: the reason for S too."""
    rows = [r for r in rows if split_calls([r])]
    names = split_calls(rows)
    head = ["case", "S", "auto", *names, "best"] + (["why S"] if wide else [])
    cells = []
    for r in rows:
        calls = r["calls"]
        cell = [r["case"], str(r.get("kv_splits_auto", "-")), _split_ms(_auto_rec(r)),
                *(_split_ms(calls.get(n)) for n in names), str(r.get("best_split") or "-")]
        cells.append(cell + ([str(r.get("kv_splits_reason", "-"))] if wide else []))
    return head, cells


def _best_split_cell(row: dict) -> str:
    best = row.get("best_split")
    rec = row.get("calls", {}).get(f"split{best}") if best else None
    return "-" if not rec else f"{_split_ms(rec)} ({best})"


def decode_cells(rows: list[dict], wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """(head, cells) of the decode table (``op_decode`` rows): ``DECODE_COMPACT`` (case, the drop-in's ms per call
    and of its CUDA-graph replay, its automatic S, FlashMLA's two, FlashMLA's time over the drop-in's: of the
    replays where both have one, else per call; max row error over the calls) or ``DECODE_WIDE`` (query rows T, the
    fastest forced S, which baseline ran or why none, both ratios, the floor, the max lse error, the drop-in's host
    time as well)."""
    head = list(DECODE_WIDE if wide else DECODE_COMPACT)
    cells = []
    for r in (r for r in rows if is_decode(r)):
        calls = r.get("calls", {})
        drop = calls.get("drop_in", {})
        vs = drop.get("graph_vs_flashmla", drop.get("vs_flashmla"))
        fig = {"case": r["case"], "T": str(r.get("tokens", "-")), "drop_in": _ms_cell(drop), "graph": _graph_cell(drop),
               "S": str(r.get("kv_splits_auto", "-")), "best split": _best_split_cell(r),
               "base": _ms_cell(calls.get("flashmla")), "base gr": _graph_cell(calls.get("flashmla")),
               "baseline": str(r.get("baseline", "-")), "vs base": _speedup(vs if not wide else drop.get("vs_flashmla")),
               "gr vs base": _speedup(drop.get("graph_vs_flashmla")), "floor": fmt(r.get("floor_ms"), ".3g"),
               "max err": _max_err(r), "lse err": _max_err(r, "lse_err"), "host us": fmt(drop.get("host_us"), ".0f")}
        cells.append([fig[h] for h in head])
    return head, cells


CAPTION = ("ms per call; base = the baseline (FlashMLA's sparse prefill, or pad64_sparse_mla where FlashMLA is not "
           "importable: this package's per-token call on q padded to 64 heads); auto vs = the baseline's time over auto's")
DECODE_CAPTION = ("ms per call of flash_mla_with_kvcache (this package's drop-in), graph = of its CUDA-graph replay (the "
                  "device time); S = its automatic kv_splits; base / base gr = FlashMLA's sparse decode (FP8 cache, q "
                  "padded to 64 heads below 64), - where it did not run; vs base = base's time over drop_in's (of the "
                  "replays where measured; --wide: both)")
SPLITS_CAPTION = ("ms of the CUDA-graph replay on a GPU (device time; per call elsewhere) with kv_splits=S forced "
                  "(splitS) beside the automatic S (auto: sparse_mla_fwd, or the decode drop-in); best = the fastest "
                  "forced S that passed its check")


def tables(rows: list[dict], wide: bool = False, interpreted: bool = False) -> list:
    """The rich tables of ``row_cells`` / ``decode_cells`` / ``split_cells`` (each where a row has its calls), then
    the errors of the calls that raised."""
    note = " [INTERPRETER: timings not meaningful]" if interpreted else ""
    more = "" if wide else "; --wide: more"
    out: list = []
    op_rows = [r for r in rows if not is_decode(r)]
    if op_rows:
        head, cells = row_cells(op_rows, wide)
        out.append(make_table("sparse-mla op bench" + note, head, cells, caption=CAPTION + more,
                              left=(0, head.index("baseline")) if wide else (0,), failed=[_failed(r) for r in op_rows]))
    dec_rows = [r for r in rows if is_decode(r)]
    if dec_rows:
        head, cells = decode_cells(dec_rows, wide)
        out.append(make_table("sparse-mla decode bench" + note, head, cells, caption=DECODE_CAPTION + more,
                              left=(0, head.index("baseline")) if wide else (0,), failed=[_failed(r) for r in dec_rows]))
    split_rows = [r for r in rows if split_calls([r])]
    if split_rows:
        head, cells = split_cells(split_rows, wide)
        out.append(make_table("kv splits" + note, head, cells, caption=SPLITS_CAPTION,
                              left=(0, len(head) - 1) if wide else (0,), failed=[_failed(r) for r in split_rows]))
    return out + [f"{row['case']} / {name}: {rec['error']}" for row in rows for name, rec in row.get("calls", {}).items()
                  if "error" in rec]


def format_rows(rows: list[dict], wide: bool = False, width: int | None = None, interpreted: bool = False) -> str:
    """``tables`` as text, ``width`` columns wide (default 80; ``wide``: as wide as the table needs)."""
    return render_text(*tables(rows, wide, interpreted), width=width, wide=wide)


def markdown_rows(rows: list[dict]) -> str:
    """The wide tables (op, decode, kv splits: each where a row has its calls) as markdown tables."""
    parts = []
    if any(not is_decode(r) for r in rows):
        parts.append(markdown_cells(*row_cells(rows, wide=True)))
    if any(is_decode(r) for r in rows):
        parts.append(markdown_cells(*decode_cells(rows, wide=True)))
    if split_calls(rows):
        parts.append(markdown_cells(*split_cells(rows, wide=True)))
    return "\n\n".join(parts)


__all__ = ["COMPACT_COLUMNS", "WIDE_COLUMNS", "DECODE_COMPACT", "DECODE_WIDE", "CAPTION", "is_decode", "split_calls",
           "row_cells", "split_cells", "decode_cells", "tables", "format_rows", "markdown_rows"]

"""The JSON files that the CLI and the bench modules write, by kind, and how ``sparse-mla report`` renders each.

Every writer stamps ``meta["kind"]`` (a key of ``KINDS``); ``sparse_mla.bench.common.load`` reads a file of any age
(older row and meta keys, the kind of an unstamped file told by its rows' keys: ``common.ROW_KEYS``). Each kind renders
as a compact table (fits 80 columns), the full table (``wide``) or markdown (``markdown``; for the layer bench, the
README's table). Imports nothing at module level beyond the standard library and ``common``.
"""

from __future__ import annotations

from .common import ROW_KEYS, load, markdown_cells, print_tables, rows_fit

KINDS = {  # kind -> what writes it
    "layer": "sparse-mla bench",
    "shardq": "sparse-mla bench under torchrun",
    "shardq_layer": "python -m sparse_mla.bench.shardq_layer",
    "kv_fp8": "python -m sparse_mla.bench.kv_fp8",
    "op": "python -m sparse_mla.bench.op or sparse-mla bench --op-suite",
}
INTERPRETER_NOTE = "(Triton interpreter run: the times are not performance numbers)"


def known_kinds() -> str:
    """The kinds and what writes each, on one line (for error messages)."""
    return ", ".join(f"{k} ({what})" for k, what in KINDS.items())


def detect(doc: object, source: str) -> tuple[str, dict, list[dict]]:
    """(kind, meta, rows) of a loaded JSON (``common.load``): its stamped kind, or the one kind its rows fit.

    Raises:
        ValueError: not one of ``KINDS`` (not an object, an unknown stamp, rows of no known shape, or rows that do
            not fit the stamped kind); the message names ``source`` and the kinds ``report`` renders.
    """
    try:
        kind, meta, rows = load(doc, source)
    except ValueError as e:
        raise ValueError(f"{e}; report renders: {known_kinds()}") from e
    stamped = meta.get("kind")
    if stamped is not None:
        if stamped not in KINDS:
            raise ValueError(f"{source}: unknown kind {stamped!r}; report renders: {known_kinds()}")
        if not rows_fit(rows, stamped):
            raise ValueError(f"{source}: meta.kind is {stamped!r}, but its rows[] rows do not all have "
                             f"{', '.join(ROW_KEYS[stamped])}")
    elif kind is None:
        fits = [k for k in ROW_KEYS if rows_fit(rows, k)]
        raise ValueError(f"{source}: not a JSON that `sparse-mla report` renders (no meta.kind, and its rows fit "
                         f"{'none' if not fits else ' and '.join(fits)} of the known shapes); report renders: "
                         f"{known_kinds()}")
    return kind, meta, rows


def _provenance(meta: dict) -> str:
    """GPU, revision, date (and dtype when recorded) of a meta, for the line above a table."""
    rev = str(meta.get("git_revision", "?"))
    bits = [str(meta.get("gpu", "?")), f"rev {rev[:12] if len(rev) == 40 else rev}", str(meta.get("date", "?"))]
    if meta.get("world_size"):
        bits.append(f"{meta['world_size']} ranks")
    if meta.get("dtype"):
        bits.append(str(meta["dtype"]))
    return ", ".join(bits)


def _layer_header(meta: dict, rows: list[dict]) -> str:
    """The layer bench's provenance line (the README's comment above its table)."""
    kinds = sorted({r["pad64_baseline"] for r in rows if r.get("pad64_baseline")})
    baseline = f", pad-64 baseline {' / '.join(kinds)}" if kinds else ""
    cache = f", kv cache {meta['kv_format']}" if meta.get("kv_format") else ""
    return (f"{meta.get('gpu', '?')}, rev {meta.get('git_revision', '?')}, {meta.get('date', '?')}, "
            f"{meta.get('dtype', '?')}{cache}, top-k {meta.get('overlap', '?')}{baseline}")


def _interpreted(kind: str, meta: dict, rows: list[dict]) -> bool:
    if kind in ("shardq", "shardq_layer"):
        return any(r.get("interpreted") for r in rows)
    if kind == "op":  # its meta names the GPU only
        return str(meta.get("gpu", "")).startswith("none")
    return meta.get("timings_meaningful") is False


def _markdown(kind: str, meta: dict, rows: list[dict], source: str) -> str:
    header = _layer_header(meta, rows) if kind == "layer" else f"{kind} ({KINDS[kind]}), {_provenance(meta)}"
    lines = [f"<!-- `sparse-mla report --markdown {source}`: {header} -->"]
    if _interpreted(kind, meta, rows):
        lines.append(INTERPRETER_NOTE + "\n")
    if kind == "layer":
        from .report import markdown_table

        lines.append(markdown_table(rows))
    elif kind == "shardq":
        from .shardq import markdown_shardq

        lines.append(markdown_shardq(rows))
    elif kind == "op":
        from .op import markdown_rows

        lines.append(markdown_rows(rows))
    else:  # kv_fp8, shardq_layer: their wide table
        lines.append(markdown_cells(*_module(kind).row_cells(rows, wide=True)))
    return "\n".join(lines)


def _module(kind: str):
    """The bench module of a kind's rows (kv_fp8, op, shardq_layer)."""
    from importlib import import_module

    return import_module(f"{__package__}.{kind}")


def _tables(kind: str, meta: dict, rows: list[dict], source: str, wide: bool) -> list:
    interpreted = _interpreted(kind, meta, rows)
    header = f"{source}: " + (_layer_header(meta, rows) if kind == "layer" else f"{kind} ({KINDS[kind]}), {_provenance(meta)}")
    if kind == "layer":
        from .report import bench_table

        return [header, bench_table(rows, interpreted, wide)]
    if kind == "shardq":
        from .shardq import shardq_tables

        return [header, *shardq_tables(rows, wide)]
    if kind == "shardq_layer":
        return [header, *_module(kind).tables(rows, wide)]
    return [header, *_module(kind).tables(rows, wide, interpreted)]  # kv_fp8, op


def report(doc: object, source: str, *, wide: bool = False, markdown: bool = False, width: int | None = None) -> None:
    """Print a loaded bench JSON: its provenance line, then its compact tables (each fits 80 columns), with ``wide``
    the full ones (at their own width), with ``markdown`` markdown tables (the layer bench's: the README's table).
    ``width``: the console's (``common.print_tables``).

    Raises:
        ValueError: a JSON that is none of ``KINDS`` (``detect``), or rows that lack a key its tables need.
    """
    kind, meta, rows = detect(doc, source)
    try:
        out = _markdown(kind, meta, rows, source) if markdown else _tables(kind, meta, rows, source, wide)
    except (KeyError, TypeError) as e:  # a hand-edited or truncated file: say so instead of a traceback
        raise ValueError(f"{source}: a {kind} JSON whose rows cannot be rendered ({type(e).__name__}: {e})") from e
    if markdown:
        print(out)
        return
    print_tables(*out, width=width, wide=wide)


__all__ = ["KINDS", "detect", "report", "known_kinds"]

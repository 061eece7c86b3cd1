"""The JSON files that the CLI and the bench modules write, by kind, and how ``sparse-mla report`` renders each.

Every writer stamps ``meta["kind"]`` (a key of ``KINDS``); a file without the stamp (the committed ones under
results/ predate it) is told by its shape (``SHAPES``: where its rows are and which keys every row has). Each kind
renders as a compact table (fits 80 columns), the full table (``wide``) or markdown (``markdown``; for the layer
bench, the README's table). Imports nothing at module level beyond the standard library.
"""

from __future__ import annotations

KINDS = {  # kind -> what writes it
    "layer": "sparse-mla bench",
    "shardq": "sparse-mla bench under torchrun",
    "shardq_layer": "python -m sparse_mla.bench.shardq_layer",
    "kv_fp8": "python -m sparse_mla.bench.kv_fp8",
    "op": "python -m sparse_mla.bench.op or sparse-mla bench --op-suite",
}
# kind -> (the key of the rows in the document, the keys every row has)
SHAPES = {
    "layer": ("results", ("scenario", "heads", "paths", "chosen_path", "chosen_ms")),
    "shardq": ("results", ("model", "tp", "tokens", "variant", "total_ms", "attn_ms", "xchg_q_ms", "xchg_out_ms")),
    "shardq_layer": ("results", ("model", "tp", "tokens", "variant", "chunks", "total_ms", "exposed_exchange_ms")),
    "kv_fp8": ("rows", ("case", "variant")),
    "op": ("rows", ("case", "calls")),  # op.run_case's rows and op_decode's (api "flash_mla_with_kvcache")
}
INTERPRETER_NOTE = "(Triton interpreter run: the times are not performance numbers)"


def _fits(doc: dict, kind: str) -> bool:
    key, needed = SHAPES[kind]
    rows = doc.get(key)
    return (isinstance(rows, list) and bool(rows)
            and all(isinstance(r, dict) and all(k in r for k in needed) for r in rows))


def known_kinds() -> str:
    """The kinds and what writes each, on one line (for error messages)."""
    return ", ".join(f"{k} ({what})" for k, what in KINDS.items())


def detect(doc: object, source: str) -> tuple[str, dict, list[dict]]:
    """(kind, meta, rows) of a loaded JSON: ``meta["kind"]`` when stamped, else the one kind of ``SHAPES`` that its
    rows fit.

    Raises:
        ValueError: not one of ``KINDS`` (an unknown stamp, rows of no known shape, or rows that do not fit the
            stamped kind); the message names ``source`` and the kinds ``report`` renders.
    """
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: not a bench JSON (a {type(doc).__name__}, not an object); report renders: "
                         f"{known_kinds()}")
    meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
    kind = meta.get("kind")
    if kind is not None:
        if kind not in KINDS:
            raise ValueError(f"{source}: unknown kind {kind!r}; report renders: {known_kinds()}")
        if not _fits(doc, kind):
            key, needed = SHAPES[kind]
            raise ValueError(f"{source}: meta.kind is {kind!r}, but its {key}[] rows do not all have "
                             f"{', '.join(needed)}")
    else:
        fits = [k for k in SHAPES if _fits(doc, k)]
        if len(fits) != 1:
            raise ValueError(f"{source}: not a JSON that `sparse-mla report` renders (no meta.kind, and its rows fit "
                             f"{'none' if not fits else ' and '.join(fits)} of the known shapes); report renders: "
                             f"{known_kinds()}")
        kind = fits[0]
    return kind, meta, doc[SHAPES[kind][0]]


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
        from .report import markdown_cells

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
    ``width``: the console's (``report.print_tables``).

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
    from .report import print_tables

    print_tables(*out, width=width, wide=wide)


__all__ = ["KINDS", "SHAPES", "detect", "report", "known_kinds"]

"""The plumbing every benchmark shares, the CLI bench's modules and the scripts under benchmarks/ alike: the device
peaks and the roofline floor, the error metrics, the timing budget, the JSON document (``meta`` block and ``rows``),
the one loader of bench JSON files (old keys included) and the table renderer.

* Peaks: ``PEAK_FLOPS`` / ``PEAK_BYTES`` (the H200's measured dense bf16 matmul and device copy), ``floor_ms``,
  ``tflops``.
* Errors (``rel_err``, ``row_errs`` / ``max_row_err``): relative to the reference; a reference that is all zero
  (the whole tensor, or one row) counts the absolute error instead, so a zero output scores 0 there; any NaN or inf
  in the output or the reference scores ``inf`` (an unwritten NaN-poisoned output fails every tolerance).
* Timing budget: ``WARMUP_MS`` / ``REP_MS`` per ``triton.testing.do_bench`` trial, ``QUANTILES``
  (``sparse_mla.bench.timing`` times with them; a caller that needs another budget passes it and says why).
* JSON: ``{"meta": run_meta(...), "rows": [row, ...], ...}`` (``write_json``); ``load`` / ``read_json`` read every
  bench file, the committed ones with older keys too.
* Tables: ``make_table`` (rich), ``print_tables``, ``render_text``, ``markdown_cells``.

Imports nothing at module level beyond the standard library (torch, triton and rich inside the functions).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# ------------------------------------------------------------------------------------------------- device peaks
PEAK_FLOPS = 790e12  # FLOP/s: dense bf16 tensor-core matmul measured on the H200 (docs/notes/measuring.md)
PEAK_BYTES = 4.3e12  # bytes/s: device-to-device copy measured on the H200 (HBM3e, sustained)
SMS = 132  # streaming multiprocessors of the H200


def floor_ms(flops: float, nbytes: float) -> float:
    """Roofline floor in ms of a call that computes ``flops`` and moves ``nbytes``: the longer of the two at
    ``PEAK_FLOPS`` / ``PEAK_BYTES``."""
    return max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds (NaN for a time <= 0)."""
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else float("nan")


# ------------------------------------------------------------------------------------------------- timing budget
WARMUP_MS = 10  # do_bench warm-up budget per trial (ms)
REP_MS = 50  # do_bench measuring budget per trial (ms): about rep_ms / (one call) runs, at least one
QUANTILES = (0.5, 0.2, 0.8)  # per trial: median, then the 20 % and 80 % quantiles of the runs


def timing_note(*, trials: int = 1, warmup_ms: int = WARMUP_MS, rep_ms: int = REP_MS, interpreted: bool = False) -> str:
    """The ``meta["timing"]`` line of a run timed by ``sparse_mla.bench.timing`` with this budget."""
    if interpreted:
        return "one wall-clock run under TRITON_INTERPRET=1: not a performance number"
    return (f"{trials} trial(s) of triton.testing.do_bench(warmup={warmup_ms} ms, rep={rep_ms} ms): CUDA events, L2 "
            f"flushed between runs, quantiles {list(QUANTILES)} per trial; ms = median of the trial medians, p20_ms / "
            "p80_ms = median of the trial quantiles, min_ms / max_ms = spread of the trial medians")


# ------------------------------------------------------------------------------------------------- error metrics
def rel_err_tensor(x: torch.Tensor, ref: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """``rel_err`` as a 0-dim fp64 tensor on x's device (for a collective), summed over chunks of ``chunk`` rows of
    the first dimension so that no full-size fp32 copy of a large output is made."""
    import torch

    x, ref = x.reshape(1, -1) if x.dim() == 0 else x, ref.reshape(1, -1) if ref.dim() == 0 else ref
    num = torch.zeros((), dtype=torch.float64, device=x.device)
    den = torch.zeros((), dtype=torch.float64, device=x.device)
    for s in range(0, x.shape[0], chunk):
        r = ref[s:s + chunk].float()
        num += (x[s:s + chunk].float() - r).square().sum(dtype=torch.float64)
        den += r.square().sum(dtype=torch.float64)
    err = torch.where(den > 0, num / den.clamp_min(1e-300), num).sqrt()
    return torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||x - ref||_F / ||ref||_F; ||x - ref||_F where ref is all zero; inf where x or ref
    has a NaN or inf."""
    return float(rel_err_tensor(x, ref))


def row_errs(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-row relative error over the last dimension (a row = one (token, head) output vector): |out - ref|_2 /
    |ref|_2, |out - ref|_2 for a row whose reference is all zero, inf for a row with a NaN or inf; fp32
    [out.numel() // out.shape[-1]]."""
    import torch

    o, r = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    num, den = (o - r).norm(dim=-1), r.norm(dim=-1)
    err = torch.where(den > 0, num / den.clamp_min(1e-30), num)
    return torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))


def max_row_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest of ``row_errs`` (0.0 for no rows)."""
    errs = row_errs(out, ref)
    return float(errs.max()) if errs.numel() else 0.0


# ------------------------------------------------------------------------------------------------- the JSON document
ROWS = "rows"  # the key of a document's row list
OLD_ROW_KEYS = ("results", "timings")  # the row list of files written before ROWS (layer / ShardQ benches, union_cuda)
OLD_META_KEYS = {"git_rev": "git_revision", "commit": "git_revision", "device": "gpu"}  # older spelling -> meta key
# kind -> the keys every row of that kind has: tells the kind of a file written before meta["kind"]
ROW_KEYS = {
    "layer": ("scenario", "heads", "paths", "chosen_path", "chosen_ms"),
    "shardq": ("model", "tp", "tokens", "variant", "total_ms", "attn_ms", "xchg_q_ms", "xchg_out_ms"),
    "shardq_layer": ("model", "tp", "tokens", "variant", "chunks", "total_ms", "exposed_exchange_ms"),
    "kv_fp8": ("case", "variant"),
    "op": ("case", "calls"),  # op.run_case's rows and op_decode's (api "flash_mla_with_kvcache")
}


def git_revision(package_dir: str | os.PathLike | None = None) -> str:
    """The revision of the sparse_mla source that runs: $GIT_REV when set (the GPU box gets a copy of the tree
    without .git), else the HEAD commit of the git work tree holding ``package_dir`` (default: the directory of
    the imported ``sparse_mla`` package) if that tree tracks the package (its ``__init__.py``), else "unknown"
    (an installed copy, an untracked source copy inside another repository, no git). Never the repository
    around the working directory."""
    if os.environ.get("GIT_REV"):
        return os.environ["GIT_REV"]
    if package_dir is None:
        import sparse_mla

        package_dir = os.path.dirname(os.path.abspath(sparse_mla.__file__))

    def git(*args: str) -> str:
        return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL, cwd=package_dir).strip()

    try:
        git("ls-files", "--error-unmatch", "--", "__init__.py")  # fails outside a work tree or when untracked
        return git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_version() -> str:
    """``sparse_mla.__version__`` of the imported package (recorded beside ``git_revision``)."""
    import sparse_mla

    return sparse_mla.__version__


def command_line() -> str:
    """This process's command line as launched: ``torchrun --nproc-per-node=N`` in front under torchrun, ``python -m
    sparse_mla`` for the package's entry point, else the interpreter's name and ``sys.argv``."""
    prog = ["-m", "sparse_mla"] if sys.argv[0].endswith(os.path.join("sparse_mla", "__main__.py")) else sys.argv[:1]
    launcher = [os.path.basename(sys.executable) or "python"]
    if "LOCAL_WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = ["torchrun", f"--nproc-per-node={os.environ['LOCAL_WORLD_SIZE']}"]
    return shlex.join([*launcher, *prog, *sys.argv[1:]])


def gpu_name(device: object = None) -> str:
    """The CUDA device's name, or "none (CPU, Triton interpreter)" without one."""
    import torch

    if torch.cuda.is_available() and getattr(device, "type", "cuda") == "cuda":
        return torch.cuda.get_device_name(device)
    return "none (CPU, Triton interpreter)"


def run_meta(kind: str | None = None, *, command: str | None = None, timing: str | None = None, device: object = None,
             **extra: object) -> dict:
    """The ``meta`` block of a bench JSON: ``kind`` (``sparse_mla.bench.kinds``: what ``sparse-mla report`` renders;
    left out when None), ``command`` (default ``command_line()``), ``git_revision``, ``sparse_mla_version``, ``gpu``
    (of ``device``, default the current one), ``date`` (UTC), ``torch``, ``triton``, ``timing`` (default
    ``timing_note()``, the do_bench budget), then ``extra``."""
    import torch
    import triton

    meta = {} if kind is None else {"kind": kind}
    meta.update(command=command if command is not None else command_line(), git_revision=git_revision(),
                sparse_mla_version=package_version(), gpu=gpu_name(device),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__, timing=timing if timing is not None else timing_note())
    meta.update(extra)
    return meta


def write_json(path: str | os.PathLike, meta: dict, rows: list, **extra: object) -> None:
    """Write ``{"meta": meta, "rows": rows, **extra}`` to ``path`` (parent folders created); a value JSON cannot hold
    (a dtype, a device) is written as its ``str``, so that a long run's figures are never lost to one of them."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, ROWS: rows, **extra}, f, indent=1, default=str)


def rows_fit(rows: object, kind: str) -> bool:
    """Whether ``rows`` is a non-empty list of dicts that all have the keys of ``ROW_KEYS[kind]``."""
    return (isinstance(rows, list) and bool(rows)
            and all(isinstance(r, dict) and all(k in r for k in ROW_KEYS[kind]) for r in rows))


def load(doc: object, source: str = "<json>") -> tuple[str | None, dict, list]:
    """(kind, meta, rows) of a loaded bench JSON, whatever its age.

    meta: ``doc["meta"]``, or for a file without one (older scripts) its top-level entries that are not lists; keys
    spelled as in ``OLD_META_KEYS`` renamed. rows: ``doc["rows"]``, else the first of ``OLD_ROW_KEYS`` present, else
    []. kind: ``meta["kind"]`` when stamped, else the one kind of ``ROW_KEYS`` whose keys every row has, else None.

    Raises:
        ValueError: ``doc`` is not a JSON object (the message names ``source``).
    """
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: not a bench JSON (a {type(doc).__name__}, not an object)")
    raw = doc["meta"] if isinstance(doc.get("meta"), dict) else {k: v for k, v in doc.items() if not isinstance(v, list)}
    meta = {OLD_META_KEYS.get(k, k): v for k, v in raw.items() if not (k in OLD_META_KEYS and OLD_META_KEYS[k] in raw)}
    key = next((k for k in (ROWS, *OLD_ROW_KEYS) if isinstance(doc.get(k), list)), None)
    rows = doc[key] if key is not None else []
    kind = meta.get("kind")
    if kind is None:
        fits = [k for k in ROW_KEYS if rows_fit(rows, k)]
        kind = fits[0] if len(fits) == 1 else None
    return kind, meta, rows


def read_json(path: str | os.PathLike) -> tuple[str | None, dict, list]:
    """``load`` of the JSON file at ``path``."""
    with open(path) as f:
        return load(json.load(f), str(path))


# ------------------------------------------------------------------------------------------------- tables
def make_table(title: str | None, head: list[str], cells: list[list[str]], *, caption: str | None = None,
               left: tuple[int, ...] = (0,), failed: list[bool] | None = None):
    """A rich table, one space between columns: the columns ``left`` left-justified (names), the others
    right-justified (numbers); only the first column may fold (when the table is wider than the console), no cell
    is ever cut; rows with ``failed[i]`` in red."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 0), title_justify="left",
                  caption_justify="left")
    for i, name in enumerate(head):
        table.add_column(name, justify="left" if i in left else "right", no_wrap=i > 0, overflow="fold")
    for i, row in enumerate(cells):
        table.add_row(*row, style="red" if failed and failed[i] else None)
    return table


def print_tables(*renderables, width: int | None = None, wide: bool = False, file=None) -> None:
    """Print tables (and text) on a console ``width`` columns wide, by default the terminal's (off a terminal:
    $COLUMNS, else 80). ``wide``: at least as wide as the widest table, so that nothing is cut (a terminal
    narrower than that wraps the lines instead). ``file``: where to (default: stdout)."""
    from rich.console import Console

    console = Console(width=width, markup=False, file=file)
    if wide and renderables:
        need = max(console.measure(r, options=console.options.update_width(10**4)).maximum for r in renderables)
        console = Console(width=max(console.width, need), markup=False, file=file)
    for i, r in enumerate(renderables):
        if i:
            console.print()
        console.print(r)


def render_text(*renderables, width: int | None = None, wide: bool = False) -> str:
    """What ``print_tables`` prints, as plain text (no colour), ``width`` columns wide (default 80)."""
    import io

    buf = io.StringIO()
    print_tables(*renderables, width=width or 80, wide=wide, file=buf)
    return buf.getvalue()


def markdown_cells(head: list[str], cells: list[list[str]]) -> str:
    """A markdown table of ``head`` and ``cells``."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def print_rows(title: str, rows: list[dict], columns: dict[str, Callable[[dict], str]], *,
               left: tuple[int, ...] = (0,), wide: bool = True) -> None:
    """Print ``rows`` as one table (``make_table``): a column per entry of ``columns`` (head -> the cell of a row);
    ``wide``: as wide as the table needs."""
    cells = [[cell(r) for cell in columns.values()] for r in rows]
    print_tables(make_table(title, list(columns), cells, left=left), wide=wide)


def fmt(v: object, spec: str) -> str:
    """``format(v, spec)``; "-" for None or NaN (not measured), "inf" for an infinite value (an error metric's
    score of a non-finite output must show)."""
    import math

    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return format(v, spec)


__all__ = ["PEAK_FLOPS", "PEAK_BYTES", "SMS", "floor_ms", "tflops", "WARMUP_MS", "REP_MS", "QUANTILES", "timing_note",
           "rel_err", "rel_err_tensor", "row_errs", "max_row_err", "ROWS", "OLD_ROW_KEYS", "OLD_META_KEYS", "ROW_KEYS",
           "git_revision", "package_version", "command_line", "gpu_name", "run_meta", "write_json", "load", "read_json",
           "rows_fit", "make_table", "print_tables", "render_text", "markdown_cells", "print_rows", "fmt"]

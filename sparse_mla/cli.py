"""The ``sparse-mla`` command line: ``bench`` (the main job), ``report`` and ``topk-stats``.

Kernel modules are imported inside the commands, after TRITON_INTERPRET is decided: Triton reads
it when a kernel is defined. The command line and the benchmarks need the ``bench`` extra
(``BENCH_PACKAGES``); without it ``sparse-mla`` exits with a message that names it.
"""

from __future__ import annotations

import os
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

from . import env

# The packages of the `bench` extra (pyproject.toml) that the CLI and the benchmarks import; a core install
# (`pip install sparse-mla`) has none of them.
BENCH_PACKAGES = ("typer", "click", "rich", "tqdm", "safetensors", "matplotlib")
NEEDS_BENCH_EXTRA = "sparse-mla: the command line needs the bench extra: pip install 'sparse-mla[bench]'"

try:
    import typer
    from typer.core import TyperCommand, TyperGroup
except ModuleNotFoundError as e:  # `sparse-mla` / `python -m sparse_mla` on a core install
    if e.name not in BENCH_PACKAGES:
        raise
    sys.exit(f"{NEEDS_BENCH_EXTRA} ({e.name} is not installed)")


class _PlainHelp:
    """Help screens as users read them: the usage line names arguments plainly (``FILE``, not typer's
    ``{FILE}``), and ``--help`` and the other flags show no ``<bool>`` type."""

    def collect_usage_pieces(self, ctx):
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and not getattr(p, "count", False):
                p.metavar = ""  # as for --help below: nothing in place of the type
        return params

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.metavar = ""  # rich help prints the metavar in place of the type: nothing for a flag
        return opt


class _Command(_PlainHelp, TyperCommand):
    pass


class _Group(_PlainHelp, TyperGroup):
    pass


app = typer.Typer(
    cls=_Group,
    help="sparse-mla: exact DeepSeek Sparse Attention prefill on Hopper (Triton and Gluon kernels). "
    "Run `sparse-mla bench` for the side-by-side benchmark.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # the subcommands inherit it
)

SPARSE_MLA_PATH_ENV = env.PATH.name  # sparse_mla.layer.dispatch.ENV_VAR (sparse_mla.env imports no torch)


def version_line() -> str:
    """``sparse-mla X (torch Y, triton Z)``: this package's version and those of the torch and Triton it runs on."""
    from importlib import import_module

    from . import __version__

    def version(name: str) -> str:
        try:
            return import_module(name).__version__
        except ImportError:
            return "not installed"

    return f"sparse-mla {__version__} (torch {version('torch')}, triton {version('triton')})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print the versions of sparse-mla, torch and Triton, and exit.")] = False,
) -> None:
    pass


# Default --trials: do_bench trials per path on one GPU, timed iterations per variant under torchrun,
# one wall-clock run under the interpreter (not a performance number either way).
TRIALS_GPU, TRIALS_TORCHRUN, TRIALS_INTERPRETER = 5, 3, 1


class Model(str, Enum):
    deepseek_v3_2 = "deepseek-v3.2"
    glm_5 = "glm-5"
    glm_5_3_flash = "glm-5.3-flash"


class DType(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"


class KVDType(str, Enum):
    same = "same"  # the cache in --dtype
    fp8 = "fp8"  # the fp8_ds_mla cache (sparse_mla.kv_format), quantized once from the --dtype cache


def _parse_ints(text: str | None, what: str, minimum: int = 0) -> list[int] | None:
    """Comma-separated integers >= ``minimum``; typer.BadParameter naming ``what`` otherwise."""
    if text is None:
        return None
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"must be comma-separated integers, got {text!r}", param_hint=what) from None
    if not vals or any(v < minimum for v in vals):
        raise typer.BadParameter(f"must be integers >= {minimum}, got {text!r}", param_hint=what)
    return vals


def _at_least(value: int | None, minimum: int, what: str) -> None:
    if value is not None and value < minimum:
        raise typer.BadParameter(f"must be >= {minimum}, got {value}", param_hint=what)


def default_trials(trials: int | None, *, on_gpu: bool, torchrun: bool) -> int:
    """``trials`` if given, else TRIALS_GPU on one GPU, TRIALS_TORCHRUN under torchrun,
    TRIALS_INTERPRETER without a GPU."""
    if trials is not None:
        return trials
    if not on_gpu:
        return TRIALS_INTERPRETER
    return TRIALS_TORCHRUN if torchrun else TRIALS_GPU


def _given(ctx: typer.Context, *params: str) -> list[str]:
    """The command-line spelling (--name) of each of ``params`` set explicitly (not left at its default).

    ParameterSource is compared by name: recent typer releases carry their own copy of click's enum."""
    unknown = [p for p in params if p not in ctx.params]
    if unknown:
        raise AssertionError(f"_given: not parameters of this command: {unknown}")
    sources = {p: getattr(ctx.get_parameter_source(p), "name", "DEFAULT") for p in params}
    return ["--" + p.replace("_", "-") for p, src in sources.items() if src not in ("DEFAULT", "DEFAULT_MAP")]


def _kernel_device() -> bool:
    """True on a CUDA GPU; else sets TRITON_INTERPRET=1 (before any kernel module is imported) or
    raises BadParameter if it is set to something else."""
    import torch

    if torch.cuda.is_available():
        return True
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if not env.interpreted():
        raise typer.BadParameter("no CUDA GPU and TRITON_INTERPRET is not 1: the kernels cannot run")
    return False


def _shapes(new_list: list[int] | None, cached_list: list[int] | None, default: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(cached, new) pairs from --tokens / --cached (one cached value for all, or one per --tokens)."""
    if new_list is None:
        if cached_list is not None:
            raise typer.BadParameter("needs --tokens", param_hint="--cached")
        return default
    if cached_list is None:
        cached_list = [0] * len(new_list)
    elif len(cached_list) == 1:
        cached_list = cached_list * len(new_list)
    if len(cached_list) != len(new_list):
        raise typer.BadParameter("needs one value or as many as --tokens", param_hint="--cached")
    return list(zip(cached_list, new_list))


def _bench_torchrun(world: int, model: list[Model] | None, tp: int | None, new_list: list[int] | None, topk: int,
                    overlap: str, trials: int | None, seed: int, json_out: str | None, plot_out: str | None, wide: bool,
                    single_gpu_only: list[str]) -> None:
    """``bench`` under torchrun with WORLD_SIZE > 1: ShardQ vs TP on the W GPUs (sparse_mla.bench.shardq).
    ``single_gpu_only``: the options given that only the single-GPU benchmark takes (rejected)."""
    if single_gpu_only:
        raise typer.BadParameter("is for the single-GPU layer benchmark, not the torchrun (ShardQ vs TP) one",
                                 param_hint=single_gpu_only[0])
    if tp is None:
        tp = world
    elif tp != world:
        raise typer.BadParameter(f"under torchrun it must equal WORLD_SIZE = {world}, got {tp}", param_hint="--tp")
    on_gpu = _kernel_device()
    from .bench import scenarios
    from .bench.common import write_json
    from .bench.shardq import plot_shardq, print_shardq_table, run_shardq_bench

    names = [m.value for m in model] if model else list(scenarios.SHARDQ_MODELS)
    if not on_gpu and os.environ.get("RANK", "0") == "0":
        typer.secho("No CUDA GPU: ShardQ vs TP at interpreter sizes through the Triton interpreter (fp16); "
                    "its timings are NOT performance numbers.", fg=typer.colors.YELLOW)
    tokens = new_list or list(scenarios.SHARDQ_TOKENS if on_gpu else scenarios.CPU_SHARDQ_TOKENS)
    try:  # on a CPU (interpreter sizes) ShardQ runs from any token count
        res = run_shardq_bench([(n, tp) for n in names], tokens, topk=topk,
                               overlap=overlap, trials=default_trials(trials, on_gpu=on_gpu, torchrun=True), seed=seed,
                               **({} if on_gpu else {"min_tokens": 0}))
    except ValueError as e:  # its argument checks, before any collective
        raise typer.BadParameter(str(e)) from None
    if res is None:  # ranks other than 0
        return
    json_out = json_out or "out/bench_shardq.json"
    write_json(json_out, res["meta"], res["rows"], **{k: v for k, v in res.items() if k not in ("meta", "rows")})
    plot_out = "out/bench_shardq.png" if plot_out is None else plot_out
    if plot_out:
        plot_shardq(plot_out, res["rows"])
    print_shardq_table(res["rows"], wide=wide)
    typer.echo(f"wrote {json_out}" + (f" and {plot_out}" if plot_out else ""))
    _exit_on_failures([f"{r['model']} T={r['tokens']} {r['variant']}: check failed"
                       for r in res["rows"] if r.get("check_ok") is False])


def _exit_on_failures(failures: list[str]) -> None:
    if failures:
        typer.secho("FAILED: " + "; ".join(failures), fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


@app.command(cls=_Command, short_help="Check and time every DSA prefill path per scenario (the main job).")
def bench(
    ctx: typer.Context,
    model: Annotated[list[Model] | None, typer.Option("--model", metavar="MODEL", show_default="glm-5 at TP4 and deepseek-v3.2 at TP8", help="Model layout, repeatable: deepseek-v3.2, glm-5, glm-5.3-flash.")] = None,
    dims: Annotated[list[str] | None, typer.Option(metavar="H,R,NOPE,ROPE,V", show_default="none", help="A custom layout (repeatable): heads, kv_lora_rank, qk_nope, qk_rope, v_head_dim, e.g. 128,512,128,64,128; qk_rope may be 0 (NoPE).")] = None,
    tp: Annotated[int | None, typer.Option(metavar="W", show_default="glm-5 4, deepseek-v3.2 8, others 1; WORLD_SIZE under torchrun", help="Tensor-parallel size: heads per rank = heads / tp on one GPU; under torchrun with W processes, runs ShardQ vs TP on W GPUs (tp must be W).")] = None,
    tokens: Annotated[str | None, typer.Option(metavar="T[,T...]", show_default="GPU: the default scenarios; CPU: two small ones; torchrun: 8192-65536 on GPUs, 64 on CPUs", help="New (query) tokens per scenario, comma-separated, e.g. 8192,16384.")] = None,
    cached: Annotated[str | None, typer.Option(metavar="C[,C...]", show_default="0", help="Cached prefix tokens, comma-separated (one value for all --tokens, or one per value).")] = None,
    topk: Annotated[int, typer.Option(metavar="K", help="Rows the indexer selects per query (K; capped at 32 without a GPU).")] = 2048,
    overlap: Annotated[str, typer.Option(metavar="PRESET", help="Synthetic top-k preset: high, mid, low (union ratio ~1.2/1.4/1.7 at G=8), none, random.")] = "mid",
    topk_trace: Annotated[str | None, typer.Option(metavar="FILE", show_default="none: synthetic lists", help="Engine top-k dump (.pt or .safetensors, per layer `topk` [T, K] and `valid` [T] int32): its first layer's lists replace the synthetic ones (one request, T = its rows, K = its columns; not with --tokens, --cached, --topk, --overlap).")] = None,
    dtype: Annotated[DType, typer.Option(metavar="bf16|fp16", help="q / kv / weight dtype of the single-GPU benchmark (the interpreter on a CPU always uses fp16; under torchrun: bf16 on GPUs, not settable).")] = DType.bf16,
    kv_dtype: Annotated[KVDType, typer.Option(metavar="same|fp8", help="Latent cache: 'same' (in --dtype) or 'fp8' (the fp8_ds_mla cache of FlashMLA / vLLM, quantized once; every path runs on it, each checked against the reference on the dequantized cache and compared to the unquantized one, plus the dequantize-then-bf16 baseline). Single-GPU benchmark only.")] = KVDType.same,
    trials: Annotated[int | None, typer.Option(metavar="N", show_default=f"{TRIALS_GPU} on one GPU, {TRIALS_TORCHRUN} under torchrun, {TRIALS_INTERPRETER} under the interpreter", help="Timing trials per path (each a do_bench median and 20/80% quantiles).")] = None,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the inputs and synthetic lists.")] = 0,
    json_out: Annotated[str | None, typer.Option("--json", metavar="FILE", show_default="out/bench.json; out/bench_shardq.json under torchrun; out/bench_op.json with --op-suite", help="Where to write the JSON results (results/ holds the committed GPU runs).")] = None,
    plot_out: Annotated[str | None, typer.Option("--plot", metavar="FILE", show_default="out/bench.png; out/bench_shardq.png under torchrun", help="PNG plot of time per path vs prompt length ('' for none).")] = None,
    wide: Annotated[bool, typer.Option("--wide", help="Print the full table (every path's ms; it is always in the JSON) instead of the compact one that fits 80 columns.")] = False,
    op_suite: Annotated[list[str] | None, typer.Option("--op-suite", metavar="SUITE", show_default="none: the layer scenarios", help="Run an op-level suite of python -m sparse_mla.bench.op instead of the layer scenarios (repeatable): few-token, decode, grouped, short, mixed, fp8, ...; with --dtype, --trials, --seed, --json, --wide only. No GPU: few-token / decode at interpreter sizes.")] = None,
) -> None:
    """Layer-level benchmark: per scenario and model layout, the dispatcher's chosen path and the time of
    every other applicable DSA prefill path (dense MHA, masked MHA, grouped and per-token sparse MQA,
    and per-token padded to 64 heads, what engines run on Hopper), each checked against the fp32
    reference. Without a GPU, runs small scenarios through the Triton interpreter (its timings are not
    performance numbers). With --op-suite: the op-level calls (sparse_mla_fwd, the FlashMLA drop-ins,
    forced kv_splits, FlashMLA's kernels) per suite case instead, checked the same way."""
    if op_suite is not None:
        _bench_op_suites(ctx, op_suite, dtype, trials, seed, json_out, plot_out, wide)
        return
    new_list = _parse_ints(tokens, "--tokens", minimum=1)
    cached_list = _parse_ints(cached, "--cached")
    _at_least(topk, 1, "--topk")
    _at_least(trials, 1, "--trials")
    _at_least(tp, 1, "--tp")
    from .bench import scenarios
    from .workloads.topk import resolve_overlap

    try:
        resolve_overlap(overlap)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--overlap") from None
    custom = []
    for text in dims or []:
        try:
            custom.append(scenarios.model_from_dims(text))
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--dims") from None
    moot = _given(ctx, "tokens", "cached", "topk", "overlap") if topk_trace is not None else []
    if moot:
        raise typer.BadParameter("not with --topk-trace: the trace sets the request (T = its rows) and its lists "
                                 "(K = its columns)", param_hint=moot[0])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        _bench_torchrun(world, model, tp, new_list, topk, overlap, trials, seed, json_out, plot_out, wide,
                        _given(ctx, "dims", "cached", "topk_trace", "dtype", "kv_dtype"))
        return
    on_gpu = _kernel_device()
    if SPARSE_MLA_PATH_ENV in os.environ:
        typer.secho(f"ignoring {SPARSE_MLA_PATH_ENV}={os.environ.pop(SPARSE_MLA_PATH_ENV)}: the chosen column is the "
                    "dispatcher's own choice", fg=typer.colors.YELLOW)
    import torch
    from tqdm import tqdm

    from .bench import report
    from .bench.common import write_json
    from .bench.runner import run_scenario

    if on_gpu:
        shapes, k = list(scenarios.DEFAULT_SHAPES), topk
    else:
        shapes, k = list(scenarios.CPU_SHAPES), min(topk, scenarios.CPU_TOPK)
    shapes = _shapes(new_list, cached_list, shapes)
    pairs = [(m.value, tp or scenarios.DEFAULT_TP.get(m.value, 1)) for m in model or []]
    pairs += [(cfg, tp or 1) for cfg in custom]
    pairs = pairs or [(m, tp or t) for m, t in scenarios.DEFAULT_MODELS]
    trace = None
    if topk_trace is not None:
        from .bench.inputs import trace_shape
        from .workloads.traces import load_trace

        try:
            trace = load_trace(topk_trace)[0]
        except (OSError, ValueError, TypeError, ImportError) as e:  # ImportError: a .safetensors file, no safetensors
            raise typer.BadParameter(str(e), param_hint="--topk-trace") from None
        shapes, k = [trace_shape(trace.topk)], trace.topk.shape[1]
    try:
        scs = scenarios.build_scenarios(pairs, shapes, k)
    except ValueError as e:  # the other options are checked above: a TP that does not divide the heads, an empty trace
        hint = "--tp" if re.search(r"\btp\b", str(e)) else "--topk-trace" if trace is not None else None
        raise typer.BadParameter(str(e), param_hint=hint) from None
    if not on_gpu:
        typer.secho("No CUDA GPU: running small scenarios through the Triton interpreter (fp16); "
                    "its timings are NOT performance numbers.", fg=typer.colors.YELLOW)
    trials = default_trials(trials, on_gpu=on_gpu, torchrun=False)
    torch_dtype = torch.float16 if not on_gpu or dtype == DType.fp16 else torch.bfloat16
    device = torch.device("cuda" if on_gpu else "cpu")
    kv_format = "fp8_ds_mla" if kv_dtype == KVDType.fp8 else None
    rows = []
    for sc in tqdm(scs, desc="scenarios", unit="scenario"):
        rows.append(run_scenario(sc, dtype=torch_dtype, device=device, overlap=overlap, seed=seed, trials=trials, trace=trace,
                                 kv_format=kv_format))
        if on_gpu:
            torch.cuda.empty_cache()
    meta = report.provenance(not on_gpu, trials)
    meta.update(overlap=overlap if trace is None else f"trace {topk_trace}", dtype=str(torch_dtype), kv_format=kv_format)
    json_out = json_out or "out/bench.json"
    plot_out = "out/bench.png" if plot_out is None else plot_out
    write_json(json_out, meta, rows)
    if plot_out:
        report.plot(plot_out, rows, not on_gpu)
    report.print_table(rows, not on_gpu, wide=wide)
    typer.echo(f"wrote {json_out}" + (f" and {plot_out}" if plot_out else ""))
    _exit_on_failures([f"{r['scenario']} {f}" for r in rows for f in r["failures"]])


OP_SUITE_MOOT = ("model", "dims", "tp", "tokens", "cached", "topk", "overlap", "topk_trace", "kv_dtype")


def _bench_op_suites(ctx: typer.Context, names: list[str], dtype: DType, trials: int | None, seed: int,
                     json_out: str | None, plot_out: str | None, wide: bool) -> None:
    """``bench --op-suite``: the op bench's suites (``sparse_mla.bench.op``) on one GPU, or their interpreter forms
    (``op.CPU_SUITES``) without one; writes the op JSON that ``report`` renders, prints its tables, exits 1 when a
    call failed its check or raised."""
    moot = _given(ctx, *OP_SUITE_MOOT) + (["--plot"] if plot_out else [])
    if moot:
        raise typer.BadParameter("not with --op-suite: the suite sets its cases (shapes, heads, top-k, lists, cache)",
                                 param_hint=moot[0])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise typer.BadParameter("runs on one GPU, not under torchrun", param_hint="--op-suite")
    on_gpu = _kernel_device()
    import dataclasses

    import torch
    from tqdm import tqdm

    from .bench import op
    from .bench.common import print_tables

    try:
        cases = [dataclasses.replace(c, seed=seed) for name in names for c in op.suite(name, cpu=not on_gpu)]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--op-suite") from None
    if not on_gpu:
        typer.secho("No CUDA GPU: running the suites at interpreter sizes through the Triton interpreter (fp16); "
                    "its timings are NOT performance numbers.", fg=typer.colors.YELLOW)
    torch_dtype = torch.float16 if not on_gpu or dtype == DType.fp16 else torch.bfloat16
    json_out = json_out or "out/bench_op.json"
    Path(json_out).parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(cases, desc="op cases", unit="case")
    rows = op.run_suites(bar, json_path=json_out, echo=bar.write, trials=default_trials(trials, on_gpu=on_gpu,
                         torchrun=False), device="cuda" if on_gpu else "cpu", dtype=torch_dtype)
    print_tables(*op.tables(rows, wide, interpreted=not on_gpu), wide=wide)
    typer.echo(f"wrote {json_out}")
    _exit_on_failures([f"{r['case']} {name}: " + rec.get("error", rec.get("graph_error", "check failed"))
                       for r in rows for name, rec in r["calls"].items()
                       if "error" in rec or rec.get("ok") is False or rec.get("graph_ok") is False])


@app.command("report", cls=_Command, short_help="Print the tables of a bench JSON (the README's with --markdown).")
def report_cmd(
    json_path: Annotated[Path, typer.Argument(metavar="JSON", dir_okay=False, show_default=False,
                                              help="A JSON of `sparse-mla bench` (e.g. results/bench.json; under "
                                                   "torchrun its ShardQ-vs-TP one) or of a bench module "
                                                   "(sparse_mla.bench.kv_fp8, .shardq_layer, .op).")],
    wide: Annotated[bool, typer.Option("--wide", help="The full tables (every figure), not the compact ones that fit 80 columns.")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Markdown tables; for results/bench.json, the README's results table.")] = False,
) -> None:
    """Print a bench JSON as tables: compact by default (each fits 80 columns), every figure with --wide,
    markdown with --markdown. Renders every JSON that `sparse-mla bench` and the bench modules write
    (sparse_mla.bench.kinds); says so, and exits 2, for any other."""
    import json

    from .bench import kinds

    json_file = str(json_path)
    try:
        with open(json_file) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="JSON") from None
    try:
        kinds.report(doc, json_file, wide=wide, markdown=markdown)
    except ValueError as e:  # none of the kinds, or rows that lack a key its tables need (an OSError writing is not ours)
        raise typer.BadParameter(str(e), param_hint="JSON") from None


@app.command("topk-stats", cls=_Command, short_help="Union ratios of an engine's top-k dump, per layer and G.")
def topk_stats(
    path: Annotated[Path, typer.Argument(metavar="FILE", dir_okay=False, show_default=False, help="Engine top-k dump (.pt or .safetensors; per layer `topk` [T, K] int32, `valid` [T] int32, optional `layer`).")],
    group_sizes: Annotated[str, typer.Option(metavar="G[,G...]", help="Group sizes G, comma-separated.")] = "2,4,8,16",
) -> None:
    """Print union ratios (union rows of G consecutive queries / mean valid rows per query) per layer:
    one table of the layers' lists, one of the ratios per layer and G (fits 80 columns)."""
    from rich.console import Console

    from .workloads.stats import topk_stats_table

    gs = _parse_ints(group_sizes, "--group-sizes", minimum=1)
    try:
        rows = topk_stats_table(str(path), gs)
    except (OSError, ValueError, TypeError, ImportError) as e:  # ImportError: a .safetensors file, no safetensors
        raise typer.BadParameter(str(e), param_hint="FILE") from None
    console = Console()
    for table in topk_stats_tables(rows, str(path)):
        console.print(table)


def topk_stats_tables(rows: list[dict], source: str) -> list:
    """Two narrow rich tables of ``topk_stats`` rows: the lists of each layer (tokens, K, valid rows per
    query), then per layer and G the groups, mean union rows and the ratio's mean / p50 / p90 / max."""
    from rich.table import Table

    def layer_name(v: object) -> str:
        return "-" if v is None else str(v)

    lists = Table(title=f"top-k lists: {source}", title_justify="left")
    for name in ("layer", "tokens T", "top-k K", "valid rows / query"):
        lists.add_column(name, justify="right", no_wrap=True)
    seen = set()
    for r in rows:
        if r["layer"] not in seen:
            seen.add(r["layer"])
            lists.add_row(layer_name(r["layer"]), str(r["tokens"]), str(r["topk"]), f"{r['valid_mean']:.1f}")
    ratios = Table(title="union ratio = union rows of G queries / mean valid rows (lists)", title_justify="left")
    for name in ("layer", "G", "groups", "union rows", "mean", "p50", "p90", "max"):
        ratios.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        ratios.add_row(layer_name(r["layer"]), str(r["G"]), str(r["groups"]), f"{r['union_rows']:.1f}",
                       *(f"{r[k]:.3f}" for k in ("ratio_mean", "ratio_p50", "ratio_p90", "ratio_max")))
    return [lists, ratios]


def main() -> None:
    try:
        app(prog_name="sparse-mla")
    except ModuleNotFoundError as e:  # typer is there but another package of the extra is not
        if e.name not in BENCH_PACKAGES:
            raise
        sys.exit(f"{NEEDS_BENCH_EXTRA} ({e.name} is not installed)")


if __name__ == "__main__":
    main()

"""The ``sparse-mla`` command line: ``bench`` (the main job) and ``topk-stats``.

Kernel modules are imported inside the commands, after TRITON_INTERPRET is decided: Triton reads
it when a kernel is defined.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Annotated

import typer

app = typer.Typer(
    help="sparse-mla: exact DeepSeek Sparse Attention prefill on Hopper (Triton). "
    "Run `sparse-mla bench` for the side-by-side benchmark.",
    no_args_is_help=True,
    add_completion=False,
)


class Model(str, Enum):
    deepseek_v3_2 = "deepseek-v3.2"
    glm_5 = "glm-5"
    glm_5_3_flash = "glm-5.3-flash"


class DType(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"


def _parse_ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise typer.BadParameter(f"{what} must be non-negative integers, got {text!r}")
    return vals


@app.command()
def bench(
    model: Annotated[list[Model] | None, typer.Option(help="Model layout(s); default: glm-5 at TP4 and deepseek-v3.2 at TP8.")] = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel size: heads per rank = model heads / tp.")] = None,
    tokens: Annotated[str | None, typer.Option(help="New (query) tokens per scenario, comma-separated, e.g. 8192,16384.")] = None,
    cached: Annotated[str | None, typer.Option(help="Cached prefix tokens, comma-separated (paired with --tokens, or one value for all).")] = None,
    topk: Annotated[int, typer.Option(help="Rows the indexer selects per query (K).")] = 2048,
    overlap: Annotated[str, typer.Option(help="Synthetic top-k preset: high, mid, low (union ratio ~1.2/1.4/1.7 at G=8), none, random.")] = "mid",
    topk_trace: Annotated[str | None, typer.Option(help="Engine top-k dump (.pt/.safetensors, see sparse_mla.workloads.traces): its lists replace the synthetic ones.")] = None,
    dtype: Annotated[DType, typer.Option(help="q / kv dtype (the interpreter on a CPU always uses fp16).")] = DType.bf16,
    seed: Annotated[int, typer.Option(help="Seed of the inputs and synthetic lists.")] = 0,
    json_out: Annotated[str, typer.Option("--json", help="Where to write the JSON results (results/ holds the committed GPU runs).")] = "out/bench.json",
    plot_out: Annotated[str | None, typer.Option("--plot", help="PNG plot of time per path vs prompt length.")] = "out/bench.png",
) -> None:
    """Time every sparse MLA prefill path side by side on realistic scenarios and check each against
    the fp32 reference. Without a GPU, runs a small scenario through the Triton interpreter (its
    timings are not performance numbers)."""
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise typer.BadParameter("no CUDA GPU and TRITON_INTERPRET is not 1: the kernels cannot run")
    from tqdm import tqdm

    from .bench import report, scenarios
    from .bench.runner import run_scenario

    new_list = _parse_ints(tokens, "--tokens")
    cached_list = _parse_ints(cached, "--cached")
    if on_gpu:
        shapes = list(scenarios.DEFAULT_SHAPES)
        k = topk
    else:
        typer.secho("No CUDA GPU: running a small scenario through the Triton interpreter (fp16); "
                    "its timings are NOT performance numbers.", fg=typer.colors.YELLOW)
        shapes = list(scenarios.CPU_SHAPES)
        k = min(topk, scenarios.CPU_TOPK)
    if new_list is not None:
        if cached_list is None:
            cached_list = [0] * len(new_list)
        elif len(cached_list) == 1:
            cached_list = cached_list * len(new_list)
        if len(cached_list) != len(new_list):
            raise typer.BadParameter("--cached needs one value or as many as --tokens")
        shapes = list(zip(cached_list, new_list))
    if model:
        models = [(m.value, tp or (4 if m.value.startswith("glm") else 8)) for m in model]
    else:
        models = [(m, tp or t) for m, t in scenarios.DEFAULT_MODELS]
    try:
        scs = scenarios.build_scenarios(models, shapes, k)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    trace = None
    if topk_trace is not None:
        from .workloads.traces import load_trace

        trace = load_trace(topk_trace)[0]
        scs = [scenarios.Scenario(s.model, s.tp, 0, trace.topk.shape[0], trace.topk.shape[1]) for s in scs[: len(models)]]
    interpreted = not on_gpu
    torch_dtype = torch.float16 if interpreted or dtype == DType.fp16 else torch.bfloat16
    device = torch.device("cuda" if on_gpu else "cpu")
    rows = []
    for sc in tqdm(scs, desc="scenarios", unit="scenario"):
        rows.append(run_scenario(sc, dtype=torch_dtype, device=device, overlap=overlap, seed=seed,
                                 trace_indices=None if trace is None else trace.topk,
                                 trace_valid=None if trace is None else trace.valid))
        if on_gpu:
            torch.cuda.empty_cache()
    meta = report.provenance(interpreted)
    meta.update(overlap=overlap if trace is None else f"trace {topk_trace}", dtype=str(torch_dtype))
    report.write_json(json_out, meta, rows)
    if plot_out:
        report.plot(plot_out, rows, interpreted)
    report.print_table(rows, interpreted)
    typer.echo(f"wrote {json_out}" + (f" and {plot_out}" if plot_out else ""))


@app.command("topk-stats")
def topk_stats(
    file: Annotated[str, typer.Argument(help="Engine top-k dump (.pt or .safetensors; per layer `topk` [T, K] int32, `valid` [T] int32).")],
    group_sizes: Annotated[str, typer.Option(help="Group sizes G, comma-separated.")] = "2,4,8,16",
) -> None:
    """Print union ratios (union rows of G consecutive queries / mean valid rows per query) per layer."""
    from rich.console import Console
    from rich.table import Table

    from .workloads.stats import TOPK_STATS_COLUMNS, topk_stats_table

    gs = _parse_ints(group_sizes, "--group-sizes")
    try:
        rows = topk_stats_table(file, gs)
    except (OSError, ValueError, TypeError) as e:
        raise typer.BadParameter(str(e)) from None
    table = Table(title=f"top-k union ratios: {file}")
    for c in TOPK_STATS_COLUMNS:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in TOPK_STATS_COLUMNS])
    Console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

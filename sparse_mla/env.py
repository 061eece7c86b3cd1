"""The environment switches the package reads: one table (``SWITCHES``), one reader (``get``).

Every ``SPARSE_MLA_*`` variable is a row of ``SWITCHES``: its values and default, when it is read ("per call":
each call reads it, so a changed value applies at once; "at import": read once, when its module is imported),
the module that owns the decision, and what it does. The owners read their switch through ``get`` and parse the
value themselves (their docstrings say how). ``markdown_table`` renders the table for the README.

``interpreted`` is the one reader of Triton's ``TRITON_INTERPRET`` (the CPU interpreter), with Triton's own
parse: "1", "true", "on", "yes", "y" (any case) mean on, anything else off. Triton reads it when a kernel is
decorated, so it must be set before the first kernel module is imported (``kernels_imported`` says whether one
is). Imports only ``os`` and ``sys``: a leaf that any module, the CLI included, can import without torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    """One environment switch: ``name``, ``default`` (the value when unset), ``values`` (what it takes, in
    words), ``when`` ("per call" or "at import"), ``owner`` (the module that reads it), ``doc`` (what it does),
    ``tuning`` (a kernel tuning knob, not for production)."""

    name: str
    default: str
    values: str
    when: str
    owner: str
    doc: str
    tuning: bool = False


PATH = Switch(
    "SPARSE_MLA_PATH", "auto", "auto, dense_mha, masked_mha, mqa_grouped, mqa_per_token", "per call",
    "sparse_mla.layer.dispatch",
    "forces the layer path of `dsa_prefill` where `path=` is not given; one that cannot run the step falls back to "
    "the automatic choice with a `PathFallbackWarning`, an unknown name warns and is ignored")
MQA_BACKEND = Switch(
    "SPARSE_MLA_MQA_BACKEND", "auto", "auto, triton, gluon_sm90", "per call", "sparse_mla.mqa.backends",
    "forces the attention backend of `sparse_mla_fwd`; one that cannot run raises `ValueError` with the reason")
UNION_BACKEND = Switch(
    "SPARSE_MLA_UNION_BACKEND", "auto", "auto, triton, cuda_smem", "per call", "sparse_mla.union.backends",
    "forces the union builder of the grouped path; `cuda_smem` where it cannot run raises `ValueError` with the "
    "reason")
UNION_SORTED = Switch(
    "SPARSE_MLA_UNION_SORTED", "0", "0, 1", "per call", "sparse_mla.union.backends",
    "`build_group_union` on a GPU that runs the CUDA union builders, with `SPARSE_MLA_UNION_BACKEND` auto: `1` emits "
    "the sorted unions from one kernel "
    "(`sparse_mla/union/cuda_sorted.cu`: its source tested on the CPU, not yet run on a GPU), `0` builds them with the step "
    "builder and sorts them in torch",
    tuning=True)
GLUON_SCHEDULE = Switch(
    "SPARSE_MLA_GLUON_SCHEDULE", "pair", "pair, split", "at import", "sparse_mla.mqa.gluon_sm90.config",
    "Gluon schedule on bf16 / fp16 caches (an `fp8_ds_mla` cache always runs `split`)")
GLUON_O_VIA_SMEM = Switch(
    "SPARSE_MLA_GLUON_O_VIA_SMEM", "1", "1, 0", "at import", "sparse_mla.mqa.gluon_sm90.config",
    "Gluon: O stored through shared memory (`1`) or directly (`0`)", tuning=True)
GLUON_PERSISTENT = Switch(
    "SPARSE_MLA_GLUON_PERSISTENT", "1", "1, 0", "at import", "sparse_mla.mqa.gluon_sm90.config",
    "Gluon: a persistent grid, one CTA per SM (`1`), or one CTA per work item (`0`)", tuning=True)
GLUON_KV_L2 = Switch(
    "SPARSE_MLA_GLUON_KV_L2", "off", "off, evict_last", "at import", "sparse_mla.mqa.gluon_sm90.config",
    "Gluon: `evict_last` gathers kv rows with FlashMLA's cp.async L2 hints (a 256-byte L2 prefetch under an "
    "evict-last policy, `sparse_mla/mqa/gluon_sm90/l2_hints.py`; not yet timed on a GPU), `off` with plain cp.async", tuning=True)
GLUON_FP8_PRODUCER_REGS = Switch(
    "SPARSE_MLA_GLUON_FP8_PRODUCER_REGS", "72", "an int", "at import", "sparse_mla.mqa.gluon_sm90.config",
    "Gluon: registers per producer thread of the FP8 (`fp8_ds_mla`) variant", tuning=True)

SWITCHES: tuple[Switch, ...] = (PATH, MQA_BACKEND, UNION_BACKEND, UNION_SORTED, GLUON_SCHEDULE, GLUON_O_VIA_SMEM,
                                GLUON_PERSISTENT, GLUON_KV_L2, GLUON_FP8_PRODUCER_REGS)

# The modules that define Triton / Gluon kernels (decorated at import: TRITON_INTERPRET must be set before them).
KERNEL_MODULES = (
    "sparse_mla.online_softmax",
    "sparse_mla.kv_staging",
    "sparse_mla.mqa.triton_tl",
    "sparse_mla.mqa.gluon_sm90",
    "sparse_mla.mqa.flashmla_compat",
    "sparse_mla.mqa.split_combine",
    "sparse_mla.union.planning",
    "sparse_mla.union.triton_tl",
    "sparse_mla.union.probe",
    "sparse_mla.layer.masked_mha",
    "sparse_mla.integration.index_convert",
)

_TRUE = ("1", "true", "on", "yes", "y")  # Triton's getenv_bool


def get(switch: Switch) -> str:
    """The value of ``switch`` now: the environment's, or its default when unset."""
    return os.environ.get(switch.name, switch.default)


def interpreted() -> bool:
    """Whether TRITON_INTERPRET is on, as Triton parses it (the one reader of that variable in the package)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


def kernels_imported() -> bool:
    """Whether a module that defines kernels (``KERNEL_MODULES``) is imported: TRITON_INTERPRET set after that
    no longer changes how its kernels run."""
    return any(m == k or m.startswith(k + ".") for m in list(sys.modules) for k in KERNEL_MODULES)


def _values_cell(s: Switch) -> str:
    """The values column: each value in code, the default first (unset means the default); a switch that takes
    a number shows its default and the kind of value (``72`` (an int))."""
    values = [v.strip() for v in s.values.split(",")]
    if s.default not in values:
        return f"`{s.default}` ({s.values})"
    return ", ".join(f"`{v}`" for v in [s.default, *(v for v in values if v != s.default)])


def markdown_table() -> str:
    """``SWITCHES`` as a Markdown table: the README's "Environment switches" is this text, verbatim
    (tests/test_env.py checks it); the owners are in ``Switch.owner`` and docs/decisions.md."""
    rows = ["| switch | read | values (default first) | what it does |", "|---|---|---|---|"]
    for s in SWITCHES:
        doc = s.doc + (" (tuning knob, not for production)" if s.tuning else "")
        rows.append(f"| `{s.name}` | {s.when} | {_values_cell(s)} | {doc} |")
    return "\n".join(rows) + "\n"


__all__ = ["KERNEL_MODULES", "SWITCHES", "Switch", "get", "interpreted", "kernels_imported", "markdown_table", *(
    "PATH", "MQA_BACKEND", "UNION_BACKEND", "UNION_SORTED", "GLUON_SCHEDULE", "GLUON_O_VIA_SMEM", "GLUON_PERSISTENT",
    "GLUON_KV_L2", "GLUON_FP8_PRODUCER_REGS")]

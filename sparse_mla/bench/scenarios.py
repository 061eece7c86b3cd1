"""Benchmark scenarios: model layouts at a TP size, prompt shapes like the published prefill tables."""

from __future__ import annotations

from dataclasses import dataclass

from ..workloads.models import MLAConfig, get_model

# (cached, new) per scenario: pure prefills of about 8K..46K tokens, chunked prefill with a cached
# prefix, and short continuations of a long prompt.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = (
    (0, 8192), (0, 16384), (0, 32768), (0, 46080),
    (16384, 8192), (24576, 8192),
    (32768, 256), (32768, 900),
)
# (model, TP) of the default run: 16 heads per rank for both.
DEFAULT_MODELS: tuple[tuple[str, int], ...] = (("glm-5", 4), ("deepseek-v3.2", 8))
# A scenario small enough for the Triton interpreter on a CPU.
CPU_SHAPES: tuple[tuple[int, int], ...] = ((0, 24), (40, 16))
CPU_TOPK = 64


@dataclass(frozen=True)
class Scenario:
    """One benchmark point: a model layout at a TP size, a request's cached and new tokens."""

    model: MLAConfig
    tp: int
    cached: int
    new: int
    topk: int

    @property
    def heads(self) -> int:
        return self.model.heads_per_rank(self.tp)

    @property
    def name(self) -> str:
        shape = f"{self.new}" if self.cached == 0 else f"{self.cached}+{self.new}"
        return f"{self.model.name}/tp{self.tp}/{shape}"


def build_scenarios(models: list[tuple[str, int]], shapes: list[tuple[int, int]], topk: int) -> list[Scenario]:
    """Cartesian list of scenarios. Raises ValueError on an unknown model or a TP that does not divide."""
    out = []
    for name, tp in models:
        cfg = get_model(name)
        cfg.heads_per_rank(tp)
        for cached, new in shapes:
            out.append(Scenario(cfg, tp, cached, new, topk))
    return out

"""Benchmark scenarios: model layouts at a TP size, prompt shapes like the published prefill tables."""

from __future__ import annotations

from dataclasses import dataclass

from ..workloads.models import MLAConfig, get_model

# (cached, new) per scenario: pure prefills of about 8K..46K tokens, chunked prefill with a cached
# prefix, and short continuations of a long prompt.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = (
    (0, 2048),  # prompt <= topk: the top-k is the whole prefix, dense MHA is exact
    (0, 8192), (0, 16384), (0, 32768), (0, 46080),
    (16384, 8192), (24576, 8192),
    (32768, 256), (32768, 900),
)
# (model, TP) of the default run: 16 heads per rank for both.
DEFAULT_MODELS: tuple[tuple[str, int], ...] = (("glm-5", 4), ("deepseek-v3.2", 8))
# TP of a model named without --tp: the default run's, else 1.
DEFAULT_TP = dict(DEFAULT_MODELS)
# Under torchrun (ShardQ vs TP on W GPUs, ``sparse_mla.bench.shardq``): models and prompt lengths.
SHARDQ_MODELS: tuple[str, ...] = ("glm-5", "deepseek-v3.2")
SHARDQ_TOKENS: tuple[int, ...] = (8192, 16384, 32768, 65536)
CPU_SHARDQ_TOKENS: tuple[int, ...] = (64,)  # torchrun without a GPU: interpreter sizes
# Scenarios small enough for the Triton interpreter on a CPU: a prompt that fits in the top-k
# (dense-eligible: every list is the whole prefix) and a continuation whose windows exceed it.
CPU_SHAPES: tuple[tuple[int, int], ...] = ((0, 24), (40, 16))
CPU_TOPK = 32


@dataclass(frozen=True)
class Scenario:
    """One benchmark point: a model layout at a TP size, a request's cached and new tokens, K."""

    model: MLAConfig
    tp: int
    cached: int
    new: int
    topk: int

    @property
    def heads(self) -> int:
        """Query heads per rank: model heads / tp."""
        return self.model.heads_per_rank(self.tp)

    @property
    def name(self) -> str:
        """``model/tpN/new`` or ``model/tpN/cached+new``."""
        shape = f"{self.new}" if self.cached == 0 else f"{self.cached}+{self.new}"
        return f"{self.model.name}/tp{self.tp}/{shape}"


def model_from_dims(text: str) -> MLAConfig:
    """A custom layout from ``HEADS,KV_LORA_RANK,QK_NOPE,QK_ROPE,V`` (the ``MLAConfig`` fields, e.g.
    ``128,512,128,64,128`` = DeepSeek-V3.2), named ``dims-H-r-nope-rope-v``.

    Raises:
        ValueError: not five comma-separated integers, or values ``MLAConfig`` rejects (a dim < 1;
            qk_rope may be 0).
    """
    parts = [p.strip() for p in text.split(",")]
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        vals = []
    if len(vals) != 5:
        raise ValueError(f"expected five comma-separated integers HEADS,KV_LORA_RANK,QK_NOPE,QK_ROPE,V, got {text!r}")
    return MLAConfig("dims-" + "-".join(map(str, vals)), *vals)


def build_scenarios(models: list[tuple[str | MLAConfig, int]], shapes: list[tuple[int, int]], topk: int) -> list[Scenario]:
    """Scenarios for every (model, TP) and every (cached, new) shape, model by model.

    Raises:
        ValueError: an unknown model name, a TP that does not divide the model's heads, a shape
            with new < 1 or cached < 0, topk < 1.
    """
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    out = []
    for model, tp in models:
        cfg = get_model(model) if isinstance(model, str) else model
        cfg.heads_per_rank(tp)
        for cached, new in shapes:
            if new < 1 or cached < 0:
                raise ValueError(f"a scenario needs new >= 1 and cached >= 0 tokens, got cached {cached}, new {new}")
            out.append(Scenario(cfg, tp, cached, new, topk))
    return out


__all__ = ["Scenario", "DEFAULT_SHAPES", "DEFAULT_MODELS", "DEFAULT_TP", "CPU_SHAPES", "CPU_TOPK", "SHARDQ_MODELS",
           "SHARDQ_TOKENS", "CPU_SHARDQ_TOKENS", "model_from_dims", "build_scenarios"]

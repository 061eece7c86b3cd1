"""Attention dimensions of the DSA (DeepSeek Sparse Attention) models this package targets.

Source of the numbers: the published model configs (docs/DESIGN.md "The paths": DeepSeek-V3.2
heads 128, kv_lora 512, qk_nope 128, qk_rope 64, v 128; GLM-5 64, 512, 192, 64, 256;
GLM-5.3-Flash NoPE 64, 512, 256, 0, 256), with the indexer's top-k 2048 (``index_topk``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    """Dimensions of one model's MLA attention layer (Hugging Face config field names).

    Attributes:
        name: the model's short name (the key in ``MODELS``).
        num_heads: query heads per layer before tensor parallelism (``num_attention_heads``).
        kv_lora_rank: width of the compressed latent kv_c, the value width of the absorbed
            (MQA) kernel (``d_v`` of ``sparse_mla_fwd``).
        qk_nope_head_dim: per-head query/key width without rotary embedding.
        qk_rope_head_dim: per-head rotary width, shared by all heads as one latent column block
            (0 for a NoPE layout).
        v_head_dim: per-head output width after W_UV (the MHA paths' V width).
        topk: rows the lightning indexer selects per query (``index_topk``, 2048).
    """

    name: str
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    topk: int = 2048

    def __post_init__(self) -> None:
        for field in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "topk"):
            v = getattr(self, field)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MLAConfig.{field} must be a positive int, got {v!r}")
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 0:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be an int >= 0, got {self.qk_rope_head_dim!r}")

    @property
    def d_qk(self) -> int:
        """Row width of the latent cache and of the absorbed query: kv_lora_rank + qk_rope_head_dim
        (576 for DeepSeek-V3.2 / GLM-5, 512 for the NoPE GLM-5.3-Flash)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def d_v(self) -> int:
        """Value width of the absorbed (MQA) kernel: kv_lora_rank (512). Not v_head_dim, which is
        the per-head width after the W_UV projection."""
        return self.kv_lora_rank

    @property
    def sm_scale(self) -> float:
        """Softmax scale (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, the per-head q.k width of
        the unabsorbed attention; absorption does not change it.

        This is the model's scale before any YaRN long-context correction: DeepSeek-V3-style
        models with rope_scaling multiply it by mscale ** 2, where
        mscale = 0.1 * mscale_all_dim * ln(factor) + 1. Apply that yourself when the served
        context exceeds the original one.
        """
        return float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)

    def heads_per_rank(self, tp: int) -> int:
        """Query heads one rank holds under tensor parallelism of size ``tp``: num_heads // tp.

        Raises:
            TypeError: tp is not an int.
            ValueError: tp < 1, or num_heads is not divisible by tp.
        """
        if not isinstance(tp, int) or isinstance(tp, bool):
            raise TypeError(f"tp must be an int, got {type(tp).__name__}")
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if self.num_heads % tp:
            raise ValueError(f"{self.name}: num_heads = {self.num_heads} is not divisible by tp = {tp}")
        return self.num_heads // tp


MODELS: dict[str, MLAConfig] = {
    "deepseek-v3.2": MLAConfig("deepseek-v3.2", 128, 512, 128, 64, 128),
    "glm-5": MLAConfig("glm-5", 64, 512, 192, 64, 256),
    "glm-5.3-flash": MLAConfig("glm-5.3-flash", 64, 512, 256, 0, 256),
}


def get_model(name: str) -> MLAConfig:
    """The ``MLAConfig`` registered under ``name`` (case-insensitive) in ``MODELS``.

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[key]

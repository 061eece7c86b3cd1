"""transformers' DSA models on this library's sparse MQA: ``apply(model)`` / ``undo(model)`` (the ``hf`` extra).

``apply`` replaces, in place, the forward of every DSA attention module of a loaded model of transformers >= 5.23
with one that runs it on ``sparse_mla_fwd``; the model's projections, indexers, compressors, rope and cache stay
transformers' own. Per family (``sparse_mla/integration/hf/``):

* DeepseekV32 (DeepSeek-V3.2) and GlmMoeDsa (GLM-5), ``hf/dsa.py``: the absorbed (latent) form on latent rows
  c_kv | k_pe (D_qk 576), the indexer's top-k under eager's 4D mask (``latent_rows``);
* Glm5Next (GLM-5.3-Flash, the NoPE layout), ``hf/glm5_next.py``: the absorbed form on 512-wide c_kv rows (D_qk 512),
  the pooled indexer's -1 padded top-k (``topk_rows``);
* DeepseekV4, ``hf/deepseek_v4.py``: no latent: the shared K = V rows (sliding window + compressed rows, D_qk 512)
  each query's mask keeps (``v4_rows``), the per-head sink as ``attn_sink``.

A query with no valid row gets 0 (eager's softmax over a fully masked row is not 0: left-padding rows differ).
Inference only (the op has no backward): a call that would need gradients raises. The semantics, each with the
test that holds it: docs/integration.md, "transformers". transformers is imported here only, lazily.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch

from .hf import deepseek_v4, dsa, glm5_next
from .hf.common import STATE as _STATE
from .hf.common import latent_attention, latent_rows
from .hf.deepseek_v4 import v4_rows
from .hf.glm5_next import topk_rows

# model family (config.model_type) -> its DSA attention class
SUPPORTED = {"deepseek_v32": "DeepseekV32Attention", "glm_moe_dsa": "GlmMoeDsaAttention",
             "glm5_next": "Glm5NextTextAttention", "deepseek_v4": "DeepseekV4Attention"}
_SERVES = {"deepseek_v32": dsa, "glm_moe_dsa": dsa, "glm5_next": glm5_next, "deepseek_v4": deepseek_v4}
_NAMES = "DeepseekV32, GlmMoeDsa, Glm5Next and DeepseekV4"
MIN_TRANSFORMERS = (5, 23)


@dataclass
class Patched:
    """What ``apply`` did: the patched attention modules (name -> module); ``undo()`` restores their forwards
    (also a context manager: ``with apply(model): ...``)."""

    model: torch.nn.Module
    family: str
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)

    def undo(self) -> None:
        for module in self.modules.values():
            _restore(module)

    def __enter__(self) -> Patched:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def apply(model: torch.nn.Module, *, method: str = "auto") -> Patched:
    """Run the DSA attention of a DeepseekV32, GlmMoeDsa, Glm5Next or DeepseekV4 model (or any module holding their
    attention modules) on ``sparse_mla_fwd``, in place; ``method`` goes to the op ("auto", "per_token", "grouped").

    Raises (nothing patched then): ValueError for a model with no DSA attention module, a layout the op cannot
    serve (V32 / GLM-5: kv_lora_rank != 512 or qk_rope_head_dim != 64; Glm5Next: kv_lora_rank != 512 or a rope part;
    V4: head_dim != 512 or more than one kv head; a module without the expected projections, rope, indexer or sinks)
    or transformers older than 5.23; TypeError for weights other than bf16 / fp16; ImportError without transformers
    (the ``hf`` extra). Applying twice leaves one patch."""
    try:
        import transformers
    except ModuleNotFoundError as exc:
        if exc.name != "transformers":  # installed, but something it imports is missing: its own error
            raise
        raise ImportError("sparse_mla.integration.transformers.apply needs transformers >= 5.23: "
                          "pip install 'sparse-mla[hf]'") from exc

    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        raise ValueError(f"sparse_mla.integration.transformers needs transformers >= 5.23, found {transformers.__version__}")
    if method not in ("auto", "per_token", "grouped"):
        raise ValueError(f"method must be 'auto', 'per_token' or 'grouped', got {method!r}")
    family, found = _find_attention(model)
    extras = {name: _SERVES[family].check(name, module, family) for name, module in found.items()}
    patched = Patched(model, family)
    for name, module in found.items():
        _patch(module, family, method, extras[name])
        patched.modules[name] = module
    return patched


def undo(model: torch.nn.Module) -> int:
    """Restore every attention forward ``apply`` replaced in ``model``; returns how many."""
    n = 0
    for module in model.modules():
        if _STATE in module.__dict__:
            _restore(module)
            n += 1
    return n


def is_applied(model: torch.nn.Module) -> bool:
    """Whether some attention module of ``model`` runs on this library."""
    return any(_STATE in m.__dict__ for m in model.modules())


def _find_attention(model: torch.nn.Module) -> tuple[str, dict[str, torch.nn.Module]]:
    wanted = {cls: fam for fam, cls in SUPPORTED.items()}
    found: dict[str, torch.nn.Module] = {}
    families = set()
    for name, module in model.named_modules():
        cls = type(module).__name__
        if not type(module).__module__.startswith("transformers."):
            continue
        if cls in wanted:
            found[name] = module
            families.add(wanted[cls])
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"no DSA attention module to serve in {type(model).__name__} (model_type {model_type!r}): "
                         f"sparse_mla.integration.transformers serves {_NAMES} models")
    if len(families) > 1:
        raise ValueError(f"one model family at a time, found {sorted(families)}")
    return families.pop(), found


def _patch(module: torch.nn.Module, family: str, method: str, extra: dict) -> None:
    if _STATE in module.__dict__:
        module.__dict__[_STATE]["method"] = method
        return
    # accelerate's hooks wrap an instance-level forward around `_old_forward`: replace the wrapped one
    attr = "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"
    module.__dict__[_STATE] = {"family": family, "method": method, "attr": attr, "saved": module.__dict__.get(attr),
                               **extra}
    setattr(module, attr, types.MethodType(_SERVES[family].forward, module))


def _restore(module: torch.nn.Module) -> None:
    state = module.__dict__.pop(_STATE, None)
    if state is None:
        return
    if state["saved"] is None:
        module.__dict__.pop(state["attr"], None)
    else:
        setattr(module, state["attr"], state["saved"])


__all__ = ["apply", "undo", "is_applied", "Patched", "latent_rows", "topk_rows", "v4_rows", "latent_attention",
           "SUPPORTED"]

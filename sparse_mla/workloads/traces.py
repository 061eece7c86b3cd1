"""Top-k trace files dumped by an inference engine, so benchmarks can run on real prompts.

A trace holds, per attention layer, the indexer's output for the T query tokens of one step:
``topk`` [T, K] int32 (rows or request-local positions, -1 = padding) and ``valid`` [T] int32
(how many leading entries of each row count, docs/DESIGN.md "Workloads"), plus an optional layer id.

File layouts read by ``load_trace`` (``save_trace`` writes the first of each):

.pt / .pth (``torch.save``; read with ``torch.load(weights_only=True)``):
  * a list of dicts ``{"topk": T, "valid": T, "layer": int}`` ("layer" optional), one per layer;
  * one such dict;
  * a flat dict ``{"layer_3.topk": T, "layer_3.valid": T, ...}`` (also ``layer3.topk``).
.safetensors (needs the safetensors package: ``pip install 'sparse-mla[bench]'``):
  * ``layer_{L}.topk`` / ``layer_{L}.valid`` per layer L (``layer{L}.`` is read too);
  * or ``topk`` / ``valid`` for a single trace without a layer id.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_LAYER_KEY = re.compile(r"^layer_?(\d+)\.(topk|valid)$")
_PT_SUFFIXES = (".pt", ".pth")
_ST_SUFFIXES = (".safetensors",)


def _safetensors_torch():
    """``safetensors.torch``, imported when a .safetensors file is read or written (it is not a core dependency).

    Raises:
        ImportError: safetensors is not installed; the message names the extra that brings it.
    """
    try:
        import safetensors.torch
    except ImportError as e:
        raise ImportError(".safetensors trace files need the safetensors package: pip install 'sparse-mla[bench]'") from e
    return safetensors.torch


@dataclass(frozen=True)
class TopkTrace:
    """One layer's top-k lists for one step.

    Attributes:
        layer: layer id (int >= 0) or None when the file carries none.
        topk: [T, K] int32, CPU unless loaded elsewhere; entries < 0 are padding.
        valid: [T] int32 in [0, K]: only the first valid[t] entries of row t count.

    Raises (on construction):
        TypeError / ValueError: the checks of ``check_trace``.
    """

    layer: int | None
    topk: torch.Tensor
    valid: torch.Tensor

    def __post_init__(self) -> None:
        check_trace(self.topk, self.valid, self.layer, "TopkTrace")


def check_trace(topk: object, valid: object, layer: object, where: str) -> None:
    """Validate one trace's tensors; ``where`` (file and key) prefixes every message.

    Raises:
        TypeError: topk / valid not int32 tensors, layer not an int or None.
        ValueError: topk not [T, K] with K >= 1, valid not [T], valid outside [0, K], layer < 0,
            tensors on different devices.
    """
    if not isinstance(topk, torch.Tensor):
        raise TypeError(f"{where}: topk must be a tensor [T, K] int32, got {type(topk).__name__}")
    if topk.dtype != torch.int32:
        raise TypeError(f"{where}: topk must be int32 [T, K], got dtype {topk.dtype} (convert with .int())")
    if topk.dim() != 2 or topk.shape[1] < 1:
        raise ValueError(f"{where}: topk must be [T, K] with K >= 1, got shape {tuple(topk.shape)}")
    if not isinstance(valid, torch.Tensor):
        raise TypeError(f"{where}: valid must be a tensor [T] int32, got {type(valid).__name__}")
    if valid.dtype != torch.int32:
        raise TypeError(f"{where}: valid must be int32 [T], got dtype {valid.dtype} (convert with .int())")
    T, K = topk.shape
    if valid.shape != (T,):
        raise ValueError(f"{where}: valid must be [T] = [{T}] (one count per topk row), got shape {tuple(valid.shape)}")
    if valid.device != topk.device:
        raise ValueError(f"{where}: valid is on {valid.device} but topk on {topk.device}")
    if T and (int(valid.min()) < 0 or int(valid.max()) > K):
        raise ValueError(f"{where}: valid must be in [0, K = {K}], got range [{int(valid.min())}, {int(valid.max())}]")
    if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
        raise TypeError(f"{where}: layer must be an int or None, got {type(layer).__name__}")
    if layer is not None and layer < 0:
        raise ValueError(f"{where}: layer must be >= 0, got {layer}")


def _suffix(path: str) -> str:
    low = path.lower()
    for s in _PT_SUFFIXES + _ST_SUFFIXES:
        if low.endswith(s):
            return s
    raise ValueError(f"{path}: unknown trace file type; expected one of {_PT_SUFFIXES + _ST_SUFFIXES}")


def _layer_value(v: object, where: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype.is_floating_point:
        return int(v.item())
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise TypeError(f"{where}: layer must be an int, got {type(v).__name__}")


def _from_single_dict(d: dict, where: str) -> TopkTrace:
    extra = sorted(set(d) - {"topk", "valid", "layer"})
    if extra:
        raise ValueError(f"{where}: unexpected keys {extra}; a trace dict holds 'topk', 'valid' and optionally 'layer'")
    for key in ("topk", "valid"):
        if key not in d:
            raise ValueError(f"{where}: missing key '{key}' (a trace needs 'topk' [T, K] and 'valid' [T] int32)")
    layer = _layer_value(d.get("layer"), f"{where} key 'layer'")
    check_trace(d["topk"], d["valid"], layer, f"{where} keys 'topk'/'valid'")
    return TopkTrace(layer, d["topk"], d["valid"])


def _from_layer_keys(d: dict, where: str) -> list[TopkTrace]:
    parts: dict[int, dict[str, tuple[str, object]]] = {}
    for key, v in d.items():
        m = _LAYER_KEY.match(key) if isinstance(key, str) else None
        if m is None:
            raise ValueError(f"{where}: unexpected key {key!r}; expected 'layer_<L>.topk' / 'layer_<L>.valid' "
                             "(or 'topk' / 'valid' for a single trace)")
        layer, kind = int(m.group(1)), m.group(2)
        if kind in parts.setdefault(layer, {}):
            raise ValueError(f"{where}: layer {layer} has two '{kind}' keys ({parts[layer][kind][0]!r} and {key!r})")
        parts[layer][kind] = (key, v)
    traces = []
    for layer in sorted(parts):
        p = parts[layer]
        for kind in ("topk", "valid"):
            if kind not in p:
                raise ValueError(f"{where}: layer {layer} has no '{kind}' key (expected 'layer_{layer}.{kind}')")
        (kt, topk), (kv, valid) = p["topk"], p["valid"]
        check_trace(topk, valid, layer, f"{where} keys {kt!r}/{kv!r}")
        traces.append(TopkTrace(layer, topk, valid))
    return traces


def _parse(obj: object, where: str) -> list[TopkTrace]:
    if isinstance(obj, dict):
        if not obj:
            raise ValueError(f"{where}: empty dict, no trace in it")
        if "topk" in obj or "valid" in obj:
            return [_from_single_dict(obj, where)]
        return _from_layer_keys(obj, where)
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise ValueError(f"{where}: empty list, no trace in it")
        out = []
        for i, d in enumerate(obj):
            if not isinstance(d, dict):
                raise TypeError(f"{where}[{i}]: expected a dict with 'topk' and 'valid', got {type(d).__name__}")
            out.append(_from_single_dict(d, f"{where}[{i}]"))
        return out
    raise TypeError(f"{where}: expected a dict or a list of dicts of tensors, got {type(obj).__name__}")


def load_trace(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> list[TopkTrace]:
    """Read a top-k trace file (layouts in the module docstring).

    Args:
        path: a .pt / .pth (torch.save, loaded with weights_only=True) or .safetensors file.
        device: where the returned tensors live.

    Returns:
        list of ``TopkTrace`` (layer-keyed files sorted by layer), each topk [T, K] int32 and
        valid [T] int32 on ``device``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: an unknown suffix, an unreadable file, unexpected or missing keys, bad shapes
            or valid counts; the message names the file and the key.
        TypeError: a non-int32 tensor or a wrong object type, naming the file and the key.
        ImportError: a .safetensors file without the safetensors package (the message names the extra).
    """
    path = os.fspath(path)
    suffix = _suffix(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"trace file not found: {path}")
    st = None if suffix in _PT_SUFFIXES else _safetensors_torch()
    try:
        if st is None:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        else:
            obj = st.load_file(path, device="cpu")
    except Exception as e:  # the libraries raise assorted types for a corrupt file
        raise ValueError(f"{path}: cannot read as a {suffix} trace file: {type(e).__name__}: {e}") from e
    traces = _parse(obj, path)
    dev = torch.device(device)
    return [TopkTrace(t.layer, t.topk.to(dev), t.valid.to(dev)) for t in traces]


def save_trace(path: str | os.PathLike, traces: TopkTrace | Sequence[TopkTrace]) -> None:
    """Write traces in the first layout of the module docstring for the file's suffix.

    .pt: a list of dicts {"topk", "valid"[, "layer"]} (one dict when there is one trace without
    a layer). .safetensors: ``layer_{L}.topk`` / ``layer_{L}.valid``, or ``topk`` / ``valid`` for
    a single trace without a layer. Tensors are written from CPU copies, contiguous.

    Raises:
        ValueError: an unknown suffix, no traces, or (.safetensors) several traces of which some
            have no layer or two share one.
        TypeError: an element that is not a ``TopkTrace``.
        ImportError: a .safetensors file without the safetensors package (the message names the extra).
    """
    path = os.fspath(path)
    suffix = _suffix(path)
    traces = [traces] if isinstance(traces, TopkTrace) else list(traces)
    if not traces:
        raise ValueError("save_trace: no traces to write")
    for i, t in enumerate(traces):
        if not isinstance(t, TopkTrace):
            raise TypeError(f"save_trace: traces[{i}] is a {type(t).__name__}, expected TopkTrace")
    cpu = [(t.layer, t.topk.detach().cpu().contiguous(), t.valid.detach().cpu().contiguous()) for t in traces]
    single = len(cpu) == 1 and cpu[0][0] is None
    if suffix in _PT_SUFFIXES:
        if single:
            torch.save({"topk": cpu[0][1], "valid": cpu[0][2]}, path)
        else:
            torch.save([{"topk": k, "valid": v, **({} if layer is None else {"layer": layer})} for layer, k, v in cpu], path)
        return
    save_file = _safetensors_torch().save_file
    if single:
        save_file({"topk": cpu[0][1], "valid": cpu[0][2]}, path, metadata={"format": "sparse-mla-topk-trace"})
        return
    layers = [layer for layer, _, _ in cpu]
    if any(layer is None for layer in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"save_trace: a .safetensors file with several traces needs distinct int layers, got {layers}")
    tensors = {}
    for layer, k, v in cpu:
        tensors[f"layer_{layer}.topk"] = k
        tensors[f"layer_{layer}.valid"] = v
    save_file(tensors, path, metadata={"format": "sparse-mla-topk-trace"})

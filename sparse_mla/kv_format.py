"""Latent-cache formats other than plain rows in q's dtype: the FP8 ``fp8_ds_mla`` cache of DeepSeek-V3.2.

``kv_format=None`` (the default everywhere) means the cache holds latent rows [N, D_qk] in q's dtype.
``kv_format="fp8_ds_mla"`` means the 656-byte FP8 rows that FlashMLA's FP8 sparse decode (its
``V32_FP8Sparse`` layout, ``tests/quant.py``) and vLLM's ``fp8_ds_mla`` cache dtype
(``concat_and_cache_ds_mla``) store per token and layer:

    bytes [0, 512)    kv_c quantized: 512 float8_e4m3fn values (OCP E4M3, max 448, no inf), tile i = values
                      128 i .. 128 i + 127
    bytes [512, 528)  4 float32 scales, scale[i] of tile i (little endian, as the GPU reads them)
    bytes [528, 656)  k_pe: 64 bfloat16 values, stored as they are (not quantized)

Dequantized row (the definition every consumer uses; ``FP8DSMLAFormat.dequantize``):

    kv_c[c] = dtype(float32(e4m3[c]) * scale[c // 128])   (one rounding, from the fp32 product to dtype)
    k_pe[j] = dtype(bf16[j])

``dtype`` is q's dtype in the kernels and the references (``sparse_mla_ref``, ``dsa_prefill_ref``
dequantize the cache to q's dtype first), so kernel and reference read the same numbers; the only error a
sparse MLA result carries beyond a bf16 / fp16 cache's is the cache's own quantization. With power-of-two
scales (``scale_format="ue8m0"``) the fp32 product is exact in bf16, so dequantizing to bf16 or fp32 gives the
same values.

Quantization (``FP8DSMLAFormat.quantize``, the torch reference of what an engine writes), per tile of 128:

    amax  = max |kv_c[tile]|
    scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))   scale_format "ue8m0" (FlashMLA's tests/quant.py)
          = max(amax / 448, FLT_MIN)                 scale_format "fp32"  (vLLM's concat_and_cache_ds_mla)
    e4m3  = float8_e4m3fn(clamp(kv_c / scale, -448, 448))   (round to nearest even, saturating)

so |kv_c - dequantized| <= scale * 2**-4 per value (half an E4M3 step at the tile's largest binade;
relative 2**-4 of the tile's amax at most, less in the fp32 form). A tile holding a NaN or an inf has a
non-finite scale here (as in FlashMLA's quantizer) and dequantizes to NaN everywhere. vLLM's writer differs on a
NaN: its fmaxf amax skips it, so the tile keeps a finite scale and the NaN value alone gets the E4M3 NaN code
(dequantized: NaN at that value only).

The storage tensor may be uint8 (vLLM) or float8_e4m3fn (FlashMLA's tests); shapes [N, 656], paged
[num_blocks, block_size, 656], or FlashMLA's [num_blocks, block_size, 1, 656]. Each row must start on a
16-byte boundary (base pointer and row stride), since the scales and k_pe are read as 4- and 2-byte words
and the GPU kernels move 16-byte vectors; a contiguous cache always is (656 = 41 x 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DS_MLA_NAME = "fp8_ds_mla"
# How the attention reads an FP8 cache (``kv_dequant=`` of sparse_mla_fwd and dsa_prefill; sparse_mla.kv_staging):
# the measured rule, dequantizing each gathered row in the kernel, or staging the readable rows to q's dtype first.
KV_DEQUANT_MODES = ("auto", "in_kernel", "staged")
SCALE_FORMATS = ("ue8m0", "fp32")
E4M3_MAX = 448.0
UE8M0_MIN_SCALE_INV = 1e-4  # FlashMLA's tests/quant.py clamp of amax / 448 before rounding up to a power of two


@dataclass(frozen=True)
class FP8DSMLAFormat:
    """The ``fp8_ds_mla`` row layout (module docstring): byte offsets, validation, quantize / dequantize.

    All methods are plain PyTorch on any device; the kernels read the same bytes
    (``sparse_mla.mqa.triton_tl``).
    """

    name: str = FP8_DS_MLA_NAME
    kv_lora_rank: int = 512  # NoPE values per row (kv_c), the value width d_v
    qk_rope_head_dim: int = 64  # RoPE values per row (k_pe), bf16
    tile_size: int = 128  # values per fp32 scale
    scale_offset: int = 512  # bytes
    rope_offset: int = 528  # bytes
    row_bytes: int = 656
    row_align: int = 16  # bytes: base pointer and row stride
    storage_dtypes: tuple[torch.dtype, ...] = (torch.uint8, torch.float8_e4m3fn)

    @property
    def num_tiles(self) -> int:
        """Scales per row (4)."""
        return self.kv_lora_rank // self.tile_size

    @property
    def d_qk(self) -> int:
        """Values per dequantized row: kv_lora_rank + qk_rope_head_dim (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ------------------------------------------------------------------ validation
    def check(self, cache: object, name: str = "kv") -> torch.Tensor:
        """Check a cache tensor of this format and return it as uint8 bytes of the same shape (a view).

        Args:
            cache: [..., 656] uint8 or float8_e4m3fn, any device, last dim contiguous, every row starting
                on a 16-byte boundary (base pointer and all but the last stride multiples of 16 bytes).
            name: the argument's name, for the messages.

        Raises:
            TypeError: not a tensor, or another dtype.
            ValueError: a last dim other than 656, a last dim that is not contiguous, or misaligned rows.
        """
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor holding {self.name} rows, got {type(cache).__name__}")
        if cache.dtype not in self.storage_dtypes:
            allowed = " or ".join(str(d).replace("torch.", "") for d in self.storage_dtypes)
            raise TypeError(f"{name} with kv_format={self.name!r} must be {allowed} bytes [..., {self.row_bytes}] (512 "
                            f"float8_e4m3 + 4 float32 scales + 64 bfloat16 per row), got dtype {cache.dtype}")
        if cache.dim() < 1 or cache.shape[-1] != self.row_bytes:
            raise ValueError(f"{name} with kv_format={self.name!r} must have rows of {self.row_bytes} bytes (512 float8_e4m3 + "
                             f"4 float32 scales + 64 bfloat16), got shape {tuple(cache.shape)}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (the {self.row_bytes} bytes of a row), got strides "
                             f"{tuple(cache.stride())}")
        if cache.numel() and cache.device.type != "meta":
            bad = [d for d in range(cache.dim() - 1) if cache.shape[d] > 1 and cache.stride(d) % self.row_align]
            if bad:
                raise ValueError(f"{name}: every {self.name} row must start on a {self.row_align}-byte boundary (the float32 "
                                 f"scales and bfloat16 k_pe are read as words); stride {cache.stride(bad[0])} along dim "
                                 f"{bad[0]} is not a multiple of {self.row_align}")
            try:
                ptr = cache.data_ptr()
            except (RuntimeError, NotImplementedError):  # FakeTensor / functional tensors (torch.compile) carry no address
                ptr = 0
            if ptr % self.row_align:
                raise ValueError(f"{name}: the first {self.name} row must start on a {self.row_align}-byte boundary, got "
                                 f"address {ptr:#x} (a view that starts inside a row?)")
        return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)

    def as_rows(self, cache: object, name: str = "kv") -> torch.Tensor:
        """The cache as rows: uint8 [N, 656] (a view, no copy), after ``check``.

        Args:
            cache: [N, 656], paged [num_blocks, block_size, 656] (block stride = block_size * row stride), or
                FlashMLA's [num_blocks, block_size, 1, 656]; uint8 or float8_e4m3fn. A paged cache whose blocks
                are farther apart goes through ``sparse_mla.integration.paged_kv_as_rows`` (with
                ``kv_format``) and block-table-converted indices.
            name: the argument's name, for the messages.

        Raises:
            TypeError, ValueError: as ``check``; another rank, or a paged cache whose block stride is not
                block_size * row stride.
        """
        b = self.check(cache, name)
        if b.dim() == 4:
            if b.shape[2] != 1:
                raise ValueError(f"{name} given as [num_blocks, block_size, h_k, {self.row_bytes}] (FlashMLA's layout) needs "
                                 f"h_k = 1, got shape {tuple(b.shape)}")
            b = b[:, :, 0]
        if b.dim() == 2:
            return b
        if b.dim() == 3:
            nb, bs, d = b.shape
            if nb > 1 and b.stride(0) != bs * b.stride(1):
                raise ValueError(f"{name}: a paged cache [num_blocks, block_size, {d}] must have block stride block_size * row "
                                 f"stride = {bs * b.stride(1)} to be viewed as rows, got {b.stride(0)} (use "
                                 "sparse_mla.integration.paged_kv_as_rows and block-table-converted indices)")
            return b.as_strided((nb * bs, d), (b.stride(1), 1))
        raise ValueError(f"{name} with kv_format={self.name!r} must be [N, {self.row_bytes}], [num_blocks, block_size, "
                         f"{self.row_bytes}] or [num_blocks, block_size, 1, {self.row_bytes}], got shape {tuple(b.shape)}")

    # ------------------------------------------------------------------ views of the fields
    def nope(self, cache: torch.Tensor) -> torch.Tensor:
        """[..., 512] float8_e4m3fn view of the quantized kv_c (no copy)."""
        return self.check(cache, "cache")[..., : self.kv_lora_rank].view(torch.float8_e4m3fn)

    def scales(self, cache: torch.Tensor) -> torch.Tensor:
        """[..., 4] float32 view of the tile scales (no copy)."""
        return self.check(cache, "cache")[..., self.scale_offset: self.rope_offset].view(torch.float32)

    def rope(self, cache: torch.Tensor) -> torch.Tensor:
        """[..., 64] bfloat16 view of k_pe (no copy)."""
        return self.check(cache, "cache")[..., self.rope_offset:].view(torch.bfloat16)

    # ------------------------------------------------------------------ quantize / dequantize
    def quantize(self, kv: torch.Tensor, *, scale_format: str = "ue8m0", out: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize latent rows into this format (the torch reference of an engine's cache write).

        Args:
            kv: [..., 576] bf16 / fp16 / fp32 rows, kv_c | k_pe (the package's ``kv``: kv_lora_rank 512 then
                qk_rope_head_dim 64), any device and strides.
            scale_format: "ue8m0" (power-of-two scales 2**ceil(log2(max(amax / 448, 1e-4))), FlashMLA's
                tests/quant.py) or "fp32" (amax / 448, at least FLT_MIN: vLLM's concat_and_cache_ds_mla).
            out: optional [..., 656] uint8 / float8_e4m3fn destination with kv's leading shape (e.g. slots
                of a paged cache), written and returned; allocated contiguous uint8 when None.

        Returns:
            the cache bytes [..., 656] (``out`` when given).

        Raises:
            TypeError: kv not a floating tensor; out of another dtype.
            ValueError: kv's last dim not 576, an unknown scale_format, out of another shape or device.
        """
        if not isinstance(kv, torch.Tensor) or not kv.dtype.is_floating_point or kv.element_size() < 2:
            raise TypeError(f"kv must be a bf16 / fp16 / fp32 tensor [..., {self.d_qk}], got "
                            f"{kv.dtype if isinstance(kv, torch.Tensor) else type(kv).__name__}")
        if kv.dim() < 1 or kv.shape[-1] != self.d_qk:
            raise ValueError(f"kv must be [..., {self.d_qk}] (kv_lora_rank {self.kv_lora_rank} + qk_rope_head_dim "
                             f"{self.qk_rope_head_dim}), got shape {tuple(kv.shape)}")
        if scale_format not in SCALE_FORMATS:
            raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
        lead = tuple(kv.shape[:-1])
        if out is None:
            out = torch.empty(*lead, self.row_bytes, dtype=torch.uint8, device=kv.device)
        b = self.check(out, "out")
        if tuple(b.shape[:-1]) != lead or b.device != kv.device:
            raise ValueError(f"out must be [..., {self.row_bytes}] with kv's leading shape {list(lead)} on {kv.device}, got "
                             f"shape {tuple(b.shape)} on {b.device}")
        x = kv[..., : self.kv_lora_rank].float().unflatten(-1, (self.num_tiles, self.tile_size))
        amax = x.abs().amax(dim=-1)  # [..., 4]; NaN if the tile holds one
        if scale_format == "ue8m0":
            v = amax.div(E4M3_MAX).clamp_min(UE8M0_MIN_SCALE_INV)
            mant, exp = torch.frexp(v)  # v = mant * 2**exp, mant in [0.5, 1): the next power of two is 2**exp
            scale = torch.where(mant == 0.5, v, torch.ldexp(torch.ones_like(v), exp))
            scale = torch.where(torch.isfinite(v), scale, v)  # NaN / inf tiles keep a non-finite scale
        else:
            scale = amax.div(E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
            scale = torch.where(amax.isnan(), amax, scale)  # clamp_min maps NaN to NaN already; explicit
        q8 = (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        b[..., : self.kv_lora_rank] = q8.flatten(-2).view(torch.uint8)
        b[..., self.scale_offset: self.rope_offset] = scale.contiguous().view(torch.uint8)
        b[..., self.rope_offset:] = kv[..., self.kv_lora_rank:].to(torch.bfloat16).contiguous().view(torch.uint8)
        return out

    def dequantize(self, cache: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                   rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Dequantized rows (module docstring): kv_c = dtype(fp32(e4m3) * scale), k_pe = dtype(bf16).

        Args:
            cache: [..., 656] uint8 / float8_e4m3fn (``check``), any device.
            dtype: the result's dtype (q's dtype in the kernels and references: bf16, fp16 or fp32).
            rows: optional 1-D integer tensor of row ids into ``as_rows(cache)`` (on its device; every id in
                [0, N)): dequantize only those rows, in that order, giving [len(rows), 576].
            out: optional destination [..., 576] (or [len(rows), 576]) of ``dtype`` on the cache's device,
                written and returned.

        Returns:
            [..., 576] (or [len(rows), 576]) ``dtype`` rows, kv_c | k_pe.

        Raises:
            TypeError, ValueError: as ``check`` / ``as_rows``; rows not a 1-D integer tensor on the cache's
                device; out of another shape, dtype or device. An id outside [0, N) raises torch's IndexError.
        """
        if rows is not None:
            if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
                raise ValueError(f"rows must be a 1-D integer tensor of row ids, got {rows!r:.80}")
            b = self.as_rows(cache, "cache")
            if rows.device != b.device:
                raise ValueError(f"rows is on {rows.device} but the cache is on {b.device}")
            b = b.index_select(0, rows.long())
        else:
            b = self.check(cache, "cache")
        shape = (*b.shape[:-1], self.d_qk)
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=b.device)
        elif not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != shape or out.device != b.device:
            raise ValueError(f"out must be {list(shape)} {dtype} on {b.device}, got "
                             f"{(out.dtype, tuple(out.shape), out.device) if isinstance(out, torch.Tensor) else out!r}")
        q8 = b[..., : self.kv_lora_rank].view(torch.float8_e4m3fn).float().unflatten(-1, (self.num_tiles, self.tile_size))
        scale = b[..., self.scale_offset: self.rope_offset].view(torch.float32)
        out[..., : self.kv_lora_rank] = (q8 * scale[..., None]).flatten(-2)
        out[..., self.kv_lora_rank:] = b[..., self.rope_offset:].view(torch.bfloat16)
        return out


FP8_DS_MLA = FP8DSMLAFormat()
KV_FORMATS: dict[str, FP8DSMLAFormat] = {FP8_DS_MLA_NAME: FP8_DS_MLA}


def check_kv_format(kv_format: object) -> str | None:
    """``kv_format`` itself: None (latent rows in q's dtype) or a name of ``KV_FORMATS`` ("fp8_ds_mla").

    Raises:
        TypeError: neither None nor a string. ValueError: an unknown name.
    """
    if kv_format is None:
        return None
    if not isinstance(kv_format, str):
        raise TypeError(f"kv_format must be None (latent rows in q's dtype) or a string in {tuple(KV_FORMATS)}, got "
                        f"{type(kv_format).__name__} {kv_format!r}")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be None (latent rows in q's dtype) or one of {tuple(KV_FORMATS)}, got {kv_format!r}")
    return kv_format


def looks_like_fp8_ds_mla(kv: torch.Tensor) -> bool:
    """Whether a tensor passed as plain rows is probably an fp8_ds_mla cache (uint8 / float8, 656 wide): for a
    hint in the error message, never to pick the format silently."""
    return kv.dtype in FP8_DS_MLA.storage_dtypes and kv.dim() >= 1 and kv.shape[-1] == FP8_DS_MLA.row_bytes


__all__ = ["FP8DSMLAFormat", "FP8_DS_MLA", "FP8_DS_MLA_NAME", "KV_DEQUANT_MODES", "KV_FORMATS", "SCALE_FORMATS",
           "E4M3_MAX", "check_kv_format", "looks_like_fp8_ds_mla", "kv_rows_of_format"]


def kv_rows_of_format(kv: object, kv_format: str, d_qk: int, d_qk_name: str, name: str = "kv") -> torch.Tensor:
    """A cache of ``kv_format`` (not None) checked and viewed as its byte rows [N, row_bytes]
    (``sparse_mla.kv_format``), for a problem whose D_qk (``d_qk``, named ``d_qk_name`` in messages) must be
    the format's.

    Raises:
        TypeError, ValueError: as ``FP8DSMLAFormat.as_rows``; ValueError when d_qk is not the format's D_qk.
    """
    fmt = KV_FORMATS[kv_format]
    rows = fmt.as_rows(kv, name)
    if d_qk != fmt.d_qk:
        raise ValueError(f"{d_qk_name} must be {fmt.d_qk} (kv_lora_rank {fmt.kv_lora_rank} + qk_rope_head_dim "
                         f"{fmt.qk_rope_head_dim}) with kv_format={kv_format!r}, got {d_qk}")
    return rows

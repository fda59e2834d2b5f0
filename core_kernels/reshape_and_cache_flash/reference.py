"""float64 numpy reference for reshape_and_cache_flash."""
from __future__ import annotations

import numpy as np

FP8_FORMATS = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
FP8_LIMITS = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantize_fp8_reference(x, scale, fmt: str) -> np.ndarray:
    """fp8(clamp(x / scale)) as ``fmt`` (an ml_dtypes array): the quotient in
    float64, rounded to float32 (the kernel divides in fp32; a float64 quotient
    rounds to the correctly rounded float32 one, since 53 >= 2 * 24 + 2),
    clamped to the format's largest finite value (saturating; NaN stays NaN) and
    rounded to the nearest fp8 value, ties to even."""
    import ml_dtypes
    q = (np.asarray(x, np.float64) / np.float64(np.float32(scale))).astype(np.float32)
    lim = np.float32(FP8_LIMITS[fmt])
    q = np.where(np.isnan(q), q, np.clip(q, -lim, lim))
    return q.astype(getattr(ml_dtypes, fmt))


def reshape_and_cache_flash_reference(key, value, key_cache, value_cache, slot_mapping,
                                      kv_cache_dtype: str = "auto", k_scale=1.0, v_scale=1.0):
    """The caches after the call, as new arrays of the caches' dtype: for each
    token t with 0 <= s = slot_mapping[t] < num_blocks * block_size, row
    [s // block_size, s % block_size] of each cache is key[t] / value[t] (as is with
    "auto"; fp8 as :func:`quantize_fp8_reference`, stored as the caches' dtype:
    the fp8 format, or uint8 holding its bits); everything else keeps its bits.
    A slot named twice keeps the last token's row (the kernel's order is undefined
    there: validate_indices refuses it)."""
    key_cache, value_cache = np.array(key_cache, copy=True), np.array(value_cache, copy=True)
    num_blocks, block_size = key_cache.shape[:2]
    fmt = FP8_FORMATS.get(kv_cache_dtype)
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        if fmt is None:
            rows = np.asarray(src).astype(np.float64).astype(cache.dtype)   # exact: the same dtype
        else:
            rows = quantize_fp8_reference(src, scale, fmt)
            if cache.dtype == np.uint8:
                rows = rows.view(np.uint8)
        for t, s in enumerate(np.asarray(slot_mapping, np.int64)):
            if 0 <= s < num_blocks * block_size:
                cache[s // block_size, s % block_size] = rows[t]
    return key_cache, value_cache

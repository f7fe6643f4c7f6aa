"""§5.3's mixed-precision rule: warn when the KV cache stores K/V in a dtype of narrower range or
lower precision than the model is known to need.

The case the seed warns about is a bfloat16 model (trained or computing in bfloat16) over a
float16 cache: bfloat16 has float32's exponent range (to ~3.4e38), float16 stops at 65504, so an
activation outlier that bfloat16 carries overflows to inf in the cache and poisons attention.
The other direction (a bfloat16 cache under a float16 or float32 model) keeps the range but
drops mantissa bits (8 vs 11 vs 24): attention reads K/V less precisely than it computes them.
Not warned about: a float16 cache under a float32 checkpoint (kvserve's CPU default, as
llama.cpp's), and 8-bit caches (fp8, int8: an explicit, scaled choice).
"""

from __future__ import annotations

# (exponent range rank, mantissa bits) of the float dtypes a cache may hold
_FLOATS = {"float32": (2, 24), "bfloat16": (2, 8), "float16": (1, 11)}


def _name(dtype: object) -> str | None:
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def kv_precision_warning(kv_cache_dtype: str, compute_dtype: object,
                         trained_dtype: object = None) -> str | None:
    """The warning to log at start (None when the cache loses nothing that matters).

    ``compute_dtype`` is the dtype the engine runs the model in, ``trained_dtype`` the
    checkpoint's own (``torch_dtype`` of its config; None when unknown). Pure."""
    kv = _FLOATS.get(kv_cache_dtype)
    if kv is None:
        return None
    trained, compute = _name(trained_dtype), _name(compute_dtype)
    # Range: the seed's case, a bfloat16 model (trained or computing in bfloat16: its
    # activations use bfloat16's range). A float32 checkpoint over a float16 cache is the
    # usual CPU default (llama.cpp's too) and is not warned about.
    ref_name = next((d for d in (trained, compute) if d == "bfloat16"), None)
    if ref_name is not None and kv[0] < _FLOATS[ref_name][0]:
        role = "was trained" if trained == "bfloat16" else "computes"
        return (f"the KV cache is {kv_cache_dtype} but the model {role} in {ref_name}: "
                f"{kv_cache_dtype} has a narrower range (max 65504), so K/V values that "
                f"{ref_name} carries may overflow to inf in the cache (the seed's §5.3 rule); "
                f"if outputs look wrong, use --kv-cache-dtype bfloat16 or float32")
    if compute in _FLOATS and kv[1] < _FLOATS[compute][1] and kv_cache_dtype == "bfloat16":
        return (f"the KV cache is bfloat16 but the model computes in {compute}: bfloat16 keeps "
                f"8 mantissa bits of {_FLOATS[compute][1]}, so attention reads K/V less "
                f"precisely than it computes them (the seed's §5.3 rule); use "
                f"--kv-cache-dtype {compute} for exact parity")
    return None

"""How K and V are stored in the device pools: row formats (float, fp8, int8 with scales),
re-rotating stored keys, fp8 scale calibration, and the precision warning. Used by the runner,
the attention backends and the kernels; the scheduler's bookkeeping lives in ``engine.kv_cache``."""

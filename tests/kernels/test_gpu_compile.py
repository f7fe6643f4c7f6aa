"""The kernels compile for an NVIDIA GPU (sm_90) even on a machine without one.

The CPU tests run Triton's interpreter, which accepts code the GPU compiler rejects (and the
reverse). Here each wrapper's launches are recorded and compiled ahead of time with the
``ptxas`` bundled in the Triton wheel, in a subprocess free of ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _compile_all() -> None:  # runs in the subprocess
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(ROOT))
    import kernels  # noqa: F401  (binds the submodules below)

    mods = {m: sys.modules[f"kernels.{m}"] for m in
            ("paged_attention", "paged_decode", "store_kv", "copy_blocks")}
    kernel_names = {"paged_attention": ["_paged_attention_kernel"], "store_kv": ["_store_kv_kernel"],
                    "paged_decode": ["_decode_kernel", "_merge_kernel"],
                    "copy_blocks": ["_copy_blocks_kernel"]}
    launches = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    for mod, names in kernel_names.items():
        for name in names:
            setattr(mods[mod], name, Recorder(getattr(mods[mod], name)))
    torch.Tensor.is_cuda = property(lambda self: True)  # take the wrappers' GPU choices

    def case(dtype, kv_heads, group, dim, block_size):
        pool = torch.zeros(8, block_size, kv_heads, dim, dtype=dtype)
        query = torch.zeros(5, kv_heads * group, dim, dtype=dtype)
        tables = torch.zeros(2, 4, dtype=torch.int32)
        return query, pool, pool.clone(), tables, torch.tensor([40, 3], dtype=torch.int32)

    pa, pd = mods["paged_attention"], mods["paged_decode"]
    q, kc, vc, bt, sl = case(torch.bfloat16, 8, 4, 128, 16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    pa.paged_attention(q, kc, vc, bt, cu, sl, 0.1, max_query_len=3)
    pd.paged_decode_attention(q[:2], kc, vc, bt, sl, 0.1, num_splits=4)
    pd.paged_decode_attention(q[:2], kc, vc, bt, sl, 0.1, num_splits=1, sliding_window=16)
    mods["store_kv"].store_kv(q[:, :8], q[:, :8], kc, vc, torch.zeros(5, dtype=torch.int64))
    mods["copy_blocks"].copy_blocks_triton([kc, vc], [vc, kc], torch.zeros(1, 2, dtype=torch.int64))
    q, kc, vc, bt, sl = case(torch.float32, 2, 3, 80, 8)  # IEEE fp32 dots, masked head_dim
    pa.paged_attention(q, kc, vc, bt, cu, sl, 0.1, sliding_window=7, max_query_len=3)

    types = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
             torch.int64: "*i64", torch.int16: "*i16"}
    for fn, args, kwargs in launches:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        signature, attrs = {}, {}
        for i, (name, arg) in enumerate(zip(fn.arg_names, args)):
            if isinstance(arg, torch.Tensor):
                signature[name] = types[arg.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]  # as the launcher specialises them
            else:
                signature[name] = "fp32" if isinstance(arg, float) else "i32"
        signature.update({name: "constexpr" for name in kwargs})
        triton.compile(ASTSource(fn, signature, kwargs, attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
        print("compiled", fn.fn.__name__, flush=True)


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == 7, proc.stdout


if __name__ == "__main__":
    _compile_all()

"""The kernels compile for an NVIDIA GPU (sm_90) even on a machine without one, in the very
variants the launcher builds, and serving-time changes do not make new ones.

The CPU tests run Triton's interpreter, which accepts code the GPU compiler rejects (and the
reverse). Here, in a subprocess free of ``TRITON_INTERPRET``, Triton's driver is replaced by one
that reports an sm_90 target, and every launch the wrappers make goes through the real launch
path (``JITFunction.run(..., warmup=True)``): the launcher's own specialisation of each
argument (integers equal to 1 or divisible by 16, 16-byte pointer alignment, minus the
``do_not_specialize`` lists), its cache key, and a compile with the ``ptxas`` bundled in the
Triton wheel; only the launch itself is skipped.

Within one model shape, the wrappers are called again with what changes from step to step
(split counts, windows, block-table widths, row slices of the index tensors at odd offsets):
each kernel must end with exactly one compiled variant per distinct set of compile-time
choices (constexprs, warps, stages, dtypes), i.e. nothing would be recompiled while serving.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_VARIANTS = 18


def _compile_all() -> None:  # runs in the subprocess
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Sm90Driver:  # what JITFunction.run asks of the driver, short of a launch
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(Sm90Driver())
    sys.path.insert(0, str(ROOT))
    import kvserve_kernels  # noqa: F401  (binds the submodules below)

    mods = {m: sys.modules[f"kvserve_kernels.{m}"] for m in
            ("paged_attention", "paged_decode", "store_kv", "copy_blocks")}
    kernel_names = {"paged_attention": ["_paged_attention_kernel"], "store_kv": ["_store_kv_kernel"],
                    "paged_decode": ["_decode_kernel", "_merge_kernel"],
                    "copy_blocks": ["_copy_blocks_kernel"]}
    jit_fns = []
    expected: dict[str, set] = {}  # kernel -> distinct compile-time choices seen
    model = ["?"]  # the model shape whose launches are being made

    class CompileInsteadOfLaunch:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
                expected.setdefault(self.fn.fn.__name__, set()).add(
                    (model[0], dtypes, tuple(sorted(kwargs.items()))))
                self.fn.run(*args, grid=grid, warmup=True, **kwargs)
            return launch

    for mod, names in kernel_names.items():
        for name in names:
            fn = getattr(mods[mod], name)
            jit_fns.append(fn)
            setattr(mods[mod], name, CompileInsteadOfLaunch(fn))
    torch.Tensor.is_cuda = property(lambda self: True)  # take the wrappers' GPU choices

    def case(dtype, kv_heads, group, dim, block_size, width=4):
        pool = torch.zeros(8, block_size, kv_heads, dim, dtype=dtype)
        query = torch.zeros(5, kv_heads * group, dim, dtype=dtype)
        tables = torch.zeros(3, width, dtype=torch.int32)[:2]
        return query, pool, pool.clone(), tables, torch.tensor([40, 3, 9], dtype=torch.int32)[:2]

    pa, pd, sk = mods["paged_attention"], mods["paged_decode"], mods["store_kv"].store_kv
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)

    model[0] = "bf16 D=128 G=4"
    q, kc, vc, bt, sl = case(torch.bfloat16, 8, 4, 128, 16)
    pa.paged_attention(q, kc, vc, bt, cu, sl, 0.1, max_query_len=3)
    pd.paged_decode_attention(q[:2], kc, vc, bt, sl, 0.1, num_splits=4)
    pd.paged_decode_attention(q[:2], kc, vc, bt, sl, 0.1, num_splits=1, sliding_window=16)
    sk(q[:, :8], q[:, :8], kc, vc, torch.zeros(5, dtype=torch.int64))
    mods["copy_blocks"].copy_blocks_triton([kc, vc], [vc, kc], torch.zeros(1, 2, dtype=torch.int64))
    # Serving-time changes, same model: none may compile anything new.
    out = torch.zeros_like(q)
    for width in (1, 3, 16, 17):  # block-table row stride: == 1, odd, % 16, not
        _, _, _, bt_w, _ = case(torch.bfloat16, 8, 4, 128, 16, width)
        for splits in (3, 4):  # the merge's BLOCK_S is 4 for both
            pd.paged_decode_attention(q[:2], kc, vc, bt_w, sl, 0.1, num_splits=splits)
        for window in (1, 16, 4095):
            pd.paged_decode_attention(q[:2], kc, vc, bt_w, sl, 0.1, num_splits=1,
                                      sliding_window=window)
        # The prefill part of a mixed step: row slices at any offset, as the backend passes.
        pa.paged_attention(q[1:], kc, vc, bt_w[1:], cu[1:] - 2, sl[1:], 0.1,
                           max_query_len=3, out=out[1:])
        pa.paged_attention(q[2:], kc, vc, bt_w[1:], cu[1:], sl[1:], 0.1,
                           max_query_len=3, out=out[2:])
        pd.paged_decode_attention(q[:1], kc, vc, bt_w[1:], sl[1:], 0.1, num_splits=1)
        sk(q[1:, :8], q[1:, :8], kc, vc, torch.zeros(5, dtype=torch.int64)[1:])

    model[0] = "fp32 D=80 G=3"  # IEEE fp32 dots, masked head_dim
    q, kc, vc, bt, sl = case(torch.float32, 2, 3, 80, 8)
    pa.paged_attention(q, kc, vc, bt, cu, sl, 0.1, sliding_window=7, max_query_len=3)
    pa.paged_attention(q, kc, vc, bt, cu, sl, 0.1, sliding_window=1, max_query_len=3)

    model[0] = "bf16 D=64 G=4"  # Llama-3.2-1B's attention shape
    q, kc, vc, bt, sl = case(torch.bfloat16, 8, 4, 64, 16)
    pa.paged_attention(q, kc, vc, bt, cu, sl, 0.1, max_query_len=3)
    pd.paged_decode_attention(q[:2], kc, vc, bt, sl, 0.1, num_splits=3)
    sk(q[:, :8], q[:, :8], kc, vc, torch.zeros(5, dtype=torch.int64))

    model[0] = "bf16 D=256 G=2 softcap"  # Gemma 2 2B's heads, soft-capped scores, a window
    q, kc, vc, bt, sl = case(torch.bfloat16, 4, 2, 256, 16)
    pa.paged_attention(q, kc, vc, bt, cu, sl, 0.0625, sliding_window=4096, max_query_len=3,
                       softcap=50.0)
    pd.paged_decode_attention(q[:2], kc, vc, bt, sl, 0.0625, num_splits=1,
                              sliding_window=4096, softcap=50.0)

    model[0] = "int4 fp16 D=96 G=4"  # uint8 rows: 3 groups of nibbles + scales, masked tail
    q, _, _, bt, sl = case(torch.float16, 8, 4, 96, 16)
    kc = torch.zeros(8, 16, 8, 96 // 2 + 2 * 3, dtype=torch.uint8)
    vc = kc.clone()
    pa.paged_attention(q, kc, vc, bt, cu, sl, 0.1, max_query_len=3)
    pd.paged_decode_attention(q[:2], kc, vc, bt, sl, 0.1, num_splits=4)
    sk(q[:, :8].float(), q[:, :8].float(), kc, vc, torch.zeros(5, dtype=torch.int64))

    total = 0
    for fn in jit_fns:
        name = fn.fn.__name__
        compiled = list(fn.device_caches[0][0].values())
        for kernel in compiled:
            signature, attrs = kernel.src.signature, kernel.src.attrs
            for p in fn.params:  # runtime-varying integers: plain i32, no value hints
                if p.do_not_specialize:
                    assert signature[p.name] == "i32" and not attrs.get((p.num,)), \
                        (name, p.name, signature[p.name], attrs.get((p.num,)))
            assert kernel.asm.get("cubin"), f"{name}: no sm_90 binary"
            print("compiled", name, {k: v for k, v in signature.items() if v != "constexpr"},
                  flush=True)
        assert len(compiled) == len(expected[name]), (
            f"{name}: {len(compiled)} variants compiled for {len(expected[name])} distinct "
            f"compile-time choices: a runtime value was specialised on")
        total += len(compiled)
    print(f"variants {total}", flush=True)


@pytest.mark.slow
def test_kernels_compile_for_sm90_as_launched():
    triton = pytest.importorskip("triton")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith("KVSERVE_")}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"variants {EXPECTED_VARIANTS}" in proc.stdout, proc.stdout


if __name__ == "__main__":
    _compile_all()

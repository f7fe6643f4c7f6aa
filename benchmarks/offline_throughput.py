"""Offline throughput: kvserve's LLM.generate next to HF transformers, same prompts, one run.

    python benchmarks/offline_throughput.py                  # embedded model, CPU
    python benchmarks/offline_throughput.py --dtype bfloat16 --json out.json

64 prompts of 300 tokens, 128 output tokens each (greedy, ignore_eos), through
``LLM.generate`` and through HF transformers' static-batch ``generate`` (all 64 in one batch, same
weights and dtype). Prints output tokens/s of both, the ratio, and kvserve's efficiency: useful
FLOPs of the run (the yardstick of docs/design.md) / wall time / the matmul peak measured in this
process at the engine's dtype. Any `kvserve bench offline` flag may be added to override these sizes
(e.g. `--num-prompts 8 --output-len 16` for a quick check, `--baselines hf,recompute`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.cli import main  # noqa: E402

DEFAULTS = ["bench", "offline", "--num-prompts", "64", "--input-len", "300", "--output-len",
            "128", "--baselines", "hf", "--seed", "0"]

if __name__ == "__main__":
    # Later flags win in argparse, so the user's flags override the defaults.
    sys.exit(main(DEFAULTS + sys.argv[1:]))

"""Read only this rank's shard of each checkpoint tensor.

safetensors files (HF checkpoints, and the GGUF files kvserve converts once into its cache) are
sliced on read (``safe_open(...).get_slice``): a rank never holds a whole projection, token
table or logits head. A ``.bin`` checkpoint is memory-mapped and sliced after the map.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.loading import gguf_convert
from engine.loading.loader import ModelFiles, weight_files
from engine.models.tp_sharding import RankShard


def shard_tensor(name: str, tensor, shard: RankShard) -> torch.Tensor:
    """``tensor`` (a torch tensor, or a safetensors slice with ``get_shape`` and ``[]``)
    narrowed to ``shard``'s part of ``name``."""
    how = shard.weight_slice(name)
    if how is None:
        return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
    if how == "zero":
        shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
        dtype = tensor.dtype if isinstance(tensor, torch.Tensor) else torch.float32
        return torch.zeros(tuple(shape), dtype=dtype)
    dim, start, stop, *halves = how
    if halves:  # the range in each half of dim (a stacked expert gate/up), concatenated
        shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
        half = shape[dim] // 2
        return torch.cat([_narrow(tensor, dim, start, stop),
                          _narrow(tensor, dim, half + start, half + stop)], dim)
    return _narrow(tensor, dim, start, stop)


def _narrow(tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """``tensor``'s ``[start, stop)`` along ``dim`` (0, 1 or 2), as a contiguous tensor."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, stop - start).contiguous()
    index = (slice(None),) * dim + (slice(start, stop),)
    return tensor[index]


def iter_shard_weights(files: ModelFiles, shard: RankShard) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, this rank's part of the tensor)`` for every stored tensor, one at a time."""
    for file in weight_files(files.path):
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, shard_tensor(name, handle.get_slice(name), shard)
        else:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            for name, tensor in state.items():
                yield name, shard_tensor(name, tensor, shard)
            del state
    # A big GGUF's packed tensors left in the file by its conversion: dequantised one at a
    # time, then sliced (packed blocks are not split across ranks; see docs/tensor-parallel.md).
    for name, tensor in gguf_convert.iter_gguf_tensors(files.path,
                                                       gguf_convert.in_gguf_names(files.path)):
        yield name, shard_tensor(name, tensor, shard)

"""Logit processors that run before temperature: logit bias, min-tokens masking and penalties.

Each function edits a ``[N, V]`` float logits tensor in place, touching only the cells the
processor changes, so a batch where nobody uses it pays one Python check per row and no tensor
work, and the penalties cost O(tokens) rather than O(V) per row. In ``Sampler``'s order
(vLLM's): (1) ``logit_bias``: ``logit[t] += bias[t]``; (2) ``min_tokens``: while
``len(output) < min_tokens`` the EOS ids and ``stop_token_ids`` get ``-inf``, whatever
``ignore_eos`` says; (3) ``repetition_penalty`` p (HF/CTRL): for every token seen in prompt or
output, a positive logit is divided by p and a negative one multiplied by p; (4)
``frequency_penalty`` / ``presence_penalty`` (OpenAI), over output tokens only: ``logit[t] -=
count[t] * frequency_penalty + (count[t] > 0) * presence_penalty``.

A row's logit-bias tensors are built once per request (``SamplingRow.cache``). Token ids outside
``[0, V)`` are ignored here: checking them is the server's job, and one bad request must not
fail the step for everybody else."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.row import SamplingRow


def needs_processing(row: SamplingRow) -> bool:
    """Whether any processor of this module would change the row's logits this step."""
    p = row.params
    return bool(
        p.logit_bias
        or len(row.output_token_ids) < p.min_tokens
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


def _flat_index(pairs: Sequence[tuple[int, Sequence[int]]], vocab: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and token index tensors of ``(row, token ids)`` pairs, out-of-range ids dropped."""
    rows: list[int] = []
    toks: list[int] = []
    for r, ids in pairs:
        kept = [t for t in ids if 0 <= t < vocab]
        rows.extend([r] * len(kept))
        toks.extend(kept)
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(toks, dtype=torch.long, device=device))


def _bias_tensors(row: SamplingRow, vocab: int, logits: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's ``(token ids, biases)`` on the logits' device, from its cache when built."""
    key = ("logit_bias", logits.device, logits.dtype, vocab)
    cache = row.cache
    if cache is not None and cache.get("logit_bias_key") == key:
        return cache["logit_bias"]
    items = [(t, b) for t, b in row.params.logit_bias.items() if 0 <= t < vocab]
    built = (torch.tensor([t for t, _ in items], dtype=torch.long, device=logits.device),
             torch.tensor([b for _, b in items], dtype=logits.dtype, device=logits.device))
    if cache is not None:
        cache["logit_bias_key"], cache["logit_bias"] = key, built
    return built


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            toks, vals = _bias_tensors(row, vocab, logits)
            if toks.numel():
                logits[i].index_add_(0, toks, vals)  # token ids are distinct (dict keys)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    pairs = [
        (i, list(row.eos_token_ids) + list(row.params.stop_token_ids))
        for i, row in enumerate(rows)
        if len(row.output_token_ids) < row.params.min_tokens
    ]
    if not pairs:
        return
    r, t = _flat_index(pairs, logits.shape[1], logits.device)
    logits[r, t] = float("-inf")


def _per_row(rows: Sequence[SamplingRow], sel: list[int], attr: str,
             logits: torch.Tensor) -> torch.Tensor:
    """A ``[len(rows)]`` tensor of the parameter ``attr`` (0 for rows outside ``sel``)."""
    vals = [0.0] * len(rows)
    for i in sel:
        vals[i] = getattr(rows[i].params, attr)
    return torch.tensor(vals, dtype=logits.dtype, device=logits.device)


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    sel = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not sel:
        return
    vocab = logits.shape[1]
    r, t = _flat_index(
        [(i, [*rows[i].prompt_token_ids, *rows[i].output_token_ids]) for i in sel],
        vocab, logits.device,
    )
    # Only the seen (row, token) cells are touched: O(tokens), not O(V) per row. unique()
    # makes sure a token seen twice is penalised once.
    keys = torch.unique(r * vocab + t)
    pen = _per_row(rows, sel, "repetition_penalty", logits)[keys // vocab]
    flat = logits.view(-1)
    vals = flat[keys]
    flat[keys] = torch.where(vals > 0, vals / pen, vals * pen)


def apply_frequency_presence(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    sel = [
        i for i, row in enumerate(rows)
        if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0
    ]
    if not sel:
        return
    vocab = logits.shape[1]
    r, t = _flat_index([(i, rows[i].output_token_ids) for i in sel], vocab, logits.device)
    if r.numel() == 0:
        return
    keys, counts = torch.unique(r * vocab + t, return_counts=True)
    row = keys // vocab
    freq = _per_row(rows, sel, "frequency_penalty", logits)[row]
    pres = _per_row(rows, sel, "presence_penalty", logits)[row]
    flat = logits.view(-1)
    # Every listed cell has count > 0, so the presence term applies to each exactly once.
    flat[keys] -= counts.to(logits.dtype) * freq + pres


def apply_all(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Run the four processors in order, in place (``logits`` must be contiguous)."""
    apply_logit_bias(logits, rows)
    apply_min_tokens(logits, rows)
    apply_repetition_penalty(logits, rows)
    apply_frequency_presence(logits, rows)

"""Expert-parallel generation with a KV cache: data-parallel attention, expert-parallel MoE.

Every worker runs the whole model on its own prompts (attention and the KV cache are its own), and
every MoE block exchanges tokens with the others by all-to-all. Each forward of the model calls
every MoE block once, in order, so the workers must run the same number of forwards: before each
forward they agree (one all-reduce) whether anyone still has a sequence to extend, and a worker with
nothing left joins every block with zero tokens. Sequences that finish leave the batch and its
cache rows, so a worker only computes live tokens.

Sampling follows transformers' ``generate``: left padding, positions counted from the first real
token, greedy at temperature 0, otherwise temperature then nucleus (top-p) filtering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moeflow.comm.groups import max_over_ranks
from moeflow.hf.blocks import moe_blocks


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


def next_tokens(logits_BV: torch.Tensor, settings: SamplingSettings, generator: torch.Generator) -> torch.Tensor:
    """Greedy, or a sample from the temperature-scaled distribution cut to its top-p nucleus."""
    if settings.temperature == 0:
        return logits_BV.argmax(dim=-1)
    scores = logits_BV.float() / settings.temperature
    if settings.top_p < 1:
        sorted_scores, order = scores.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - settings.top_p
        drop[:, -1] = False  # always keep the likeliest token
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)


@dataclass
class _Batch:
    """The live sequences of one worker: their tokens so far, cache, mask and next positions."""

    indices: list[int]  # positions in this worker's prompt list
    outputs: list[list[int]]  # new tokens of every sequence of the batch (finished ones included)
    live: list[int] = field(default_factory=list)  # rows of the batch still generating
    inputs: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    cache: object | None = None


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # every prompt has a token (checked by generate)
        ids[row, length - len(prompt):] = torch.as_tensor(prompt)
        mask[row, length - len(prompt):] = 1
    return ids, mask


def _start(prompts: Sequence[Sequence[int]], indices: list[int], pad_id: int) -> _Batch:
    ids, mask = _left_padded([prompts[i] for i in indices], pad_id)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return _Batch(indices, [[] for _ in indices], list(range(len(indices))), ids, mask, positions)


class ExpertParallelGenerator:
    """Generates on one worker, in step with the others of ``group`` (None: one process)."""

    def __init__(
        self, model: nn.Module, settings: SamplingSettings, eos_ids: Sequence[int], pad_id: int,
        group: dist.ProcessGroup | None = None, progress: Callable[[str], None] | None = None,
        after_round: Callable[[int], None] | None = None,
    ) -> None:
        self.model, self.settings, self.eos_ids, self.pad_id = model, settings, set(eos_ids), pad_id
        self.group, self.progress, self.after_round = group, progress, after_round
        self.blocks = moe_blocks(model)
        self.generator = torch.Generator().manual_seed(settings.seed + (dist.get_rank(group) if group else 0))
        self.forwards = 0

    def _max_over_workers(self, value: int) -> int:
        """The largest ``value`` of all workers (every worker must call this at the same point)."""
        return value if self.group is None else int(max_over_ranks([value], self.group)[0])

    @torch.no_grad()
    def _join_empty(self) -> None:
        """One model forward's worth of MoE calls with zero tokens: keeps the all-to-alls in step (with no
        grad, as the other workers' steps run, so that every worker takes the same path)."""
        for block in self.blocks:
            config = block.moe.config
            block.moe(torch.empty((0, config.model_dim), dtype=block.moe.experts.w1.dtype))

    @torch.no_grad()
    def _step(self, batch: _Batch) -> None:
        out = self.model(
            input_ids=batch.inputs, attention_mask=batch.mask, position_ids=batch.positions,
            past_key_values=batch.cache, use_cache=True,
        )
        batch.cache = out.past_key_values
        chosen = next_tokens(out.logits[:, -1, :], self.settings, self.generator).tolist()
        still = []
        for slot, (row, token) in enumerate(zip(batch.live, chosen, strict=True)):
            batch.outputs[row].append(token)
            if token not in self.eos_ids and len(batch.outputs[row]) < self.settings.max_new_tokens:
                still.append(slot)
        keep = torch.tensor(still, dtype=torch.long)
        if len(still) < len(batch.live) and still:
            batch.cache.batch_select_indices(keep)
        batch.live = [batch.live[s] for s in still]
        batch.mask = torch.cat([batch.mask, torch.ones((len(chosen), 1), dtype=torch.long)], dim=1)[keep]
        batch.positions = batch.positions[keep, -1:] + 1
        batch.inputs = torch.tensor([[chosen[s]] for s in still], dtype=torch.long).reshape(len(still), 1)

    def run_round(self, batch: _Batch | None) -> None:
        """One batch (None: this worker has none this round) until every worker's batch is done."""
        while self._max_over_workers(int(batch is not None and bool(batch.live))):
            if batch is not None and batch.live:
                self._step(batch)
            else:
                self._join_empty()
            self.forwards += 1

    def generate(self, prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
        """New tokens for each of this worker's ``prompts`` (EOS included when produced)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        outputs: list[list[int]] = [[] for _ in prompts]
        batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
        rounds = self._max_over_workers(len(batches))
        for index in range(rounds):
            batch = _start(prompts, batches[index], self.pad_id) if index < len(batches) else None
            self.run_round(batch)
            if batch is not None:
                for row, position in enumerate(batch.indices):
                    outputs[position] = batch.outputs[row]
            if self.after_round is not None:
                self.after_round(index)
            if self.progress is not None:
                self.progress(f"round {index + 1}/{rounds} done after {self.forwards} forwards")
        return outputs

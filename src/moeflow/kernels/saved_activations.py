"""The experts' saved intermediates go to autograd through ``save_for_backward``.

An expert forward keeps, per pipeline chunk or schedule step, a record of what its backward reads
(:class:`moeflow.core.experts.FFNSaved`, :class:`moeflow.kernels.ragged.RaggedSaved`). Handing those tensors to
``save_for_backward`` rather than keeping them on ``ctx`` is what lets saved-tensor hooks see them:
``torch.autograd.graph.save_on_cpu`` and other activation offloading in a user's training loop, and
``moeflow bench memory``'s count of the activations. A record's other fields (row maps, shapes) stay
on ``ctx``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import torch
from torch.autograd.function import FunctionCtx


def save_with_records(ctx: FunctionCtx, inputs: Sequence[torch.Tensor | None], records: Sequence[Any]) -> None:
    """``save_for_backward`` of ``inputs`` and of every tensor field of ``records`` (dataclass
    instances, or None for a chunk without one); :func:`saved_with_records` gives them back."""
    tensors: list[torch.Tensor] = []
    layout: list[tuple[Any, tuple[str, ...]]] = []
    for record in records:
        if record is None:
            layout.append((None, ()))
            continue
        names = tuple(f.name for f in fields(record) if isinstance(getattr(record, f.name), torch.Tensor))
        tensors.extend(getattr(record, name) for name in names)
        layout.append((replace(record, **dict.fromkeys(names)), names))  # the record without its tensors
    ctx.save_for_backward(*inputs, *tensors)
    ctx.record_layout = layout, len(inputs)  # type: ignore[attr-defined]


def saved_with_records(ctx: FunctionCtx) -> tuple[tuple[torch.Tensor | None, ...], list[Any]]:
    """The inputs and the records that :func:`save_with_records` saved, as they were."""
    layout, count = ctx.record_layout  # type: ignore[attr-defined]
    saved = ctx.saved_tensors  # type: ignore[attr-defined]
    rest = iter(saved[count:])
    records = [None if template is None else replace(template, **{name: next(rest) for name in names})
               for template, names in layout]
    return tuple(saved[:count]), records

"""Mixed precision: the dtype a layer computes in, and its expert weights in that dtype.

bf16 or fp16 activations and expert GEMMs over fp32 parameters (the master weights the optimizer
updates, as in every mixed-precision trainer): the layer computes in autocast's dtype when autocast
is on for x's device (the trainer's ``--dtype``), otherwise in x's dtype. The router, its softmax
and the balance losses stay fp32 whatever it is (routing is discrete: low-precision logits flip
choices). The weights are cast in the graph, once per forward, so their gradients reach the fp32
parameters in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.config import DTYPE_NAMES
from moeflow.experts import ExpertFFN, FFNCompute, FFNWeights

LOW_PRECISION = (torch.bfloat16, torch.float16)
DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def compute_dtype(x: torch.Tensor, param_dtype: torch.dtype) -> torch.dtype:
    """autocast's dtype if it is on for x's device, else x's; a low-precision dtype over fp32
    parameters, or the parameters' own dtype."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if dtype == param_dtype or (param_dtype == torch.float32 and dtype in LOW_PRECISION):
        return dtype
    raise ValueError(
        f"x has dtype {dtype} but the layer's parameters are {param_dtype}; cast one to the other "
        f"(layer.to({dtype}) or x.to({param_dtype})); bf16/fp16 inputs may run over fp32 parameters"
    )


@dataclass(frozen=True)
class CastExperts:
    """An :class:`~moeflow.experts.ExpertSlots` whose weights are the experts' cast to ``dtype``."""

    experts: ExpertFFN
    dtype: torch.dtype

    @property
    def compute(self) -> FFNCompute:
        return self.experts.compute

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def weights(self) -> FFNWeights:
        return self.experts.weights().cast(self.dtype)


def experts_in(experts: ExpertFFN, dtype: torch.dtype) -> ExpertFFN | CastExperts:
    """The experts as a schedule should run them in ``dtype``: themselves, or a casting view."""
    return experts if experts.w1.dtype == dtype else CastExperts(experts, dtype)

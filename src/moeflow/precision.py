"""Mixed precision: the dtype a layer computes in (its schedules cast the expert weights to it in
the graph, :meth:`moeflow.parallel.context.RunContext.weights`).

bf16 or fp16 activations and expert GEMMs over fp32 parameters (the master weights the optimizer
updates, as in every mixed-precision trainer): the layer computes in autocast's dtype when autocast
is on for x's device (the trainer's ``--dtype``), otherwise in x's dtype. The router, its softmax
and the balance losses stay fp32 whatever it is (routing is discrete: low-precision logits flip
choices). The weights are cast in the graph, once per forward, so their gradients reach the fp32
parameters in fp32.
"""

from __future__ import annotations

import torch

from moeflow.config import DTYPE_NAMES

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

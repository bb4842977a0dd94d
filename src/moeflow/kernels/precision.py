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


def checked_tokens(x: torch.Tensor, model_dim: int, check_finite: bool) -> torch.Tensor:
    """A layer's input, checked (its last dimension, a floating dtype, finite values when asked),
    flattened to (T, M)."""
    if x.dim() < 1 or x.shape[-1] != model_dim:
        raise ValueError(f"x has shape {tuple(x.shape)}; its last dimension must be model_dim={model_dim}")
    if not x.is_floating_point():
        raise ValueError(f"x has dtype {x.dtype}; MoELayer needs a floating-point input")
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or inf values (check_finite=True)")
    return x.reshape(-1, model_dim)

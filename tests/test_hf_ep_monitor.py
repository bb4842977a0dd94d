"""The MoE monitor over a transformers model loaded with moeflow's expert-parallel backend
(``ep_implementation="moeflow"``) on 2 gloo processes: its counts per expert and router entropy
are every rank's tokens, as the model's own routers chose them (also where the ranks share one
batch under tensor parallelism: counted once), and its bias is the family's selection bias."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_models import saved_tiny_models
from pool import run_distributed

TOKENS = (2, 24)


def _router_record(block: torch.nn.Module, seen: dict[str, list[torch.Tensor]]) -> Any:
    """A hook that keeps the router's logits and chosen experts (transformers v5's routers return
    ``(logits, scores or weights, indices)``)."""

    def hook(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
        seen["logits"].append(output[0].detach().reshape(-1, output[0].shape[-1]))
        seen["indices"].append(output[2].detach().reshape(-1))

    return block.gate.register_forward_hook(hook)


def _monitored_step(rank: int, world: int, path: str, tensor_parallel: bool) -> dict[str, Any]:
    """A forward and backward under the backend, watched by the monitor and by the routers' hooks."""
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    import moeflow.hf
    from moeflow.metrics import MoEMonitor
    from moeflow.metrics.health import router_entropy_sum

    moeflow.hf.configure()
    sizes = {"tp_size": world} if tensor_parallel else {"fsdp_size": world}
    layout = DistributedConfig(**sizes, ep_size=world, ep_implementation="moeflow")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=layout)
    blocks = [module for module in model.modules() if hasattr(module, "gate") and hasattr(module, "experts")]
    seen = [{"logits": [], "indices": []} for _ in blocks]
    hooks = [_router_record(block, record) for block, record in zip(blocks, seen, strict=True)]
    monitor = MoEMonitor(model)
    ids = torch.randint(0, model.config.vocab_size, TOKENS, generator=torch.Generator().manual_seed(
        7 if tensor_parallel else 7 + rank))
    model(ids, labels=ids).loss.backward()
    health = monitor.step()
    for hook in hooks:
        hook.remove()
    experts = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.n_routed_experts
    expected = []
    for record in seen:
        counts = torch.bincount(torch.cat(record["indices"]), minlength=experts).double()
        logits = torch.cat(record["logits"])
        score_function = "sigmoid" if hasattr(model.config, "n_group") else "softmax"  # DeepSeek-V3's router
        entropy = torch.tensor([float(router_entropy_sum(logits, score_function)), float(len(logits))],
                               dtype=torch.float64)
        if not tensor_parallel:  # each rank its own batch: the world's tokens are the sum
            dist.all_reduce(counts)
            dist.all_reduce(entropy)
        expected.append({"counts": counts.round().long().tolist(), "entropy": float(entropy[0] / entropy[1])})
    biases = [getattr(block.gate, "e_score_correction_bias", None) for block in blocks]
    return {"layers": [layer.__dict__ for layer in health.layers], "expected": expected,
            "bias": [None if b is None else (float(b.min()), float(b.max())) for b in biases],
            "alltoall_share": health.alltoall_share}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return saved_tiny_models(tmp_path_factory, ("qwen3_moe", "deepseek_v3"), seed=3)


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "tensor_parallel"), [("qwen3_moe", False), ("qwen3_moe", True),
                                                         ("deepseek_v3", False)])
def test_the_monitor_counts_every_ranks_tokens_under_the_backend(
    saved: dict[str, Path], family: str, tensor_parallel: bool
) -> None:
    results = run_distributed(_monitored_step, 2, str(saved[family]), tensor_parallel, timeout_s=300)
    for result in results:
        layers, expected = result["layers"], result["expected"]
        assert len(layers) == len(expected) >= 1
        assert [layer["block"] for layer in layers] == list(range(len(layers)))
        for layer, want, bias in zip(layers, expected, result["bias"], strict=True):
            assert layer["tokens_per_expert"] == want["counts"]
            assert sum(want["counts"]) > 0
            assert layer["dropped"] == 0
            assert layer["router_entropy"] == pytest.approx(want["entropy"], rel=1e-5)
            assert layer["token_exchange"] in ("dedup", "pairs")
            assert layer["bytes_sent"] > 0
            assert layer["alltoall_s"] is None and layer["alltoall_share"] is None
            assert (layer["bias_min"], layer["bias_max"]) == pytest.approx(bias if bias is not None else (0.0, 0.0))
        assert result["alltoall_share"] is None
    assert results[0]["layers"] == results[1]["layers"]  # every rank sees the same figures


def test_the_backends_counts_ride_the_agreement() -> None:
    """One process: the block's statistics are its routed pairs per expert, dropless."""
    from moeflow.core.stats import ExecutionPlan
    from moeflow.hf.monitored import routing_stats

    plan = ExecutionPlan("sequential", "linear", 1, 1, "auto", "settled", 2, "transformers", token_exchange="dedup")
    stats = routing_stats([3, 0, 5, 2], 2, plan)
    assert (stats.num_tokens, stats.dropped, stats.tokens_per_expert) == (5, 0, [3, 0, 5, 2])
    assert (stats.capacity_factor, stats.plan.token_exchange) == (0.0, "dedup")

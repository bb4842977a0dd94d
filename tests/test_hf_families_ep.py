"""Every transformers MoE family with an expert-parallel plan runs through moeflow's backend
(``ep_implementation="moeflow"``): a tiny random model of each, made from transformers' own config
class (``tests/hf_families.py``), on 2 gloo processes gives the output the one-process model gives
on each rank's batch, and every parameter's gradient (its local shard) that transformers' own
``all_to_all`` gives. The families whose tiny model does not come up are listed with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_families import ep_families, family_batch, tiny_family_model
from pool import run_distributed

NOT_TESTED = {
    "deepseek_ocr2_text": "a text sub-config: transformers has no model class of its own for it",
    "qwen3_omni_moe_talker_text": "a text sub-config: transformers has no model class of its own for it",
    "qwen3_omni_moe_text": "a text sub-config: transformers has no model class of its own for it",
    "step3p5": "a text sub-config: transformers has no model class of its own for it",
    "unlimited_ocr_text": "a text sub-config: transformers has no model class of its own for it",
    "diffusion_gemma_text": "per-layer config fields: the tiny sizes need a per-layer config",
    "dots3_note_text": "per-layer config fields: the tiny sizes need a per-layer config",
    "dots3_note_vision_encoder": "per-layer config fields: the tiny sizes need a per-layer config",
    "gemma4_text": "per-layer config fields: the tiny sizes need a per-layer config",
    "ernie4_5_vl_moe_text": "moe_intermediate_size is a list per modality",
    "glm5_next_text": "its DSA attention layers take no rotary dimensions (NoPE): a config of its own",
    "granitemoehybrid": "its Mamba heads must divide the expanded hidden size: a config of its own",
    "hy_v4_vl_text": "its mrope sections must sum to its rotary dimension: a config of its own",
    "lfm2_moe": "its layer types need a config of their own",
    "glm4v_moe_text": "its mrope sections do not fit the tiny head size (fails on one process too)",
    "lara_mini": "its saved checkpoint does not load back (transformers' weight conversion splits q_proj)",
    "sarvam_moe": "its saved checkpoint does not load back (transformers' weight conversion)",
    "inkling2_text": "saving its tiny model fails in transformers (a vocabulary split the small vocabulary "
                     "cannot hold)",
    "inkling2_loop_text": "saving its tiny model fails in transformers (a vocabulary split the small vocabulary "
                          "cannot hold)",
}
"""The families with an expert-parallel plan the test does not run, and why: none is the backend's."""
TRANSFORMERS_EP_DIFFERS = ("bailing_hybrid", "kimi_linear")
"""Families whose output under transformers' own expert parallelism (``all_to_all``) differs from
the one-process model's by 0.1-0.5 on the tiny model (the cause, in transformers' distributed
layout, not looked into): moeflow's must equal ``all_to_all``'s there."""
IMPLEMENTATIONS = ("moeflow", "all_to_all")


def _load(path: str, **kwargs: Any) -> Any:
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    except ValueError:  # a family with no causal LM head: its base model
        return transformers.AutoModel.from_pretrained(path, dtype=torch.float32, **kwargs)


def _families_step(rank: int, world: int, paths: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each family under each implementation: one forward of this rank's batch and its backward."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed import DistributedConfig

    import moeflow.hf

    moeflow.hf.configure(token_exchange="dedup")  # the layout of training batches (auto sends these as pairs)
    results: dict[str, dict[str, Any]] = {}
    for family, path in paths.items():
        for implementation in IMPLEMENTATIONS:
            layout = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation=implementation)
            model = _load(path, distributed_config=layout)
            out = model(family_batch(rank), use_cache=False)[0]
            out.square().mean().backward()
            grads = {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                     for name, p in model.named_parameters() if p.grad is not None}
            results[f"{family}/{implementation}"] = {"out": out.detach(), "grads": grads}
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import transformers

    transformers.logging.set_verbosity_error()  # each family's loading report, 50 times over
    root = tmp_path_factory.mktemp("families")
    paths = {}
    for family in ep_families():
        if family not in NOT_TESTED:
            paths[family] = root / family
            tiny_family_model(family).save_pretrained(paths[family])
    return paths


def test_every_family_with_an_expert_parallel_plan_is_tested_or_listed() -> None:
    families = set(ep_families())
    assert set(NOT_TESTED) <= families, sorted(set(NOT_TESTED) - families)  # nothing listed that is gone
    assert len(families - set(NOT_TESTED)) >= 40


@pytest.mark.distributed
def test_every_family_runs_through_the_moeflow_backend(saved: dict[str, Path]) -> None:
    results = run_distributed(_families_step, 2, {family: str(path) for family, path in saved.items()},
                              timeout_s=900)
    for family, path in saved.items():
        model = _load(str(path))
        for rank, result in enumerate(results):
            with torch.no_grad():
                expected = model(family_batch(rank), use_cache=False)[0]
            ours, theirs = result[f"{family}/moeflow"], result[f"{family}/all_to_all"]
            if family in TRANSFORMERS_EP_DIFFERS:
                expected = theirs["out"]
            torch.testing.assert_close(ours["out"], expected, rtol=1e-5, atol=1e-5, msg=family)
            assert ours["grads"].keys() == theirs["grads"].keys() and ours["grads"], family
            for name, grad in ours["grads"].items():
                torch.testing.assert_close(grad, theirs["grads"][name], rtol=1e-5, atol=1e-6,
                                           msg=f"{family}: {name}")


def test_the_guide_lists_every_family_the_backend_runs() -> None:
    guide = (Path(__file__).parent.parent / "docs" / "guides" / "huggingface.md").read_text()
    tested = set(ep_families()) - set(NOT_TESTED)
    missing = sorted(family for family in tested if f"`{family}`" not in guide)
    assert not missing, f"docs/guides/huggingface.md does not list {missing}"

"""Every family moeflow converts (``moeflow.hf.FAMILIES``) computes, converted, what transformers'
eager experts compute: a tiny random model of each, from transformers' own config class, on one
process (logits, every gradient, and the weights back through ``to_hf``) and with its experts spread
over 2 gloo processes (each rank's logits, the dense gradients of its batch, and its experts' gradients
from both ranks' tokens)."""

from __future__ import annotations

import copy
import zlib
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from hf_families import ep_families, family_batch, tiny_family_model
from hf_models import randomize
from moeflow.hf import FAMILIES, HFMoEBlock, from_hf_block, replace_moe_blocks, to_hf
from moeflow.hf.families import family_for_model_type, family_of, router_weight
from moeflow.hf.weights import write_hf_block
from pool import run_distributed

CONVERTED = tuple(sorted({family.model_type for family in FAMILIES}))
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
"""fp32 on outputs and gradients of order one, summed in another order (per expert, over ranks)."""


GROUPED = {"n_group": 4, "topk_group": 2}
SCALED = {name: 2.5 for name in ("routed_scaling_factor", "router_scaling_factor", "route_scale",
                                 "moe_routed_scaling_factor")}
"""Group-limited selection and a scaling factor (under a family's name for it), where a family has them."""
CLAMPED = {"swiglu_limit": 0.6}
"""A clamped SwiGLU's cap low enough that many of a tiny model's values are capped (at 0.5 one of
MiniMax-M3's lay within rounding of the cap: the clamp's gradient, 0 or 1 there, then differed between
the one-process and the expert-parallel sums)."""


def _model(model_type: str) -> nn.Module:
    """The tiny model, its sparse blocks' weights and selection biases of unit-ish scale (no
    near-ties in routing: transformers' init draws them at 0.02 and zero)."""
    family = family_for_model_type(model_type)
    model = tiny_family_model(model_type, **(GROUPED if family.grouped else {}), **SCALED, **CLAMPED)
    for module in model.modules():
        if family_of(module) is not None:
            randomize(module, seed=zlib.crc32(model_type.encode()) % 1000)
    return model.train()


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward of ``ids`` (the first output: logits or hidden states) and its backward."""
    model.zero_grad(set_to_none=True)
    out = model(ids, use_cache=False)[0]
    out.square().mean().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _block_grads_as_hf(model: nn.Module) -> dict[str, torch.Tensor]:
    """The converted model's gradients under transformers' names: each block's full gradients
    written into its transformers block (the experts a rank does not hold as zeros)."""
    grads: dict[str, torch.Tensor] = {}
    for prefix, block in model.named_modules():
        if not isinstance(block, HFMoEBlock):
            continue
        moe = block.moe
        state = {name: torch.zeros_like(value) for name, value in moe.full_state_dict().items()}
        for name, param in moe.named_parameters():
            if param.grad is None:
                continue
            if name.startswith("experts."):
                for slot, shard in enumerate(moe.placement.local(moe.rank)):
                    state[name][shard.expert] = param.grad[slot]
            else:
                state[name] = param.grad
        template = block._template[0].to_empty(device="cpu")
        write_hf_block(template, block.family, state)
        grads.update({f"{prefix}.{name}": p.detach().clone() for name, p in template.named_parameters()})
    return grads


def _converted_step(rank: int, world: int, model_type: str) -> dict[str, Any]:
    import torch.distributed as dist

    model = replace_moe_blocks(_model(model_type), dist.group.WORLD if world > 1 else None)
    out, grads = _step(model, family_batch(rank))
    grads = {name: g for name, g in grads.items() if ".moe." not in name}
    return {"out": out, "grads": {**grads, **_block_grads_as_hf(model)}}


def _every_family(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {model_type: _converted_step(rank, world, model_type) for model_type in CONVERTED}


def test_every_converted_family_has_an_expert_parallel_plan() -> None:
    assert set(CONVERTED) <= set(ep_families()), sorted(set(CONVERTED) - set(ep_families()))
    assert len(CONVERTED) >= 20


@pytest.mark.parametrize("model_type", CONVERTED)
def test_converted_family_equals_transformers_on_one_process(model_type: str) -> None:
    hf = _model(model_type)
    weights = {name: t.clone() for name, t in hf.state_dict().items()}
    expected, expected_grads = _step(hf, family_batch(0))
    ours = replace_moe_blocks(copy.deepcopy(hf))
    got = _converted_step(0, 1, model_type)
    torch.testing.assert_close(got["out"], expected, **TOLERANCE)
    extra = got["grads"].keys() - expected_grads.keys()  # a selection bias held as a parameter: no gradient
    assert expected_grads.keys() <= got["grads"].keys() and all(not got["grads"][n].any() for n in extra), extra
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got["grads"][name], grad, **TOLERANCE, msg=name)
    restored = to_hf(ours).state_dict()
    assert restored.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(restored[name], tensor), name


@pytest.mark.distributed
def test_converted_families_under_expert_parallelism_equal_one_process() -> None:
    """Dense gradients are each rank's batch's; an expert's gathers both ranks' tokens."""
    results = run_distributed(_every_family, 2, timeout_s=600)
    for model_type in CONVERTED:
        hf = _model(model_type)
        steps = [_step(hf, family_batch(rank)) for rank in range(2)]
        for rank, result in enumerate(results):
            got = result[model_type]
            torch.testing.assert_close(got["out"], steps[rank][0], **TOLERANCE, msg=model_type)
            for name, grad in steps[rank][1].items():
                if ".experts." in name:
                    grad = _local_rows(name, steps[0][1][name] + steps[1][1][name], rank)
                torch.testing.assert_close(got["grads"][name], grad, **TOLERANCE, msg=f"{model_type}: {name}")


def _local_rows(name: str, grad: torch.Tensor, rank: int) -> torch.Tensor:
    """The rows of an (E, ...) expert gradient this rank holds (contiguous halves over 2 ranks);
    the others zero, as :func:`_block_grads_as_hf` writes them."""
    kept = torch.zeros_like(grad)
    half = grad.shape[0] // 2
    kept[rank * half:(rank + 1) * half] = grad[rank * half:(rank + 1) * half]
    return kept


LOADER_REFUSES = {
    "bailing_hybrid": "transformers builds its attention's conv1d weights from others on load",
    "kimi_linear": "transformers builds its attention's conv1d weights from others on load",
}
"""Families whose checkpoints the per-rank loader refuses, and why (they run through the backend)."""
CAUSAL_LMS = tuple(t for t in CONVERTED if t not in ("mistral4", "mistral_large4_text", "qwen3_vl_moe_text",
                                                   "openai_privacy_filter"))
"""The converted families with a causal LM of their own (the others are text parts of multimodal models,
converted inside them, and a token classifier): ``moeflow train --hf`` and ``generate --hf`` load these."""


def test_per_rank_loading_equals_from_pretrained_in_every_family(tmp_path) -> None:
    """``load_hf_model`` (each rank reads its own experts) gives transformers' ``from_pretrained``
    + conversion: every tensor and the logits, in every family with a causal LM."""
    import transformers

    from moeflow.hf.loading import load_hf_model, load_whole

    transformers.logging.set_verbosity_error()
    for model_type in CAUSAL_LMS:
        directory = tmp_path / model_type
        _model(model_type).save_pretrained(directory)
        if model_type in LOADER_REFUSES:
            with pytest.raises(ValueError, match="ep_implementation='moeflow'"):
                load_hf_model(directory)
            continue
        expected, got = load_whole(transformers, directory, None, None), load_hf_model(directory)
        want, have = expected.state_dict(), got.state_dict()
        assert want.keys() == have.keys(), model_type
        assert all(torch.equal(have[name], tensor) for name, tensor in want.items()), model_type
        with torch.no_grad():
            ids = family_batch(0)
            assert torch.equal(got(ids, use_cache=False)[0], expected(ids, use_cache=False)[0]), model_type


def test_the_guide_says_which_path_each_family_takes() -> None:
    """The guide's two lists: the converted families are ``FAMILIES``; the backend-only ones are the
    rest of those the backend test runs."""
    import re
    from pathlib import Path

    from test_hf_families_ep import NOT_TESTED

    guide = (Path(__file__).parent.parent / "docs" / "guides" / "huggingface.md").read_text()
    converted = guide.split("### Converted")[1].split("### Through the backend only")[0]
    backend = guide.split("### Through the backend only")[1].split("\n## ")[0]
    named = {section: set(re.findall(r"`([a-z0-9_]+)`", text)) for section, text in
             (("converted", converted), ("backend", backend))}
    assert set(CONVERTED) <= named["converted"], sorted(set(CONVERTED) - named["converted"])
    backend_only = set(ep_families()) - set(NOT_TESTED) - set(CONVERTED)
    assert backend_only <= named["backend"], sorted(backend_only - named["backend"])
    assert not named["backend"] & set(CONVERTED), sorted(named["backend"] & set(CONVERTED))


@pytest.mark.parametrize(("model_type", "settings", "message"), [
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
     "gate.topk_method='group_limited_greedy'; moeflow converts it only with 'greedy'"),
    ("laguna", {"moe_router_logit_softcapping": 30.0}, "gate.router_logit_softcapping=30.0"),
    ("axk2", {"n_group": 4, "topk_group": 2}, "gate.num_group=4; moeflow converts it only with None or 1"),
    ("aria_text", {"hidden_act": "gelu"}, "the shared MLP of AriaTextMoELayer use GELUActivation"),
])
def test_a_variant_moeflow_does_not_compute_is_refused_naming_the_setting_and_the_backend(
    model_type: str, settings: dict[str, Any], message: str
) -> None:
    import re

    model = tiny_family_model(model_type, **settings)
    with pytest.raises(ValueError, match=re.escape(message) + ".*ep_implementation='moeflow'"):
        replace_moe_blocks(model)


BF16_DEPARTS = {"mistral4": 0.02}
"""Families whose bf16 routing moeflow computes otherwise, the share of tokens that may go elsewhere,
as the guide says: Mistral-4 takes its softmax in bf16, moeflow in fp32."""


@pytest.mark.parametrize("model_type", CONVERTED)
def test_converted_block_routes_as_transformers_in_bf16(model_type: str, tmp_path) -> None:
    """A bf16 model as from_pretrained gives it, where some families keep their router in fp32
    (HunYuan's, DeepSeek's): the converted layer holds its experts in bf16 and its router in the
    router's dtype, and chooses the same experts (the outputs differ by bf16's rounding, not by a
    token's expert)."""
    import transformers

    transformers.logging.set_verbosity_error()
    _model(model_type).save_pretrained(tmp_path)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    except ValueError:  # a text part of a multimodal model: its base model
        model = transformers.AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    block = next(module for module in model.modules() if family_of(module) is not None)
    family = family_of(block)
    assert family is not None
    x = torch.randn(4, 256, router_weight(block, family).shape[-1], generator=torch.Generator().manual_seed(5))
    ours = from_hf_block(block)
    assert ours.moe.experts.w1.dtype == torch.bfloat16
    assert ours.moe.gate.weight.dtype == router_weight(block, family).dtype
    with torch.no_grad():
        expected, got = (_hidden(module(x.to(torch.bfloat16))) for module in (block, ours))
    assert got.dtype == expected.dtype
    scale = expected.float().abs().max().item()
    rerouted = ((got.float() - expected.float()).abs().amax(-1) > 0.05 * scale).float().mean().item()
    assert rerouted <= BF16_DEPARTS.get(model_type, 0.0), f"{rerouted:.1%} of the tokens routed otherwise"


def _hidden(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A block's hidden states (gpt-oss's block returns them with its router's scores)."""
    return output[0] if isinstance(output, tuple) else output


def test_an_ernie_block_without_a_shared_expert_converts_and_one_with_biases_is_refused() -> None:
    model = tiny_family_model("ernie4_5_moe", moe_num_shared_experts=0)
    converted = replace_moe_blocks(copy.deepcopy(model))
    ids = family_batch(0)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids, use_cache=False)[0], model(ids, use_cache=False)[0], **TOLERANCE)
    with pytest.raises(ValueError, match=r"has biases.*ep_implementation='moeflow'"):
        replace_moe_blocks(tiny_family_model("ernie4_5_moe", use_bias=True))

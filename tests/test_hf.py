"""Hugging Face interop: moeflow's blocks compute exactly what transformers' sparse MoE blocks do."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_checks import FAMILIES, whole_model_logits
from hf_models import as_v4_block, greedy_reference, tiny_model, word_tokenizer
from moeflow.cli import main
from moeflow.hf import HFMoEBlock, from_hf_block, moe_blocks, replace_moe_blocks, to_hf
from moeflow.hf.families import family_of
from moeflow.hf.generate import SamplingSettings
from pool import run_distributed

TIGHT = {"atol": 1e-12, "rtol": 1e-10}


def first_block(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if family_of(m) is not None)


@pytest.mark.parametrize("layout", ["v5-fused", "v4-per-expert"])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_equals_transformers(family: str, layout: str) -> None:
    """Outputs (and v4's router logits) and input gradients, fp64, every family and layout."""
    block = first_block(tiny_model(family, dtype=torch.float64))
    if layout == "v4-per-expert":
        block = as_v4_block(block)
    x = torch.randn(3, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    expected = block(x)
    ours = from_hf_block(block, pipeline=1)
    got = ours(x)
    assert type(got) is type(expected)
    if isinstance(expected, tuple):
        torch.testing.assert_close(got[1], expected[1], **TIGHT)
        expected, got = expected[0], got[0]
    torch.testing.assert_close(got, expected, **TIGHT)
    grad = torch.randn_like(expected)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    torch.testing.assert_close(got_grad, expected_grad, **TIGHT)
    assert ours.moe.last_stats is not None and sum(ours.moe.last_stats.dropped_per_expert) == 0


def test_from_hf_block_copies_weights_and_leaves_the_block_intact() -> None:
    block = first_block(tiny_model("deepseek_v3"))
    before = {k: v.clone() for k, v in block.state_dict().items()}
    ours = from_hf_block(block)
    after = block.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the user's block still works
    torch.testing.assert_close(ours.moe.gate.expert_bias, block.gate.e_score_correction_bias, rtol=0, atol=0)
    with torch.no_grad():
        block.experts.gate_up_proj.add_(1.0)
    assert not torch.equal(ours.moe.experts.w1, block.experts.gate_up_proj[:, :12].transpose(1, 2))


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_logits_and_weights_round_trip(family: str) -> None:
    result = whole_model_logits(0, 1, family)
    assert result["logits"] < 1e-10
    assert result["weights"] == 0.0 and result["same_names"] == 1.0


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.smoke), 4])
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_expert_parallel_model_equals_transformers(family: str, world_size: int) -> None:
    """Experts spread over the workers (E / W each), every worker's own batch, logits as transformers'."""
    for result in run_distributed(whole_model_logits, world_size, family, timeout_s=300):
        assert result["local_experts"] == 1.0
        assert result["logits"] < 1e-10
        assert result["weights"] == 0.0 and result["same_names"] == 1.0


def test_round_trip_through_save_pretrained(tmp_path) -> None:
    """HF -> moeflow -> to_hf -> save_pretrained -> plain transformers: equal logits."""
    import transformers

    hf = tiny_model("qwen2_moe")
    ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids).logits
    ours = replace_moe_blocks(copy.deepcopy(hf))
    assert len(moe_blocks(ours)) == hf.config.num_hidden_layers
    to_hf(ours).save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, HFMoEBlock) for m in reloaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_unsupported_architectures_get_a_clear_error() -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2)
    llama = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"model_type='llama'.*Mixtral.*Qwen2-MoE.*Qwen3-MoE.*DeepSeek-V3"):
        replace_moe_blocks(llama)
    with pytest.raises(ValueError, match="from_hf_block cannot convert LlamaMLP"):
        from_hf_block(llama.model.layers[0].mlp)
    mixtral = tiny_model("mixtral", router_jitter_noise=0.1)
    with pytest.raises(ValueError, match="router_jitter_noise"):
        replace_moe_blocks(mixtral)


def _saved_model(tmp_path, family: str, prompts: list[list[int]], new_tokens: int):
    """A tiny model saved with a tokenizer, whose EOS is a token the first prompt emits early."""
    hf = tiny_model(family)
    eos = greedy_reference(hf, prompts[:1], new_tokens, None)[0][2]
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = eos, 0
    hf.save_pretrained(tmp_path)
    word_tokenizer(hf.config.vocab_size).save_pretrained(tmp_path)
    return hf, eos


@pytest.mark.distributed
@pytest.mark.parametrize("workers", [1, 2])
def test_generate_cli_matches_transformers_greedy(tmp_path, capfd, workers: int) -> None:
    """Prompts of different lengths; worker 1 has fewer batches and one sequence ends at EOS early:
    the tokens are exactly transformers' greedy ones."""
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 96, (n,), generator=generator).tolist() for n in (4, 9, 1, 6, 3)]
    hf, eos = _saved_model(tmp_path / "model", "deepseek_v3", prompts, 10)
    expected = greedy_reference(hf, prompts, 10, eos)
    assert len(expected[0]) == 3 and expected[0][-1] == eos  # finishes early
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    code = main(["generate", "--hf", str(tmp_path / "model"), "--prompts", str(prompt_file), "--workers",
                 str(workers), "--max-new-tokens", "10", "--batch-size", "2"])
    out = capfd.readouterr()
    assert code == 0, out.err
    records = [json.loads(line) for line in out.out.splitlines()]
    assert [r["output_ids"] for r in records] == expected
    assert [r["input_ids"] for r in records] == prompts
    assert f"round {3 if workers == 1 else 2}/{3 if workers == 1 else 2} done" in out.err
    assert "Loading weights" not in out.err


@pytest.mark.distributed
def test_generate_cli_text_prompts_and_sampling(tmp_path, capsys) -> None:
    prompts = [[5, 6, 7], [8, 9]]
    _saved_model(tmp_path / "model", "qwen3_moe", prompts, 6)
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("w5 w6 w7\nw8 w9\n")
    argv = ["generate", "--hf", str(tmp_path / "model"), "--prompts", str(prompt_file), "--workers", "2",
            "--max-new-tokens", "6", "--temperature", "0.9", "--top-p", "0.8", "--seed", "3"]
    assert main(argv) == 0
    first = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["input_ids"] for r in first] == prompts
    assert all(r["text"] == " ".join(f"w{t}" for t in r["output_ids"]) for r in first)
    assert main(argv) == 0  # seeded: the same samples again
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == first


def test_generate_cli_bad_input(tmp_path, capsys) -> None:
    assert main(["generate", "--hf", str(tmp_path), "--prompts", str(tmp_path / "p.txt")]) == 2
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingSettings(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingSettings(max_new_tokens=0)


@pytest.mark.slow
def test_bench_generate_compares_implementations_on_the_same_weights(capsys) -> None:
    """A short run of the benchmark: every implementation's record, the comparison with identical
    greedy tokens, the floor, and the summary line."""
    argv = ["bench", "generate", "--models", "mixtral", "--batch-sizes", "2", "--repeats", "1",
            "--prompt-tokens", "4", "--new-tokens", "3"]
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    records = {r.get("implementation"): r for r in lines if r.get("bench") == "generate"}
    assert set(records) == {"eager", "grouped_mm", "moeflow"}
    assert all(r["decode_tokens_per_s"] > 0 and r["decode_p95_ms"] >= r["decode_p50_ms"] for r in records.values())
    (compare,) = [r for r in lines if r.get("bench") == "generate-compare"]
    assert compare["same_tokens_as_eager"] and compare["same_tokens_as_fastest"]
    # the floor and the step are timed apart (one repeat here): their ratio is the benchmark's figure, not a
    # bound a loaded test machine keeps
    assert compare["moe_floor_ms"] > 0 and compare["moe_decode_ms"] > 0
    ratio = compare["moe_decode_ms"] / compare["moe_floor_ms"]
    assert compare["moe_over_floor"] == pytest.approx(ratio, rel=5e-3)  # the records round to a few digits
    assert compare["kernel_over_floor"] == pytest.approx(compare["read_gb_per_s"] / compare["gemm_gb_per_s"], rel=1e-3)
    assert compare["fastest_hf_moe_over_floor"] > 0
    assert lines[-1]["summary"] == "generate" and lines[-1]["all_tokens_identical"]


def test_bench_generate_needs_a_decode_step() -> None:
    with pytest.raises(SystemExit, match="--new-tokens 1 leaves no decode step"):
        main(["bench", "generate", "--new-tokens", "1"])

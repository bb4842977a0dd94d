"""``load_hf_model`` reads only a rank's experts from the safetensors files: the model equals
transformers' ``from_pretrained`` + ``replace_moe_blocks`` (names, dtypes, values, logits) in every
family, dtype, sharded or single file, tied or not; on 2 gloo workers each rank reads and holds
E / W of the expert weights and computes the single-process logits; nothing stays on meta."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from hf_models import tiny_model
from moeflow.hf import moe_blocks, replace_moe_blocks
from moeflow.hf.loading import load_hf_model, load_whole
from moeflow.hf.safetensors_files import SafetensorsCheckpoint
from pool import run_distributed

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 5 + rank), generator=torch.Generator().manual_seed(100 + rank))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _save(directory: Path, family: str, **overrides: Any) -> Path:
    """transformers' own save_pretrained (its checkpoint layout: per-expert tensors, v4 names)."""
    shard = overrides.pop("max_shard_size", None)
    tiny_model(family, **overrides).save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return directory


def _save_fused(directory: Path, family: str, **overrides: Any) -> Path:
    """A checkpoint in transformers v5's module layout: fused (E, 2I, H) / (E, H, I) expert tensors."""
    from safetensors.torch import save_file

    model = tiny_model(family, **overrides)
    model.config.save_pretrained(directory)
    save_file({name: t.contiguous() for name, t in model.state_dict().items()}, str(directory / "model.safetensors"))
    return directory


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


@pytest.mark.parametrize("variant", ["fp32-single-file", "bf16-tied-sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lazy_load_equals_from_pretrained(tmp_path: Path, family: str, variant: str) -> None:
    bf16 = variant.startswith("bf16")
    directory = _save(tmp_path, family, tie_word_embeddings=bf16, **({"max_shard_size": "4KB"} if bf16 else {}))
    assert (directory / "model.safetensors.index.json").is_file() == bf16
    import transformers

    dtype = "bf16" if bf16 else None
    expected = load_whole(transformers, directory, dtype, None, pipeline=1)
    got = load_hf_model(directory, dtype, None, pipeline=1)
    want, have = _tensors(expected), _tensors(got)
    assert sorted(want) == sorted(have)
    for name, tensor in want.items():
        assert have[name].dtype == tensor.dtype and torch.equal(have[name], tensor), name
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == bf16
    assert got.generation_config.to_dict() == expected.generation_config.to_dict()
    assert not got.training
    assert torch.equal(_logits(got, _ids(0)), _logits(expected, _ids(0)))


def test_files_closed_and_reopened_between_reads_load_the_same(tmp_path: Path, monkeypatch) -> None:
    """The reader closes its files every RELEASE_BYTES (their touched pages count as the worker's
    memory until then); reading on through reopened files changes nothing."""
    import transformers

    import moeflow.hf.safetensors_files as files

    directory = _save(tmp_path, "qwen2_moe", max_shard_size="4KB")
    expected = load_whole(transformers, directory, None, None, pipeline=1)
    opened = []
    monkeypatch.setattr(files, "RELEASE_BYTES", 1)
    monkeypatch.setattr(files.SafetensorsCheckpoint, "_handle", _counting(files.SafetensorsCheckpoint._handle, opened))
    got = load_hf_model(directory, None, None, pipeline=1)
    assert len(opened) > len(set(opened)) > 1  # several shards, each opened again after a release
    want = _tensors(expected)
    assert all(torch.equal(t, want[name]) for name, t in _tensors(got).items())


def _counting(handle: Any, opened: list[str]) -> Any:
    def counted(self: SafetensorsCheckpoint, key: str) -> Any:
        if self.files[key] not in self._handles:
            opened.append(self.files[key])
        return handle(self, key)

    return counted


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_no_parameter_or_buffer_is_left_on_meta(tmp_path: Path, family: str) -> None:
    model = load_hf_model(_save(tmp_path, family), None, None)
    assert all(not t.is_meta and t.device.type == "cpu" for t in _tensors(model).values())
    rotary = model.model.rotary_emb  # non-persistent: re-created, as from_config computes it
    reference = type(rotary)(config=model.config)
    assert torch.equal(rotary.inv_freq, reference.inv_freq)
    assert torch.equal(rotary.original_inv_freq, reference.original_inv_freq)


def test_a_buffer_the_model_init_does_not_recreate_is_refused(tmp_path: Path, monkeypatch) -> None:
    """Non-persistent buffers (rotary inv_freq) are no checkpoint's: the model's ``_init_weights``
    re-creates them, and one it would leave unset fails the load instead of computing garbage."""
    import transformers

    directory = _save(tmp_path, "mixtral")
    monkeypatch.setattr(transformers.MixtralForCausalLM, "_init_weights", lambda self, module: None)
    with pytest.raises(ValueError, match="does not re-create the buffers inv_freq, original_inv_freq"):
        load_hf_model(directory, None, None)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_fused_expert_checkpoints_are_sliced(tmp_path: Path, family: str) -> None:
    """A checkpoint with stacked experts (v5's module names) loads to the same model."""
    hf = tiny_model(family)
    expected = replace_moe_blocks(copy.deepcopy(hf), pipeline=1)
    got = load_hf_model(_save_fused(tmp_path, family), None, None, pipeline=1)
    want = expected.state_dict()
    assert all(torch.equal(t, want[name]) for name, t in got.state_dict().items())
    assert torch.equal(_logits(got, _ids(1)), _logits(expected, _ids(1)))


def test_pytorch_bin_checkpoints_load_whole_with_a_warning(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    directory = _save(tmp_path, "qwen3_moe")
    torch.save(load_file(str(directory / "model.safetensors")), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    with pytest.warns(UserWarning, match="no safetensors weights"):
        model = load_hf_model(directory, None, None, pipeline=1)
    reference = replace_moe_blocks(tiny_model("qwen3_moe"), pipeline=1)
    assert torch.equal(_logits(model, _ids(0)), _logits(reference, _ids(0)))


@pytest.mark.parametrize("dropped", ["model.layers.1.block_sparse_moe.experts.2.w3.weight", "model.norm.weight"])
def test_a_tensor_missing_from_the_checkpoint_is_named(tmp_path: Path, dropped: str) -> None:
    from safetensors.torch import load_file, save_file

    directory = _save(tmp_path, "mixtral")
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors[dropped]
    save_file(tensors, str(directory / "model.safetensors"))
    name = dropped.replace("block_sparse_moe", "mlp")  # the name transformers v5 gives it
    with pytest.raises(ValueError, match=f"holds no tensor for {name}"):
        load_hf_model(directory, None, None)


# -- two workers ---------------------------------------------------------------------------------

CASES = {  # name: (family, fused layout, config overrides, layer options)
    "mixtral-per-expert": ("mixtral", False, {}, {}),
    "deepseek-fused": ("deepseek_v3", True, {}, {}),
    # one expert, its hidden dimension split over the two ranks (Tutel's r = 0): slices of each tensor
    "mixtral-hidden-sliced": ("mixtral", True, {"num_local_experts": 1, "num_experts_per_tok": 1},
                              {"parallel": 0, "expert_kernel": "bmm"}),
}


def _expert_numel(model: torch.nn.Module) -> int:
    return sum(block.moe.experts.w1.numel() * 3 for block in moe_blocks(model))


def _worker_loads(rank: int, world_size: int, directories: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each case loaded over the world, recording how many expert elements were read."""
    results = {}
    original = SafetensorsCheckpoint.read
    for case, directory in directories.items():
        read_numel = [0]

        def recording(self: SafetensorsCheckpoint, key: str, index: Any = None, count: list[int] = read_numel):
            value = original(self, key, index)
            if ".experts." in key:
                count[0] += value.numel()
            return value

        SafetensorsCheckpoint.read = recording  # type: ignore[method-assign]
        try:
            model = load_hf_model(directory, None, dist.group.WORLD, pipeline=1, **CASES[case][3])
        finally:
            SafetensorsCheckpoint.read = original  # type: ignore[method-assign]
        results[case] = {"held": _expert_numel(model), "read": read_numel[0],
                         "logits": _logits(model, _ids(rank)).numpy(),  # numpy: tensors do not outlive the worker
                         "meta": [n for n, t in _tensors(model).items() if t.is_meta]}
    return results


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:normalize_gate=True with top_k=1")  # Mixtral's rule, at one expert
def test_each_of_two_workers_reads_and_holds_only_its_experts(tmp_path: Path) -> None:
    directories = {}
    for case, (family, fused, overrides, _) in CASES.items():
        directory = tmp_path / case
        directory.mkdir()
        (_save_fused if fused else _save)(directory, family, **overrides)
        directories[case] = str(directory)
    results = run_distributed(_worker_loads, 2, directories, timeout_s=300)
    for case, directory in directories.items():
        single = load_hf_model(directory, None, None, pipeline=1, **CASES[case][3])
        total = _expert_numel(single)
        for rank, by_case in enumerate(results):
            got = by_case[case]
            assert got["held"] * 2 == total and got["read"] == got["held"], (case, rank, got["held"], total)
            assert got["meta"] == []
            expected = _logits(single, _ids(rank))  # fp32 sums in another order: not bit for bit
            torch.testing.assert_close(torch.from_numpy(got["logits"]), expected, rtol=1e-5, atol=1e-5)


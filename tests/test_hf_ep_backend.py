"""moeflow as transformers' expert-parallel backend (``ep_implementation="moeflow"``): a tiny model
loaded with ``DistributedConfig(fsdp_size=W, ep_size=W)`` on W gloo processes (or ``tp_size=W``,
the ranks sharing one batch) gives the logits the one-process model gives on each rank's batch, and
the gradients (every parameter's local shard) that transformers' own ``all_to_all`` gives, for every
way moeflow moves the tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_models import saved_tiny_models
from moeflow.comm.topology import Topology
from pool import run_distributed

TOKENS = (2, 10)  # each rank's batch: sequences x length
PIPELINED = (6, 40)  # a batch whose rows fill chunks of PIPELINE_MIN_ROWS


def _batch(rank: int, vocab: int, tokens: tuple[int, int] = TOKENS) -> torch.Tensor:
    return torch.randint(0, vocab, tokens, generator=torch.Generator().manual_seed(100 + rank))


def _ep_step(rank: int, world: int, path: str, implementation: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One forward and backward of the saved model under transformers' expert parallelism."""
    import transformers
    from torch.distributed.tensor import DTensor
    from transformers.distributed import DistributedConfig

    import moeflow.hf

    per_rank = settings.get("per_rank")  # each rank its own layout: the receivers take either
    if per_rank is not None:
        settings = {"token_exchange": per_rank[rank]}
    settings = dict(settings)
    tensor_parallel = settings.pop("tensor_parallel", False)  # the ranks share one batch, TP attention
    tokens = settings.pop("tokens", TOKENS)
    checkpointing = settings.pop("checkpointing", False)  # transformers' activation checkpointing
    experts_only = settings.pop("experts_only", False)  # everything but the experts frozen
    moeflow.hf.configure(**settings)  # every call sets its own: the pool's workers outlive a test
    exchanges = _count_chunk_exchanges()
    sizes = {"tp_size": world} if tensor_parallel else {"fsdp_size": world}
    layout = DistributedConfig(**sizes, ep_size=world, ep_implementation=implementation)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=layout)
    ids = _batch(0 if tensor_parallel else rank, model.config.vocab_size, tokens)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    if experts_only:
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(".experts." in name)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in model.named_parameters() if p.grad is not None}
    logits = out.logits.full_tensor() if isinstance(out.logits, DTensor) else out.logits  # TP's head: a DTensor
    # numpy arrays: torch's shared-memory handover of a tensor result failed under tensor parallelism
    return {"logits": logits.detach().numpy(), "grads": {name: grad.numpy() for name, grad in grads.items()},
            "chunk_exchanges": exchanges(),
            "moe_layers": sum(hasattr(module, "has_gate") for module in model.modules())}


def _count_chunk_exchanges() -> Any:
    """The all-to-alls the pipelined path runs from now on (a counter; the pool's workers outlive a test,
    so each call wraps the module's function afresh around the original)."""
    import moeflow.hf.pipelined as pipelined

    original = getattr(pipelined, "_original_exchange", pipelined.exchange)
    pipelined._original_exchange = original
    count = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    pipelined.exchange = counted
    return lambda: count[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return saved_tiny_models(tmp_path_factory, ("qwen3_moe", "deepseek_v3"), seed=1)


@pytest.fixture(scope="module")
def transformers_runs() -> dict[tuple[str, int, str], list[dict[str, Any]]]:
    """transformers' own all_to_all runs, by (family, world, settings): several cases compare with one."""
    return {}


def _transformers_run(runs: dict, family: str, world: int, path: str, shared: dict[str, Any]) -> list[dict[str, Any]]:
    """transformers' all_to_all run of ``family`` with the ``shared`` settings (once per module)."""
    key = (family, world, repr(sorted(shared.items())))
    if key not in runs:
        runs[key] = run_distributed(_ep_step, world, path, "all_to_all", shared, timeout_s=300)
    return runs[key]


def _one_process_logits(path: Path, world: int, tokens: tuple[int, int] = TOKENS) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [model(_batch(rank, model.config.vocab_size, tokens)).logits for rank in range(world)]


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "world", "settings"), [
    ("qwen3_moe", 2, {}),
    ("qwen3_moe", 2, {"token_exchange": "dedup"}),
    ("qwen3_moe", 2, {"per_rank": ["dedup", "pairs"]}),
    ("qwen3_moe", 2, {"token_exchange": "dedup", "alltoall": "pairwise"}),
    ("deepseek_v3", 2, {"token_exchange": "dedup"}),
    ("qwen3_moe", 4, {"token_exchange": "dedup", "alltoall": "2dh", "topology": Topology(4, 2)}),
    ("qwen3_moe", 2, {"token_exchange": "dedup", "tensor_parallel": True}),
    ("qwen3_moe", 2, {"token_exchange": "dedup", "pipeline": 3, "tokens": PIPELINED}),
    ("deepseek_v3", 2, {"token_exchange": "pairs", "pipeline": 2, "tokens": PIPELINED}),
    ("qwen3_moe", 4, {"token_exchange": "dedup", "pipeline": 2, "alltoall": "pairwise", "tokens": PIPELINED}),
    ("qwen3_moe", 2, {"token_exchange": "dedup", "pipeline": 3}),  # a batch too small for chunks: one piece
    ("qwen3_moe", 2, {"token_exchange": "dedup", "pipeline": 2, "tokens": PIPELINED, "checkpointing": True}),
    ("qwen3_moe", 2, {"token_exchange": "dedup", "pipeline": 2, "tokens": PIPELINED, "experts_only": True}),
])
def test_moeflow_backend_gives_the_one_process_logits_and_transformers_gradients(
    saved: dict[str, Path], transformers_runs: dict, family: str, world: int, settings: dict[str, Any]
) -> None:
    path = str(saved[family])
    ours = run_distributed(_ep_step, world, path, "moeflow", settings, timeout_s=300)
    shared = {key: settings[key] for key in ("tensor_parallel", "tokens", "checkpointing", "experts_only")
              if key in settings}
    theirs = _transformers_run(transformers_runs, family, world, path, shared)
    expected = _one_process_logits(saved[family], world, settings.get("tokens", TOKENS))
    if shared.get("tensor_parallel"):  # every rank the one batch
        expected = [expected[0]] * world
    for rank in range(world):
        torch.testing.assert_close(torch.from_numpy(ours[rank]["logits"]), expected[rank], rtol=1e-5, atol=1e-5)
        assert ours[rank]["grads"].keys() == theirs[rank]["grads"].keys()
        assert any("experts" in name for name in ours[rank]["grads"])
        degree = settings.get("pipeline", 1) if "tokens" in settings else 1
        layers = ours[rank]["moe_layers"]
        # packed (exact wire): per chunk and layer one all-to-all each way, forward and backward (and
        # the forward again where activation checkpointing recomputes it)
        runs = 3 if settings.get("checkpointing") else 2
        assert ours[rank]["chunk_exchanges"] == (2 * runs * degree * layers if degree > 1 else 0)
        for name, grad in ours[rank]["grads"].items():
            torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(theirs[rank]["grads"][name]),
                                       rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_moeflow_backend_sends_rows_in_the_wire_format_asked_for(saved: dict[str, Path]) -> None:
    """bf16 rows both ways: the logits move by bf16's rounding, not more, and not at all exact."""
    path = str(saved["qwen3_moe"])
    exact = run_distributed(_ep_step, 2, path, "moeflow", {}, timeout_s=300)
    bf16 = run_distributed(_ep_step, 2, path, "moeflow", {"wire_dtype": "bf16", "token_exchange": "dedup"},
                           timeout_s=300)
    chunked = run_distributed(_ep_step, 2, path, "moeflow", {"wire_dtype": "bf16", "token_exchange": "dedup",
                                                             "pipeline": 2, "tokens": PIPELINED}, timeout_s=300)
    bf16_big = run_distributed(_ep_step, 2, path, "moeflow", {"wire_dtype": "bf16", "token_exchange": "dedup",
                                                              "tokens": PIPELINED}, timeout_s=300)
    for rank in range(2):
        difference = abs(bf16[rank]["logits"] - exact[rank]["logits"]).max().item()
        assert 0 < difference < 0.05
        assert abs(chunked[rank]["logits"] - bf16_big[rank]["logits"]).max().item() == 0  # the same rows, in chunks
        assert chunked[rank]["chunk_exchanges"] > 0


def test_configure_names_the_bad_setting() -> None:
    import moeflow.hf

    with pytest.raises(ValueError, match="token_exchange 'dedupe'; choose one of auto, dedup, pairs"):
        moeflow.hf.configure(token_exchange="dedupe")
    with pytest.raises(ValueError, match="alltoall '2d'"):
        moeflow.hf.configure(alltoall="2d")
    with pytest.raises(ValueError, match="pipeline must be 'auto' or a number of chunks >= 1, got 0"):
        moeflow.hf.configure(pipeline=0)
    moeflow.hf.configure()  # the defaults again for the tests after this one


@pytest.mark.parametrize("token_exchange", ["dedup", "pairs", "auto"])
def test_routes_send_every_choice_once_and_dedup_a_token_once_per_rank(token_exchange: str) -> None:
    """Every (token, expert) choice arrives once, with its weight, at the rank holding the expert;
    under dedup each (token, rank) pair is one row, its valid slots first."""
    from moeflow.hf.expert_parallel import DEDUP_MIN_PAIRS, ROUTES, exchange_for

    generator = torch.Generator().manual_seed(0)
    tokens, top_k, local, world = 12, 3, 2, 4
    index_TK = torch.stack([torch.randperm(local * world, generator=generator)[:top_k] for _ in range(tokens)])
    weights_TK = torch.rand(tokens, top_k, generator=generator)
    routes = ROUTES[exchange_for(token_exchange, index_TK)](index_TK, weights_TK, local, world)
    ranks_N = torch.repeat_interleave(torch.arange(world), routes.sizes_W)
    valid_NK = routes.ids_NK < local
    received = {(int(t), int(r) * local + int(i), float(w)) for t, r, ids, ws, valid in
                zip(routes.token_N, ranks_N, routes.ids_NK, routes.weights_NK, valid_NK, strict=True)
                for i, w, v in zip(ids, ws, valid, strict=True) if v}
    chosen = {(t, int(e), float(w)) for t in range(tokens) for e, w in zip(index_TK[t], weights_TK[t], strict=True)}
    assert received == chosen and int(valid_NK.sum()) == tokens * top_k
    assert bool((routes.weights_NK[~valid_NK] == 0).all())
    if token_exchange == "auto":  # a small batch goes as pairs
        assert tokens * top_k < DEDUP_MIN_PAIRS and len(routes.token_N) == tokens * top_k
    if token_exchange == "dedup":
        pairs = list(zip(routes.token_N.tolist(), ranks_N.tolist(), strict=True))
        assert len(pairs) == len(set(pairs)) < tokens * top_k
        assert routes.width == int(valid_NK.sum(1).max()) and bool((valid_NK.int().diff(dim=1) <= 0).all())


TINY_BENCH = ["--num-experts", "4", "--top-k", "2", "--hidden-size", "16", "--moe-hidden", "8", "--layers", "1",
              "--batch", "1", "--seq", "8", "--repeats", "1"]


@pytest.mark.distributed
def test_bench_hf_ep_prints_every_implementation_with_equal_logits(capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' all_to_all, moeflow's backend and ``train --hf``'s model, side by side."""
    import json

    from moeflow.cli import main

    assert main(["bench", "hf-ep", "--workers", "2", *TINY_BENCH]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    record, summary = lines[0], lines[-1]
    assert record["bench"] == "hf-ep" and record["workers"] == 2
    for phase in ("step", "prefill", "decode"):
        assert record[f"{phase}_all_to_all_ms"] > 0 and record[f"{phase}_moeflow_ms"] > 0
        assert record[f"{phase}_train_hf_ms"] > 0
        assert len(summary[f"{phase}_over_moeflow"]) == 1 and len(summary[f"{phase}_over_train_hf"]) == 1
    assert record["logits_max_difference"] < 1e-5 and record["generated_equal"] is True
    assert record["moeflow_degrees"] == []  # pipeline auto: a batch this small fills no chunks, nothing searched
    assert summary["summary"] == "hf-ep" and summary["generated_equal"] is True


def test_bench_hf_ep_refuses_layouts_expert_parallelism_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    from moeflow.cli import main

    with pytest.raises(SystemExit, match="at least 2 ranks that divide --num-experts 4"):
        main(["bench", "hf-ep", "--workers", "3", *TINY_BENCH])
    with pytest.raises(SystemExit, match="--top-k 8 exceeds --num-experts 4"):
        main(["bench", "hf-ep", *TINY_BENCH, "--top-k", "8"])
    with pytest.raises(SystemExit):
        main(["bench", "hf-ep", *TINY_BENCH, "--pipeline", "two"])
    assert "--pipeline: give auto or a number of chunks >= 1, got 'two'" in capsys.readouterr().err


def _ep_generate(rank: int, world: int, path: str, implementation: str) -> torch.Tensor:
    """Greedy generation of each rank's prompt under transformers' expert parallelism."""
    import transformers
    from transformers.distributed import DistributedConfig

    import moeflow.hf

    moeflow.hf.configure()
    layout = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation=implementation)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=layout)
    prompt = _batch(rank, model.config.vocab_size)[:1, :4]
    with torch.no_grad():  # every rank runs as many forwards: no early stop
        return model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)


@pytest.mark.distributed
def test_moeflow_backend_generates_the_one_process_tokens(saved: dict[str, Path]) -> None:
    import transformers

    path = saved["qwen3_moe"]
    generated = run_distributed(_ep_generate, 2, str(path), "moeflow", timeout_s=300)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for rank, tokens in enumerate(generated):
        prompt = _batch(rank, model.config.vocab_size)[:1, :4]
        expected = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, expected)


def test_chunks_split_every_block_into_near_equal_parts_each_rank_can_compute() -> None:
    from moeflow.hf.pipelined import chunk_matrices, chunk_rows

    matrix = [[5, 0, 2], [1, 7, 3], [4, 4, 0]]
    chunks = chunk_matrices(matrix, 3)
    assert [[sum(c[s][d] for c in chunks) for d in range(3)] for s in range(3)] == matrix
    assert all(max(c[s][d] for c in chunks) - min(c[s][d] for c in chunks) <= 1 for s in range(3) for d in range(3))
    rows = chunk_rows(matrix[1], 3)  # rank 1 sends 1, 7 and 3 rows, laid out by destination
    assert torch.cat(rows).sort().values.tolist() == list(range(11))
    for c, index in enumerate(rows):  # chunk c's rows to each destination are that block's c-th part, in order
        destination = torch.bucketize(index, torch.tensor([1, 8]), right=True)
        assert torch.bincount(destination, minlength=3).tolist() == chunks[c][1]
        assert index.tolist() == sorted(index.tolist())


def test_auto_degree_times_every_candidate_round_robin_and_keeps_the_fewest_chunks_within_the_gain() -> None:
    from moeflow.hf.degree_search import TRIALS, WARMUP, DegreeSearch

    search = DegreeSearch()
    assert search.next(DegreeSearch.key(100, 1)) == (1, False)  # one candidate: nothing to time
    key = DegreeSearch.key(1000, 4)
    seconds = {1: 1.0, 2: 0.97, 4: 0.5}  # 2 within 5 % of 1; 4 much faster
    order = []
    for _ in range(3 * (WARMUP + TRIALS)):
        degree, timed = search.next(key)
        assert timed
        order.append(degree)
        search.record(key, degree, 10.0 if len([d for d in order if d == degree]) <= WARMUP else seconds[degree])
    assert order[:3] == [1, 2, 4] and search.next(key) == (4, False)
    other = DegreeSearch.key(1000, 2)  # a batch only two chunks fill: its own key
    for _ in range(2 * (WARMUP + TRIALS)):
        degree, _ = search.next(other)
        search.record(other, degree, seconds[degree])
    assert search.next(other) == (1, False)  # d=2 inside the gain: the fewer chunks
    waiting = DegreeSearch.key(4000, 4)
    assert search.next(waiting) == (1, True)
    search.record(waiting, 1, 1.0)
    search.built(waiting)  # a graph of d=1 awaits its backward: the key's forwards and recomputes run d=1
    assert search.next(waiting) == (1, False) and search.as_ran(waiting) == 1
    search.reached(waiting)
    assert search.next(waiting) == (2, True)  # the search moves on


def _auto_calls(
    rank: int, world: int, path: str, calls: int, checkpointing: bool = False, forwards: int = 1
) -> dict[str, Any]:
    """``calls`` forwards of a batch that fills chunks, under the default ``pipeline="auto"``; with
    ``checkpointing`` each call ``forwards`` forwards and one backward of their summed losses under
    transformers' activation checkpointing (whose recompute must run the degree its forward ran,
    while the search moves on)."""
    import transformers
    from torch.distributed.tensor import DTensor
    from transformers.distributed import DistributedConfig

    import moeflow.hf
    from moeflow.hf.expert_parallel import searched_degrees

    moeflow.hf.configure(token_exchange="dedup")
    layout = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="moeflow")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=layout)
    ids = _batch(rank, model.config.vocab_size, PIPELINED)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    logits, grads = [], {}
    for _ in range(calls):
        with torch.set_grad_enabled(checkpointing):
            outs = [model(ids, labels=ids) for _ in range(forwards)]
        out = outs[-1]
        if checkpointing:
            model.zero_grad(set_to_none=True)
            sum(o.loss for o in outs).backward()
            grads = {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).numpy()
                     for name, p in model.named_parameters() if p.grad is not None}
        logits.append(out.logits.detach().numpy())
    return {"logits": logits, "chosen": searched_degrees(), "grads": grads}


@pytest.mark.distributed
def test_auto_degree_searches_each_block_and_every_call_gives_the_one_process_logits(
    saved: dict[str, Path],
) -> None:
    from moeflow.hf.degree_search import CANDIDATES, SETTLE_CALLS

    results = run_distributed(_auto_calls, 2, str(saved["qwen3_moe"]), SETTLE_CALLS + 1, timeout_s=300)
    expected = _one_process_logits(saved["qwen3_moe"], 2, PIPELINED)
    for rank, result in enumerate(results):
        for logits in result["logits"]:
            torch.testing.assert_close(torch.from_numpy(logits), expected[rank], rtol=1e-5, atol=1e-5)
        assert result["chosen"] == results[0]["chosen"]  # every rank the same choice
        assert result["chosen"] and all(len(block) == 1 and set(block.values()) <= set(CANDIDATES)
                                        for block in result["chosen"])


@pytest.mark.distributed
@pytest.mark.parametrize("forwards", [1, 2])
def test_auto_degree_under_activation_checkpointing_recomputes_as_the_forward_ran(
    saved: dict[str, Path], transformers_runs: dict, forwards: int
) -> None:
    """One forward a backward, and two (a preference loss's): a forward waiting for its backward keeps
    the key's degree, so that every recompute runs the degree its forward ran."""
    from moeflow.hf.degree_search import SETTLE_CALLS

    ours = run_distributed(_auto_calls, 2, str(saved["qwen3_moe"]), SETTLE_CALLS + 1, True, forwards, timeout_s=300)
    theirs = _transformers_run(transformers_runs, "qwen3_moe", 2, str(saved["qwen3_moe"]),
                               {"tokens": PIPELINED, "checkpointing": True})
    for rank in range(2):
        assert ours[rank]["chosen"] and ours[rank]["grads"].keys() == theirs[rank]["grads"].keys()
        # the blocks' gradients (the recomputed ones); the root module's (final norm, head) add up over the
        # calls in transformers' FSDP2 layout, set_to_none notwithstanding
        layers = {name: grad for name, grad in ours[rank]["grads"].items() if name.startswith("model.layers.")}
        assert any(".experts." in name for name in layers)
        for name, grad in layers.items():  # the last call's: the search's choice
            torch.testing.assert_close(torch.from_numpy(grad) / forwards, torch.from_numpy(theirs[rank]["grads"][name]),
                                       rtol=1e-5, atol=1e-6, msg=name)

"""Which implementation runs each kernel: encode, decode and the ragged grouped GEMM, chosen apart.

The H200 record of 2026-11-26 showed why one backend for all three is wrong: there torch's encode
(0.44 of copy bandwidth) beat Triton's (0.25), ``torch._grouped_mm`` (0.71 of the matmul peak)
beat Triton's grouped GEMM (0.16), and only Triton's decode won (0.17 against 0.10). So
``kernel_backend="auto"`` measures: once per device name and dtype, a micro-benchmark times every
implementation that runs there (forward and backward, at one representative MoE shape,
:data:`PROBE_SHAPE`) and keeps the fastest of each kernel. A :class:`KernelTable` holds the
results, one per model (:func:`share_kernel_table`), so its layers measure once between them.

On a CPU nothing is measured: Triton runs there only under its interpreter (a test tool), and the
grouped GEMM keeps the rule measured on CPUs (:func:`moeflow.kernels.ragged.ragged_mm`). An explicit
``"torch"`` or ``"triton"`` runs that backend's kernels everywhere, as before.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

ENCODE_BACKENDS = ("torch", "gather", "triton")
"""``torch``: ``index_select`` and ``embedding_bag`` (:mod:`moeflow.kernels.slot_gather`); ``gather``: the same
with each bag sum (encode's backward, decode's forward) as a gather of every token's K rows and one
batched product; ``triton``: :mod:`moeflow.kernels.triton_dispatch`."""
GEMM_BACKENDS = ("torch", "grouped_mm", "triton")
"""``torch``: on CPU torch's grouped GEMM where many experts hold rows, else one ``mm`` per expert
with rows (:func:`moeflow.kernels.ragged.ragged_mm`); ``grouped_mm``: ``torch._grouped_mm`` on any device
(the loop where an operand's layout does not suit it); ``triton``: :mod:`moeflow.kernels.triton_gemm`."""

MEASURED, FIXED, HOST = "measured", "fixed", "host"  # how a choice was made


@dataclass(frozen=True)
class KernelChoice:
    """The implementation of each kernel for one device and dtype, and how it was chosen."""

    encode: str
    decode: str
    gemm: str
    source: str = FIXED
    timings_ms: dict[str, float] = field(default_factory=dict, compare=False)  # what a measurement saw

    def as_dict(self) -> dict[str, str]:
        """What ``last_stats`` reports."""
        return {"encode": self.encode, "decode": self.decode, "gemm": self.gemm, "source": self.source}

    @staticmethod
    def uniform(backend: str) -> KernelChoice:
        """One backend's kernels for all three (``kernel_backend="torch"`` or ``"triton"``)."""
        return KernelChoice(backend, backend, backend, FIXED)


@dataclass(frozen=True)
class ProbeShape:
    """The MoE shape the choice is measured at: many experts, 32K rows of a 2K model dimension
    (128 MiB in bf16), each kernel a few hundred microseconds. At 16K rows of 1K (2026-11-27, an
    H200) the samples were too short to rank the backends: decode picked torch's ``embedding_bag``,
    the slowest at the layer's shape."""

    tokens: int = 8192
    model_dim: int = 2048
    hidden_dim: int = 1024
    num_experts: int = 32
    top_k: int = 4
    repeats: int = 5
    queued: int = 4  # steps a sample queues back to back


PROBE_SHAPE = ProbeShape()


class Measurer(Protocol):
    def __call__(self, device: torch.device, dtype: torch.dtype) -> KernelChoice: ...


@dataclass
class KernelTable:
    """The choices of ``kernel_backend="auto"`` per (device name, dtype), each measured on first use
    by ``measure`` (:func:`measure_choice`; tests pass a stand-in)."""

    measure: Measurer | None = None
    choices: dict[tuple[str, str], KernelChoice] = field(default_factory=dict)
    fixed: dict[tuple[str, str], KernelChoice] = field(default_factory=dict)  # (setting, device type): no measure

    def resolve(self, setting: str, device: torch.device, dtype: torch.dtype) -> KernelChoice:
        """The kernels for tensors of ``dtype`` on ``device`` under ``kernel_backend=setting`` (a
        fixed choice made once per setting and device type: every layer call asks)."""
        fixed = self.fixed.get((setting, device.type))
        if fixed is not None:
            return fixed
        from moeflow.kernels import resolve_backend

        backend = resolve_backend(setting, device)  # validates the setting and an explicit triton
        if setting != "auto" or device.type != "cuda":
            fixed = KernelChoice.uniform(backend) if setting != "auto" else KernelChoice(backend, backend, backend,
                                                                                          HOST)
            self.fixed[(setting, device.type)] = fixed
            return fixed
        key = (device_name(device), str(dtype).removeprefix("torch."))
        if key not in self.choices:
            self.choices[key] = (self.measure or measure_choice)(device, dtype)
        return self.choices[key]


def device_name(device: torch.device) -> str:
    """The name choices are cached under: the GPU's model, so that every GPU of one kind shares them."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


class _HasKernelTable(Protocol):
    kernel_table: KernelTable


def share_kernel_table(layers: Iterable[_HasKernelTable]) -> KernelTable:
    """Give ``layers`` (the MoE layers of one model) one table, so the choice is measured once."""
    shared = KernelTable()
    for layer in layers:
        layer.kernel_table = shared
    return shared


def candidates(device: torch.device, dtype: torch.dtype) -> tuple[list[str], list[str]]:
    """The encode/decode backends and the GEMM backends that run on ``device`` in ``dtype``."""
    from moeflow.kernels import triton_installed

    triton = device.type == "cuda" and triton_installed()
    gemms = ["torch"] + (["grouped_mm"] if grouped_mm_works(device, dtype) else []) + (["triton"] if triton else [])
    return (["torch", "gather", "triton"] if triton else ["torch", "gather"]), gemms


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here, in both forms the ragged kernel uses (rows x
    per-expert weights, and the per-expert weight gradient), and agrees with a loop of ``mm``: a
    build may have the op but no kernel for this device, dtype or architecture."""
    if not hasattr(torch, "_grouped_mm") or (device.type == "cuda" and dtype != torch.bfloat16):
        return False  # on CUDA other dtypes run a host loop that waits for the device (seen on an H200)
    generator = torch.Generator().manual_seed(0)
    a_NK = torch.randn(48, 32, generator=generator).to(device, dtype)
    b_LKJ = torch.randn(3, 32, 16, generator=generator).to(device, dtype)
    g_NJ = torch.randn(48, 16, generator=generator).to(device, dtype)
    counts = [5, 0, 43]  # uneven, as routing leaves them, and one expert with no rows
    offs = torch.tensor([5, 5, 48], device=device, dtype=torch.int32)
    try:
        forward = torch._grouped_mm(a_NK, b_LKJ, offs=offs)
        weight = torch._grouped_mm(a_NK.t(), g_NJ, offs=offs)
    except (RuntimeError, TypeError, NotImplementedError, ValueError):
        return False
    expected_fwd = torch.cat([a @ b_LKJ[e] for e, a in zip((0, 2), a_NK.split([5, 43]), strict=True)])
    expected_w = torch.stack([a.t() @ g for a, g in zip(a_NK.split(counts), g_NJ.split(counts), strict=True)])
    tolerance = {"atol": 0.1, "rtol": 0.05} if dtype != torch.float32 else {"atol": 1e-3, "rtol": 1e-3}
    return (torch.allclose(forward.float(), expected_fwd.float(), **tolerance)
            and torch.allclose(weight.float(), expected_w.float(), **tolerance))


def measure_choice(device: torch.device, dtype: torch.dtype, shape: ProbeShape = PROBE_SHAPE) -> KernelChoice:
    """Time every implementation of encode, decode (each forward and backward) and the grouped GEMM
    (rows x weights and the weight gradient) at ``shape`` on ``device`` and keep the fastest of each.

    It runs in a thread of its own: grad mode, inference mode, autocast and saved-tensor hooks are
    thread-local, so a first forward under ``no_grad``, ``inference_mode`` or activation
    checkpointing reaches none of them. A candidate that fails (a kernel that does not compile, a
    probe out of memory) is left out; torch's own always runs."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(_measure, device, dtype, shape).result()


def _measure(device: torch.device, dtype: torch.dtype, shape: ProbeShape) -> KernelChoice:
    from moeflow.timing.measure import device_medians

    dispatch_backends, gemm_backends = candidates(device, dtype)
    steps = _probe_steps(device, dtype, shape)
    fns: dict[str, Callable[[], object]] = {}
    for backend in dispatch_backends:
        fns[f"encode.{backend}"] = steps.encode(backend)
        fns[f"decode.{backend}"] = steps.decode(backend)
    for backend in gemm_backends:
        fns[f"gemm.{backend}"] = steps.gemm(backend)
    medians = device_medians(_queued(_running(fns), shape.queued), device, shape.repeats, warmup=2)

    def fastest(kernel: str, backends: list[str]) -> str:
        return min((b for b in backends if f"{kernel}.{b}" in medians), key=lambda b: medians[f"{kernel}.{b}"])

    timings = {name: round(seconds * 1e3, 4) for name, seconds in medians.items()}
    return KernelChoice(fastest("encode", dispatch_backends), fastest("decode", dispatch_backends),
                        fastest("gemm", gemm_backends), MEASURED, timings)


def _queued(fns: dict[str, Callable[[], object]], steps: int) -> dict[str, Callable[[], object]]:
    """Each step ``steps`` times in a row, as one sample. A sample's CUDA events bracket the device's
    work from idle to done, so one step alone times the device only. Queued back to back, the
    host's launches are timed too, where they take longer than the device's work: a kernel of many
    small launches is slower in a layer than its device time says (2026-11-27, an H200: the
    64-expert step waited a third of its time for the host)."""
    return {name: functools.partial(_repeat, fn, steps) for name, fn in fns.items()}


def _repeat(fn: Callable[[], object], times: int) -> None:
    for _ in range(times):
        fn()


def _running(fns: dict[str, Callable[[], object]]) -> dict[str, Callable[[], object]]:
    """The steps that run once without an error; torch's own must (its error is the caller's)."""
    kept = {}
    for name, fn in fns.items():
        if name.endswith(".torch"):
            fn()
        else:
            try:
                fn()
            except Exception:  # whatever broke, this candidate is left out and torch's runs
                continue
        kept[name] = fn
    return kept


@dataclass(frozen=True)
class _ProbeSteps:
    """The probe's tensors and a step per (kernel, backend)."""

    x_TM: torch.Tensor
    weights_TK: torch.Tensor
    plan: object
    packed_NM: torch.Tensor
    grad_NH: torch.Tensor
    w_EMH: torch.Tensor
    rows: object

    def encode(self, backend: str) -> Callable[[], None]:
        from moeflow.kernels.slot_gather import encode

        def step() -> None:
            x = self.x_TM.detach().requires_grad_()
            buffer = encode(x, self.plan, backend=backend)  # type: ignore[arg-type]
            buffer.backward(buffer)
        return step

    def decode(self, backend: str) -> Callable[[], None]:
        from moeflow.kernels.slot_gather import decode

        def step() -> None:
            rows = self.packed_NM.detach().requires_grad_()
            weights = self.weights_TK.detach().requires_grad_()
            y_TM = decode(rows, weights, self.plan, backend=backend)  # type: ignore[arg-type]
            y_TM.backward(self.x_TM)
        return step

    def gemm(self, backend: str) -> Callable[[], None]:
        from moeflow.kernels.ragged import ragged_mm, ragged_weight_grad

        def step() -> None:
            ragged_mm(self.packed_NM, self.w_EMH, self.rows, backend)  # type: ignore[arg-type]
            ragged_weight_grad(self.packed_NM, self.grad_NH, self.rows, backend)  # type: ignore[arg-type]
        return step


def _probe_steps(device: torch.device, dtype: torch.dtype, shape: ProbeShape) -> _ProbeSteps:
    """Uniform random routing of ``shape.tokens`` tokens, dropless, packed by expert (as the direct
    path lays the rows out, :func:`moeflow.core.slot_map.make_packed_slot_map`); the tensors are drawn on
    the device (drawn on the host, they cost a layer built alone half a second)."""
    from moeflow.core.routing import assign_slots
    from moeflow.core.slot_map import make_packed_slot_map
    from moeflow.kernels.ragged import FilledRows

    generator = torch.Generator().manual_seed(0)
    s = shape
    expert_idx_TK = torch.rand(s.tokens, s.num_experts, generator=generator).topk(s.top_k, dim=1).indices
    generator = torch.Generator(device).manual_seed(0)
    location_TK, counts_E = assign_slots(expert_idx_TK, s.num_experts)
    plan = make_packed_slot_map(expert_idx_TK.to(device), location_TK.to(device), counts_E, int(counts_E.max()))
    rows = FilledRows.counted(torch.arange(int(counts_E.sum())), counts_E)
    def draw(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=generator, device=device) * scale).to(dtype)

    return _ProbeSteps(
        x_TM=draw(s.tokens, s.model_dim), weights_TK=draw(s.tokens, s.top_k).abs(), plan=plan,
        packed_NM=draw(s.tokens * s.top_k, s.model_dim), grad_NH=draw(s.tokens * s.top_k, s.hidden_dim),
        w_EMH=draw(s.num_experts, s.model_dim, s.hidden_dim, scale=0.02), rows=rows,
    )

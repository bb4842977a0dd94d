"""The one door to torch.distributed's collectives, and the one rule for host values.

Every collective moeflow issues goes through this package (a test refuses a torch.distributed
collective called anywhere else), so that two rules hold by construction on every backend:

- **Host values** (counts, timings, agreements, objects) travel on :func:`host_device`: the CPU
  where the group has a CPU backend (gloo, or torch's ``"cpu:gloo,cuda:nccl"``, which runs a gloo
  group beside NCCL), else the current CUDA device. A NCCL-only group never sees a CPU tensor.
- **Point-to-point exchanges** are posted together through ``batch_isend_irecv``
  (:func:`send_and_receive`): separate ``isend``/``irecv`` calls can deadlock on NCCL, where the
  order of posting matters.

The group is always passed in (None: the default group), never read from the environment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

CPU_BACKENDS = ("gloo", "mpi", "ucc")
"""The backends that carry CPU tensors."""
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
"""The reductions moeflow uses, by name."""


def carries_cpu_tensors(backend: str) -> bool:
    """Whether a backend string (``dist.get_backend``: ``"gloo"``, ``"nccl"``, or per device, as
    ``"cpu:gloo,cuda:nccl"``) has a CPU backend."""
    if ":" not in backend:
        return backend.lower() in CPU_BACKENDS
    devices = dict(part.split(":", 1) for part in backend.lower().split(","))
    return devices.get("cpu") in CPU_BACKENDS


def backend_devices(backend: str) -> set[str]:
    """The device types a backend string serves: per device when it names them
    (``"cpu:gloo,cuda:nccl"``), else the backend's registered capability (gloo: CPU and CUDA, NCCL:
    CUDA only)."""
    if ":" in backend:
        return {part.split(":", 1)[0] for part in backend.lower().split(",")}
    capability = dist.Backend.backend_capability.get(backend.lower())
    return set(capability) if capability else {"cpu", "cuda"}


def host_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where host values travel on ``group``: the CPU, unless its backend has no CPU half (NCCL
    alone), then the current CUDA device."""
    if group is None and not dist.is_initialized():
        return torch.device("cpu")
    if carries_cpu_tensors(str(dist.get_backend(group))):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def host_tensor(values: Sequence[float] | Sequence[int], dtype: torch.dtype,
                group: dist.ProcessGroup | None) -> torch.Tensor:
    """``values`` as a tensor on :func:`host_device` of ``group``, ready for a collective."""
    return torch.tensor(list(values), dtype=dtype, device=host_device(group))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str = "sum",
               async_op: bool = False) -> dist.Work | None:
    """``tensor`` reduced in place over ``group`` (``op``: sum, max or min)."""
    return dist.all_reduce(tensor, op=REDUCE_OPS[op], group=group, async_op=async_op)


def flat_sum(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, divisor: int = 1) -> None:
    """Each tensor summed in place over ``group`` (None: left as it is), over ``divisor``, in one
    flat all-reduce (gradients: one collective instead of one per parameter)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if group is not None:
        all_reduce(flat, group)
    flat.div_(divisor)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def reduce_values(values: Sequence[float], group: dist.ProcessGroup | None, op: str = "sum") -> list[float]:
    """Host numbers reduced over ``group`` (float64), on the group's host device."""
    tensor = host_tensor(values, torch.float64, group)
    all_reduce(tensor, group, op)
    return tensor.tolist()


def reduce_values_later(
    values: Sequence[float], group: dist.ProcessGroup | None, op: str = "sum"
) -> Callable[[], list[float]]:
    """Host numbers reduced over ``group`` (float64), issued now and read when the returned function
    is called (statistics: the forward does not wait for them)."""
    tensor = host_tensor(values, torch.float64, group)
    work = all_reduce(tensor, group, op, async_op=True)

    def read() -> list[float]:
        if work is not None:
            work.wait()
        return tensor.tolist()

    return read


def all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None,
               async_op: bool = False) -> dist.Work | None:
    """Every rank's ``tensor`` into ``parts``, one per rank."""
    return dist.all_gather(parts, tensor, group=group, async_op=async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                    async_op: bool = False) -> dist.Work | None:
    """Every rank's ``tensor`` concatenated into ``output`` (rank-major). torch 2.13 names it
    ``all_gather_single`` and warns on the old name, which torch 2.11 alone has."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                        async_op: bool = False) -> dist.Work | None:
    """``tensor`` summed over ``group``, each rank keeping its rank-major block in ``output``
    (``reduce_scatter_single`` where torch has it, as :func:`all_gather_into`)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                      output_splits: Sequence[int] | None = None, input_splits: Sequence[int] | None = None,
                      async_op: bool = False) -> dist.Work | None:
    """torch's all-to-all of one tensor each way (equal splits unless given)."""
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_splits,
                                  input_split_sizes=input_splits, group=group, async_op=async_op)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` reaches this point."""
    dist.barrier(group=group)


def broadcast_objects(values: list[Any], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Picklable ``values`` from global rank ``src`` to every rank, in place."""
    dist.broadcast_object_list(values, src=src, group=group, device=host_device(group))


def all_gather_objects(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``value``, by group rank."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def send_and_receive(sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[torch.Tensor, int]],
                     group: dist.ProcessGroup | None = None) -> list[dist.Work]:
    """Post every send and receive at once (``batch_isend_irecv``); peers are global ranks. Wait
    on the returned requests before reading a received tensor."""
    operations = [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in receives]
    operations += [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in sends]
    return dist.batch_isend_irecv(operations) if operations else []


def send(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None) -> None:
    """A blocking send to global rank ``peer``: for ping-pong timing only, where one side sends while
    the other receives (an exchange posts both ways with :func:`send_and_receive`)."""
    dist.send(tensor, peer, group=group)


def receive(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None) -> None:
    """A blocking receive from global rank ``peer`` into ``tensor`` (ping-pong timing only)."""
    dist.recv(tensor, peer, group=group)

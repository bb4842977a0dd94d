"""``expert_kernel="auto"``: padded ``bmm`` or the ragged kernel, from the slots a call fills.

The padded kernel computes every slot of the (L, W x C, M) buffer a rank's experts receive; the
ragged kernel computes the filled rows only, but gathers them out of the buffer and scatters its
output back in (work over every slot, lighter than a GEMM) and runs one GEMM per expert. Which is
faster depends on the share of slots filled and on the machine: on the 2-core CPU the ragged
kernel lost at 34 % padding (126-129 ms against bmm's 103-117 ms, 16 experts, M 256, H 1024) and
won by 3 % at a shape with less host work per expert; the project's records had it 12-14 % faster on
dropless layers with many experts per rank. So nothing here is a fixed rule: a probe times both
kernels on the layer's own shapes (:mod:`moeflow.parallel.kernel_probe`), and :class:`KernelRates`
turns the three times into the filled share under which the ragged kernel wins.

No torch here: the planner keeps the rates with its plans (and in checkpoints).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

BMM, RAGGED, AUTO = "bmm", "ragged", "auto"


@dataclass(frozen=True)
class KernelRates:
    """Seconds per slot of the padded kernel, the ragged kernel's per slot of the buffer (its
    gathers and zeroing) and per filled row (its GEMMs): a forward, input gradient and weight
    gradients on the slowest rank, measured at full and at half fill."""

    padded_s_per_slot: float
    ragged_s_per_slot: float
    ragged_s_per_row: float

    @classmethod
    def from_times(
        cls, slots: int, padded_s: float, ragged_full_s: float, half_rows: int, ragged_half_s: float
    ) -> KernelRates:
        """The rates of a probe over ``slots`` slots: padded, ragged with every slot filled, and
        ragged with ``half_rows`` of them filled; the fit keeps both ragged rates non-negative."""
        slots = max(slots, 1)  # a rank with no local expert: rates no call of it reads
        per_row = max((ragged_full_s - ragged_half_s) / max(slots - half_rows, 1), 0.0)
        per_slot = max(ragged_full_s / slots - per_row, 0.0)
        return cls(padded_s / slots, per_slot, per_row)

    @property
    def ragged_below(self) -> float:
        """The filled share of the slots under which the ragged kernel is the faster (0: never)."""
        if self.ragged_s_per_row <= 0.0:
            return 1.0 if self.padded_s_per_slot > self.ragged_s_per_slot else 0.0
        return max((self.padded_s_per_slot - self.ragged_s_per_slot) / self.ragged_s_per_row, 0.0)

    def kernel(self, filled: int, slots: int) -> str:
        """The faster kernel for ``filled`` of ``slots`` slots."""
        return RAGGED if slots > 0 and filled < self.ragged_below * slots else BMM

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> KernelRates:
        return cls(**{key: float(value) for key, value in state.items()})

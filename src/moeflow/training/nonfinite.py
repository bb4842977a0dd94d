"""Steps whose loss is not finite: skipped on every worker, counted, and the job stopped when they
keep coming.

The decision needs no collective of its own: the training loss is already summed over the workers
for the log, and one worker's NaN or infinity makes that sum non-finite on every worker, so all
of them skip the same step.
"""

from __future__ import annotations

import math


class NonfiniteSteps:
    """Counts skipped steps; after ``limit`` in a row, stops the run with a message."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.skipped = 0
        self.in_a_row = 0

    def skips(self, step: int, loss_sum: float, grad_norm: float) -> bool:
        """Whether ``step`` is skipped: its loss (summed over the workers) or its global gradient
        norm is not finite. Raises once ``limit`` steps in a row were."""
        if math.isfinite(loss_sum) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return False
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise FloatingPointError(
                f"the loss or the gradient was not finite on some worker for {self.in_a_row} steps in a row "
                f"(steps {step - self.in_a_row + 1} to {step}; each was skipped on every worker): lower --lr, "
                "check the data, use --dtype fp32 or bf16, or allow more with --max-nonfinite-steps"
            )
        return True

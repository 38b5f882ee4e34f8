"""The tolerance a comparison allows: torch.testing's per-dtype defaults unless a scenario sets
its own. Kept free of torch imports: scenario validation reads the table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# torch.testing.assert_close's per-dtype (rtol, atol) defaults, by dtype name (SPEC section 3).
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1.3e-6, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float16": (1e-3, 1e-5),
}


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    @classmethod
    def for_dtype(cls, dtype: Any, rtol: float | None = None, atol: float | None = None):
        name = str(dtype).removeprefix("torch.")
        default_rtol, default_atol = DEFAULT_TOLERANCES.get(name, DEFAULT_TOLERANCES["float32"])
        return cls(default_rtol if rtol is None else rtol, default_atol if atol is None else atol)

    def over(self, envelope: Tolerance) -> Tolerance:
        """A complete tolerance replaces a check's rounding envelope."""
        return self


@dataclass(frozen=True)
class Allowance:
    """What an enveloped check (E1, E2) allows: each tensor's rounding envelope, with the rtol or
    atol a scenario sets in its place. ``ENVELOPE`` sets neither."""

    rtol: float | None = None
    atol: float | None = None

    def over(self, envelope: Tolerance) -> Tolerance:
        return Tolerance(envelope.rtol if self.rtol is None else self.rtol,
                         envelope.atol if self.atol is None else self.atol)


ENVELOPE = Allowance()

"""Loss scaling for float16 training: a static scale, or the dynamic rule of ``torch.cuda.amp.GradScaler``."""

from __future__ import annotations

import math
from typing import Any


class LossScaler:
    """The loss scale and its update rule.

    Multiply the loss (or the gradient fed into backward) by :attr:`scale`; the manager divides the
    reduced gradients by it. ``mode``: None (no scaling: scale 1, no overflow check), "static" (a
    constant scale; an overflowing step is skipped but the scale is kept) or "dynamic": start at
    ``init_scale`` (2**16), multiply by ``backoff_factor`` (0.5) on every overflow, by
    ``growth_factor`` (2) after ``growth_interval`` (2000) consecutive steps without one — the
    defaults and the rule of PyTorch's GradScaler. The attributes may be changed between steps.
    """

    def __init__(self, loss_scale: None | float | str) -> None:
        self.growth_factor = 2.0
        self.backoff_factor = 0.5
        self.growth_interval = 2000
        self.good_steps = 0  # consecutive steps without overflow since the last change of scale
        if loss_scale is None:
            self.mode, self.scale = None, 1.0
        elif isinstance(loss_scale, str):
            if loss_scale != "dynamic":
                raise ValueError(f"loss_scale must be None, a positive float or 'dynamic'; got {loss_scale!r}")
            self.mode, self.scale = "dynamic", 2.0**16
        elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            if not (math.isfinite(loss_scale) and loss_scale > 0):
                raise ValueError(f"loss_scale must be a finite number > 0; got {loss_scale!r}")
            self.mode, self.scale = "static", float(loss_scale)
        else:
            raise TypeError(f"loss_scale must be None, a positive float or 'dynamic'; got {type(loss_scale).__name__}")

    @property
    def enabled(self) -> bool:
        """Whether gradients are checked for overflow (a scale was set)."""
        return self.mode is not None

    def update(self, overflow: bool) -> None:
        """Apply the rule after a step: ``overflow`` means the step was skipped."""
        if self.mode != "dynamic":
            return
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved dynamic scale (only when both this scaler and the saved one are dynamic)."""
        if self.mode == "dynamic" and state.get("mode") == "dynamic":
            self.scale = float(state["scale"])
            self.good_steps = int(state["good_steps"])

    def __repr__(self) -> str:
        return f"LossScaler(mode={self.mode!r}, scale={self.scale:g}, good_steps={self.good_steps})"

"""The one knob, turned into a turn's plan: a sparsity (the share of the document's K/V bytes a step skips, index
bytes and follow rows counted inside the budget) becomes the method's StepPlan here, and only here. The session's
turns and the app's preview of a plan both call `turn_plan`, so the preview shows the plan the turn runs.

    sparsity s --> budget 1 - s --> the method's plan at that budget, less the follow rows' reserve
                                    (Method.plan: its key fractions, then its thresholds, top-K or head counts)

Full attention is a method whose plan reads every key whatever the sparsity (engine.methods.full)."""

from __future__ import annotations

from engine.attention.follow import FollowSettings
from engine.attention.method import Method, StepPlan, Tensors
from engine.model.catalog import MAX_SPARSITY


def check_sparsity(sparsity: float) -> float:
    """A sparsity a turn can be asked for: in [0, MAX_SPARSITY]; ValueError otherwise, in a user's words."""
    try:
        value = float(sparsity)
    except (TypeError, ValueError):
        raise ValueError(f"sparsity must be a number between 0 and {MAX_SPARSITY}, got {sparsity!r}") from None
    if not 0.0 <= value <= MAX_SPARSITY:
        raise ValueError(f"sparsity must be between 0 and {MAX_SPARSITY}, got {value}")
    return value


def follows(method: Method, follow: FollowSettings | None) -> bool:
    """Whether `method`'s steps read the follow rows (engine.attention.follow): a sparse method's, where they are on."""
    return follow is not None and follow.on and method.sparse and method.follows


def turn_plan(method: Method, calibration: Tensors, sparsity: float, follow: FollowSettings | None,
              num_keys: int) -> StepPlan:
    """The plan of a turn of `method` at `sparsity` over a context of `num_keys` fixed K/V rows per global layer,
    from the method's calibration of that context; the follow rows' share of the budget (their reserve) is left
    out of what the method's own selection may read."""
    reserve = follow.reserve(num_keys) if follows(method, follow) else (0.0, 0.0)
    return method.plan(calibration, 1.0 - check_sparsity(sparsity), reserve)

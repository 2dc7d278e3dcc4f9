"""The torch collector: record a model's activations, gradients, parameters and updates into a trainhist file.

This is the only part of trainhist that imports torch.
"""

from __future__ import annotations

from .collector import Collector, StepTruth
from .plan import STREAMS, Plan, PlannedSite

__all__ = ["Collector", "StepTruth", "Plan", "PlannedSite", "STREAMS"]

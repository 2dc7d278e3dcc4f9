"""Test-only shim until the core writer names the 'unknown' applied code (see the collector's report)."""

from trainhist import model

if not hasattr(model.Applied, "UNKNOWN"):
    model.Applied.UNKNOWN = 0

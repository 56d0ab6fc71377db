"""Force lean passes (what a tight memory budget chooses) in a test."""

from __future__ import annotations

import pytest

from ggnchunk._engine import GGNComputation


def force_lean(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every computation in the test runs lean: no per-forward caches of the rules.

    Args:
        monkeypatch: The test's monkeypatch fixture (undone after the test).
    """
    forward = GGNComputation.forward

    def lean_forward(self: GGNComputation):
        output = forward(self)
        self.set_lean(True)
        return output

    monkeypatch.setattr(GGNComputation, "forward", lean_forward)

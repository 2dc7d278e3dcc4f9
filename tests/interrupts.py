"""Deterministic interrupts: an exception raised at the N-th point of a piece of code where CPython can run a signal
handler, so that a test can interrupt it everywhere, one point at a time, as Ctrl-C or SIGTERM could."""

from __future__ import annotations

import dis
import os
import sys
from collections.abc import Callable
from types import FrameType

import trainhist

#: instructions after which CPython runs pending signal handlers (the "eval breaker"): calls and backward jumps;
#: a function's entry is one more such point
_BREAKERS = {dis.opmap[name] for name in ("CALL", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW",
                                          "CALL_FUNCTION_EX", "JUMP_BACKWARD", "JUMP_ABSOLUTE") if name in dis.opmap}
_PACKAGE = os.path.dirname(trainhist.__file__)


class Interrupter:
    """While active (``with``), call ``action`` at the ``n``-th point where a signal handler could run in the code
    of the trainhist package (1-based; ``n`` past the last point: never), then stop tracing; ``function``: in the
    functions of that name only. ``points`` counts the points passed, ``where`` names the one acted at."""

    def __init__(self, n: int, action: Callable[[], None], function: str | None = None) -> None:
        self.n, self.action, self.function = n, action, function
        self.points = 0
        self.where: str | None = None
        self._last: dict[int, int] = {}  # the instruction each traced frame ran last

    def __enter__(self) -> "Interrupter":
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

    def _call(self, frame: FrameType, event: str, arg: object):  # noqa: ANN202 -- sys.settrace's protocol
        if (self.where is not None or not frame.f_code.co_filename.startswith(_PACKAGE)
                or self.function not in (None, frame.f_code.co_name)):
            return None
        frame.f_trace_opcodes = True
        self._point(frame)  # (a function's entry)
        return self._local

    def _local(self, frame: FrameType, event: str, arg: object):  # noqa: ANN202
        if event == "opcode" and self.where is None:
            last = self._last.get(id(frame))
            self._last[id(frame)] = frame.f_code.co_code[frame.f_lasti]
            if last in _BREAKERS:
                self._point(frame)
        elif event == "return":
            self._last.pop(id(frame), None)
        return self._local

    def _point(self, frame: FrameType) -> None:
        self.points += 1
        if self.points == self.n:
            self.where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
            sys.settrace(None)
            frame.f_trace = None
            self.action()


def keyboard_interrupt() -> None:
    """The action of Ctrl-C."""
    raise KeyboardInterrupt

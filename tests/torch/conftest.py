"""Run the Triton kernels (the collector's GPU reduction) on CPU tensors in Triton's interpreter, where Triton is
installed: the variable must be set before the kernels are first imported. tests/ is importable (interrupts.py)."""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (tests/: interrupts.py)

"""Run the Triton kernels (the collector's GPU reduction) on CPU tensors in Triton's interpreter, where Triton is
installed: the variable must be set before the kernels are first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

"""Two CPU ranks (gloo) running DDP: each writes its own shard file; replicated parameters agree across ranks.

The ranks are plain subprocesses (env:// rendezvous on a free port), so nothing is pickled.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np

import trainhist

WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from trainhist.torch import Collector
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    col = Collector(model, sys.argv[1], every=1, sketch_every=1)
    col.attach(optimizer=opt)
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    for step in range(3):
        with col.step(step):
            model(torch.randn(5, 6, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    col.close()
    dist.destroy_process_group()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_ranks_write_shard_files(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "ddp.thist")],
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    h = [trainhist.open(tmp_path / f"ddp.rank{r}.thist") for r in range(2)]
    for r in range(2):
        (w,) = h[r].writers
        assert (w["rank"], w["world_size"]) == (r, 2)
        # names are the user's (no "module." prefix from the DDP wrapper)
        assert {s.path for s in h[r].sites if s.stream == "param"} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for s in h[0].sites:
        if s.stream.startswith("param"):
            assert s.sharing == "replica", s
            a, b = (x.spine(s.path, s.stream) for x in h)
            for col in ("count", "nan", "zero", "min", "max", "sum", "sumsq"):
                np.testing.assert_array_equal(a.columns[col], b.columns[col], err_msg=f"{s.key} {col}")
            ka, kb = (x.sketch(s.path, s.stream) for x in h)
            np.testing.assert_array_equal(ka.pos, kb.pos)
        elif s.stream == "activation":
            assert s.sharing == "shard"
    a, b = (x.spine("0", "activation") for x in h)
    assert not np.array_equal(a.columns["sum"], b.columns["sum"])  # different data per rank

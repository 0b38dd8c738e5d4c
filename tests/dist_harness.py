"""Running a function on several ranks of a gloo process group on the CPU, for the tests.

:func:`spawn` starts one process per rank (``torch.multiprocessing``, start method "spawn"), each
of which joins a gloo process group (with a timeout, so that a rank waiting on a failed one raises)
and runs ``fn(rank, world, *args)``. If any rank raises, the others are terminated and
:func:`spawn` raises with that rank's traceback; if they do not all finish within ``timeout``
seconds, it kills them and raises too. Nothing hangs.

Children import this module before anything imports Triton: on a machine without a GPU it sets
``TRITON_INTERPRET=1`` first, so the Triton kernels run through the interpreter there as well
(with tests/interpreter_speedup.py's changes, as in the session's process).
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# Both limits only catch a hang (a rank that raises ends the others at once): on a loaded machine
# a rank may wait long for a slower one, and that is no failure.
GROUP_TIMEOUT_S = 900.0


def _entry(rank, fn, world, init_file, group_timeout_s, args):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if os.environ.get("TRITON_INTERPRET") == "1":
        import interpreter_speedup  # (tests/: on the children's path too)

        interpreter_speedup.install()  # as tests/conftest.py does in the session's process
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():  # fn may have left the group itself
            dist.destroy_process_group()
    # A rank that finished leaves without the interpreter's and C++ static teardown: threads the
    # gloo backend started for DDP / FSDP can still be joinable then, and std::thread's destructor
    # aborts the process ("terminate called without an active exception"; about 1 run in 3 of
    # test_ring_module_under_ddp_and_fsdp), failing a rank whose work had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, *args, timeout: float = 1800.0, group_timeout_s: float = GROUP_TIMEOUT_S):
    """Runs ``fn(rank, world, *args)`` on ``world`` ranks (``fn`` and ``args`` picklable; ``fn`` a
    module-level function). Raises if a rank raises or if they take longer than ``timeout``."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(fn, world, init_file, group_timeout_s, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):  # raises ProcessRaisedException / ProcessExitedException
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s")
        finally:
            for proc in ctx.processes:  # only the processes started here
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)

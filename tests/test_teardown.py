"""A finished run's process groups are never destroyed from Python code that happens to drop the last
reference (a DDP reducer freed with an exception's frames): gloo's destructor joins its threads holding
the GIL, which deadlocks with a thread still releasing its last work (seen hanging a preempted run)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_a_reducer_freed_after_the_groups_are_destroyed_does_not_destroy_them() -> None:
    script = textwrap.dedent(
        """
        import gc, os
        import torch
        import torch.distributed as dist
        from dtlab.parallel import dist as dtdist
        from dtlab.runtime import status

        status.ENDS_WITHOUT_TEARDOWN = True  # as python -m dtlab sets it

        def threads():
            return len(os.listdir(f"/proc/{os.getpid()}/task"))

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        before = threads()
        dist.init_process_group("gloo", rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        model(torch.ones(2, 4)).sum().backward()
        running = threads()
        dtdist.destroy_distributed()
        del model
        gc.collect()
        print(before, running, threads(), len(getattr(dtdist, "_RETIRED_GROUPS", [])))
        """
    )
    port = str(29500 + os.getpid() % 2000)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PORT": port},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, running, after, retired = map(int, proc.stdout.split())
    assert running > before  # gloo's threads exist while the group lives
    # The reducer held the last reference: the group's threads are still there, not joined from here.
    assert after == running and retired >= 1, (before, running, after, retired)

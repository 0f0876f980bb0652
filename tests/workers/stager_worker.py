"""Run under torchrun: stage an FSDP model's async save and check what the staging thread made of it.

argv[1]: a run directory; argv[2]: train.device (cpu, or cuda: one GPU per rank, NCCL).

Every staged tensor equals the live one and is the stager's own CPU buffer (a staged DTensor keeps the
live spec around it, never a copy on the mesh's device); the stager copied on this rank's device and
stream; on CUDA nothing was allocated on another rank's GPU. Then a real async save is loaded back.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dtlab.checkpoint.manager import Checkpointer
from dtlab.checkpoint.staging import _leaves, _local
from dtlab.checkpoint.state import ModelState, OptimizerState, split_tensors
from dtlab.config import load_config
from dtlab.models import build_model
from dtlab.parallel import destroy_distributed, init_distributed, parallelize
from dtlab.runtime.status import leave_worker
from dtlab.train.optim import build_optimizer

run_dir, device = Path(sys.argv[1]), sys.argv[2]
overrides = [
    "model.preset=debug", "data.seq_len=16", "parallel.strategy=fsdp", f"train.device={device}",
    "checkpoint.async=true", f"run.dir={run_dir}",
]  # fmt: skip
cfg = load_config(overrides=overrides)
d = init_distributed(cfg)
pm = parallelize(build_model(cfg.model), cfg, d)
optimizer = build_optimizer(pm.module, cfg.train)
tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), device=d.device)
F.cross_entropy(pm.module(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
optimizer.step()
parts = {"model": ModelState(pm.module), "optim": OptimizerState(pm.module, optimizer)}
ckpt = Checkpointer(cfg, run_dir, d)
stager = ckpt.stager
assert stager is not None and stager.device == d.device, (stager, d.device)

if d.device.type == "cuda":
    # The tensors to stage are still being written when the save is asked for: a long kernel, then an
    # in-place update, both queued on the training thread's stream. A copy that does not wait for
    # them, or a wait on another device's work, stages the old values.
    torch.cuda._sleep(2_000_000_000)
    with torch.no_grad():
        for p in pm.module.parameters():
            _local(p).add_(1.0)
tensors, _ = split_tensors({k: v.state_dict() for k, v in parts.items()})
staged = stager.stage(tensors).result()

live_leaves = dict(_leaves(tensors))
staged_leaves = dict(_leaves(staged))
assert live_leaves.keys() == staged_leaves.keys()
dtensors = 0
for path, live in live_leaves.items():
    out = staged_leaves[path]
    buffer = stager._buffers[path]
    if isinstance(live, DTensor):
        dtensors += 1
        assert isinstance(out, DTensor), path
        # The buffer itself, under the live spec: not a view, not a copy on the mesh's device.
        assert out._local_tensor is buffer, (path, out._local_tensor.device)
        assert out._spec == live._spec, path
    else:
        assert out is buffer, path
    assert buffer.device.type == "cpu", (path, buffer.device)
    assert torch.equal(buffer, _local(live).cpu()), f"rank {d.rank}: {path} staged stale values"
assert dtensors > 0, "FSDP made no DTensor: nothing checked"

want_stream = stager.stream if d.device.type == "cuda" else None
assert stager.used == (d.device, want_stream), (stager.used, d.device)


def nothing_on_other_gpus(when: str) -> None:
    """No memory, and no CUDA context, of this process on a GPU that is not this rank's."""
    if d.device.type != "cuda":
        return
    for other in range(torch.cuda.device_count()):
        if other != d.device.index:
            used = torch.cuda.memory_reserved(other)
            assert used == 0, f"rank {d.rank} {when}: {used} bytes allocated on cuda:{other}"
            context = torch._C._cuda_hasPrimaryContext(other)  # type: ignore[attr-defined]
            assert not context, f"rank {d.rank} {when}: a CUDA context on cuda:{other}"


nothing_on_other_gpus("after staging")

# A real async save of this layout, then loaded back over changed weights.
saved = {k: v.full_tensor().cpu() for k, v in pm.module.state_dict().items()}
ckpt.save(1, parts)
ckpt.staged()
with torch.no_grad():
    for p in pm.module.parameters():
        _local(p).mul_(-1.0)
path = ckpt.latest()  # every rank, once rank 0 committed it
assert path is not None and path.name == "step-00000001", path
ckpt.load(path, parts)
for k, v in pm.module.state_dict().items():
    assert torch.equal(v.full_tensor().cpu(), saved[k]), f"{k} did not load back as saved"
nothing_on_other_gpus("after an async save and its load")
ckpt.close()
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker

"""Run under torchrun: stage an FSDP model's async save and check what the staging thread made of it.

argv[1]: a run directory; argv[2]: train.device (cpu, or cuda: one GPU per rank, NCCL); argv[3]:
parallel.strategy (fsdp, or ddp: every tensor replicated).

Each rank stages only what it writes: its own shards, and its share of the replicated tensors (every
one staged by exactly one rank, so the ranks' buffers add up to one copy of the state, not one each).

Every staged tensor equals the live one and is the stager's own CPU buffer (a staged DTensor keeps the
live spec around it, never a copy on the mesh's device); the stager copied on this rank's device and
stream; on CUDA nothing was allocated on another rank's GPU. Then a real async save is loaded back.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dtlab.analysis.model import plan_step
from dtlab.checkpoint.manager import Checkpointer
from dtlab.checkpoint.staging import _leaves, _local
from dtlab.checkpoint.state import ModelState, OptimizerState, split_tensors
from dtlab.config import load_config
from dtlab.models import build_model
from dtlab.parallel import destroy_distributed, init_distributed, parallelize
from dtlab.runtime.status import leave_worker
from dtlab.train.optim import build_optimizer

run_dir, device, strategy = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
overrides = [
    "model.preset=debug", "data.seq_len=16", f"parallel.strategy={strategy}", f"train.device={device}",
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
assert staged_leaves.keys() <= live_leaves.keys()
dtensors = 0
for path, live in live_leaves.items():
    if isinstance(live, DTensor):  # a shard of its own (FSDP): staged here
        assert path in staged_leaves, f"rank {d.rank}: its shard {path} was not staged"
    if path not in staged_leaves:
        continue
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
assert (dtensors > 0) == (strategy == "fsdp"), f"{strategy} made {dtensors} DTensors"
# Every replicated tensor staged by one rank: the ranks' pinned bytes add up to one copy of them.
plain = {p: t for p, t in live_leaves.items() if not isinstance(t, DTensor)}
copies = torch.zeros(len(plain))
for i, path in enumerate(sorted(plain)):
    copies[i] = float(path in staged_leaves)
dist.all_reduce(copies)
assert torch.equal(copies, torch.ones(len(plain))), f"staged {copies.tolist()} times"
one_copy = sum(t.numel() * t.element_size() for t in plain.values())
mine = torch.tensor([float(sum(stager._buffers[p].nbytes for p in plain if p in staged_leaves))])
dist.all_reduce(mine)
assert int(mine.item()) == one_copy, (int(mine.item()), one_copy)
if strategy == "ddp":  # the share of each rank: about half each, the whole state once
    assert stager.staged_bytes() < 0.75 * one_copy, (stager.staged_bytes(), one_copy)
# The plan's staged host bytes per rank: the parameters and optimizer state each rank stages (not
# the optimizer's step counters); the ranks' largest tensors decide how evenly they share.
planned = plan_step(cfg, d.world_size).staging_bytes
staged = torch.tensor([float(stager.staged_bytes())])
dist.all_reduce(staged)
assert abs(staged.item() - planned * d.world_size) <= 0.01 * planned * d.world_size, (
    staged.item(), planned * d.world_size,
)  # fmt: skip
assert abs(stager.staged_bytes() - planned) <= 0.1 * planned, (stager.staged_bytes(), planned)

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


# A real async save of this layout, then loaded back over changed weights and optimizer state.
def whole(v: torch.Tensor) -> torch.Tensor:
    return (v.full_tensor() if isinstance(v, DTensor) else v).cpu()


saved = {k: whole(v) for k, v in pm.module.state_dict().items()}
saved_optim = {p: whole(t).clone() for p, t in _leaves(tensors["optim"])}
ckpt.save(1, parts)
ckpt.staged()
with torch.no_grad():
    for p in pm.module.parameters():
        _local(p).mul_(-1.0)
        for t in optimizer.state[p].values():
            if isinstance(t, torch.Tensor):
                _local(t).add_(1.0)
path = ckpt.latest()  # every rank, once rank 0 committed it
assert path is not None and path.name == "step-00000001", path
ckpt.load(path, parts)
for k, v in pm.module.state_dict().items():
    assert torch.equal(whole(v), saved[k]), f"{k} did not load back as saved"
loaded, _ = split_tensors({"optim": parts["optim"].state_dict()})
for p, t in _leaves(loaded["optim"]):
    assert torch.equal(whole(t), saved_optim[p]), f"optimizer {p} did not load back as saved"
nothing_on_other_gpus("after an async save and its load")
ckpt.close()
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker

"""Run under torchrun on 2 gloo processes: eager updates (``parallel.diloco.eager``) over two real
replicas against the algorithm written out for both. argv[1:]: H, fragments, delay. Each replica's
inner steps differ (they depend on its rank), so the replicas' pseudo-gradients, the mean and each
one's share of it differ; every rank checks its own weights against the written-out replica's and
exits non-zero on a mismatch."""

import sys

import torch
import torch.distributed as dist
from torch import nn

from dtlab.config import DiLoCoOptions
from dtlab.train.diloco import DiLoCo, fragment_of

H, FRAGMENTS, DELAY = (int(x) for x in sys.argv[1:4])
LR, MU, STEPS = 0.7, 0.9, 3 * H + 2


class Toy(nn.Module):
    """Parameters named like the model's: an embedding, four blocks, an output."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tok_embeddings = nn.Parameter(torch.randn(3, 2, generator=g))
        self.layers = nn.ParameterDict(
            {str(i): nn.Parameter(torch.randn(5, generator=g)) for i in range(4)}
        )
        self.output = nn.Parameter(torch.randn(2, 3, generator=g))


def inner(model: nn.Module, step: int, replica: int) -> None:
    """A deterministic stand-in for replica ``replica``'s inner optimizer step."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            x = torch.arange(p.numel(), dtype=torch.float32) + step + 3 * replica
            p.sub_(0.01 * (step + i + replica) * torch.cos(x).view_as(p))


def reference(world: int) -> list[list[torch.Tensor]]:
    """Both replicas written out: at a send each jumps to θ_g minus the outer step on its estimate
    (its Δ / n plus the others' share of the fragment's last mean, the momentum as it stands); at
    the landing the true step, the others' share kept, θ ← θ_g + (θ_now - θ_at_estimate)."""
    models = [Toy() for _ in range(world)]
    names = [n for n, _ in models[0].named_parameters()]
    params = [list(m.parameters()) for m in models]
    frag = [fragment_of(n, 4, FRAGMENTS) for n in names]
    glob = [p.detach().clone() for p in params[0]]
    buf: list[torch.Tensor | None] = [None] * len(glob)
    others: list[list[torch.Tensor]] = [[torch.zeros_like(g) for g in glob] for _ in range(world)]
    offsets = [((f + 1) * H // FRAGMENTS) % H for f in range(FRAGMENTS)]
    flight: dict[int, tuple[int, list[list[torch.Tensor]], list[list[torch.Tensor]]]] = {}

    def land(f: int) -> None:
        _, deltas, est = flight.pop(f)
        for i in (i for i in range(len(glob)) if frag[i] == f):
            mean = sum(deltas[r][i] for r in range(world)) / world
            held = buf[i]
            buf[i] = mean.clone() if held is None else MU * held + mean
            glob[i] = glob[i] - LR * (mean + MU * buf[i])
            for r in range(world):
                others[r][i] = mean - deltas[r][i] / world
                params[r][i].copy_(glob[i] + (params[r][i] - est[r][i]))

    with torch.no_grad():
        for step in range(1, STEPS + 1):
            for r, m in enumerate(models):
                inner(m, step, r)
            for f in [f for f, (due, _, _) in flight.items() if due == step]:
                land(f)
            for f in range(FRAGMENTS):
                if step % H != offsets[f]:
                    continue
                deltas = [[glob[i] - p for i, p in enumerate(ps)] for ps in params]
                for r in range(world):
                    for i in (i for i in range(len(glob)) if frag[i] == f):
                        g = deltas[r][i] / world + others[r][i]
                        b = g.clone() if buf[i] is None else MU * buf[i] + g
                        params[r][i].copy_(glob[i] - LR * (g + MU * b))
                est = [[p.clone() for p in ps] for ps in params]
                flight[f] = (step + DELAY, deltas, est)
                if DELAY == 0:
                    land(f)
    return [[p.detach() for p in ps] for ps in params]


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = Toy()
opts = DiLoCoOptions(
    inner_steps=H, fragments=FRAGMENTS, delay=DELAY, outer_lr=LR, outer_momentum=MU, eager=True
)
diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), opts, 4, group=dist.group.WORLD)
for step in range(1, STEPS + 1):
    inner(model, step, rank)
    diloco.after_step(step)
want = reference(world)[rank]
for (name, got), ref in zip(model.named_parameters(), want, strict=True):
    torch.testing.assert_close(
        got.detach(), ref, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
    )
for sync in diloco.pending:  # the last sends, still in flight
    sync.wait()
dist.destroy_process_group()

"""The two-rank DDP tutorial ddp-smoke grows out of (DESIGN.md), as the baseline for timing.

Run: torchrun --standalone --nproc-per-node=2 bench/tutorial.py
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(17)
    model = nn.Linear(2, 1)
    ddp = DistributedDataParallel(model)
    data = TensorDataset(torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]),
                         torch.tensor([[0.0], [2.0], [4.0], [6.0]]))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    x, y = next(iter(DataLoader(data, batch_size=2, sampler=sampler)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loss = F.mse_loss(ddp(x), y)
    loss.backward()
    optimizer.step()
    line = (f"rank={rank} local_rank={rank} world_size={world} samples={list(sampler)} "
            f"loss={loss.item():.4f} weight={model.weight[0, 0].item():.4f}")
    lines = [None] * world
    dist.gather_object(line, lines if rank == 0 else None, dst=0)
    if rank == 0:
        print("\n".join(lines))
        print("ddp_step_complete=True")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

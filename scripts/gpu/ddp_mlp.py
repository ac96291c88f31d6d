"""PyTorch DDP baseline for `train`: the same MLP (features -> hidden -> classes, ReLU), the same
global batch split over ranks, SGD with momentum, the same step count, on NCCL.
Run: torchrun --standalone --nproc-per-node N scripts/gpu/ddp_mlp.py [--steps 200] ...
Rank 0 prints `ddp: world W steps S steps/s X (steady Y)`.
"""
import argparse
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(a.features, a.hidden), torch.nn.ReLU(), torch.nn.Linear(a.hidden, a.classes)
    ).to(dev)
    ddp = DDP(model, device_ids=[local])
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr, momentum=a.momentum)
    centers = torch.randn(a.classes, a.features, device=dev, generator=None)
    dist.broadcast(centers, 0)
    n = a.batch_size // world
    g = torch.Generator(device=dev)
    stamps = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(a.steps):
        g.manual_seed(step * world + rank)
        labels = torch.randint(0, a.classes, (n,), device=dev, generator=g)
        x = centers[labels] + torch.randn(n, a.features, device=dev, generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # The loss every rank reports (as `train` does): all-reduced mean, read on the host.
        l = loss.detach().clone()
        dist.all_reduce(l)
        l = (l / world).item()
        stamps.append(time.perf_counter())
    total = stamps[-1] - t0
    steady = (stamps[-1] - stamps[9]) / (len(stamps) - 10) if len(stamps) > 20 else total / a.steps
    if rank == 0:
        print(f"ddp: world {world} steps {a.steps} steps/s {a.steps / total:.2f} (steady {1 / steady:.2f}) final loss {l:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

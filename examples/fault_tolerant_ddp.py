"""A plain DDP training script made fault tolerant with elastic-train.

Lines marked `# +` are the additions; the rest is an ordinary torchrun-style DDP script.
Run it with
    elastic-train --nproc-per-node 2 --snapshot-dir /tmp/run examples/fault_tolerant_ddp.py
(or with torchrun, or plain `python`). Kill a worker: it resumes from the last snapshot and
every sample of an epoch is still trained exactly once.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import elastic_trainer as et  # +

ctx = et.init_worker()  # + instead of dist.init_process_group(): gloo/NCCL, timeouts, JSON logs
torch.manual_seed(0)
dataset = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
model = DDP(torch.nn.Linear(16, 4).to(ctx.device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
sampler = et.ElasticSampler(dataset, seed=0, global_batch_size=64)  # + was DistributedSampler
loader = DataLoader(dataset, batch_size=sampler.micro_batch_size, sampler=sampler)
session = et.TrainingSession({"model": model, "optimizer": optimizer}, sampler)  # + restores

num_epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for epoch in session.epochs(num_epochs):  # + was range(num_epochs) + sampler.set_epoch
    for x, y in loader:
        x, y = x.to(ctx.device), y.to(ctx.device)
        with session.accumulate(model):  # + DDP no_sync on all but the last micro-batch
            loss = F.cross_entropy(model(x), y)
            session.scale_loss(loss, len(x)).backward()  # + mean over the global batch
        if session.step_ready:  # +
            optimizer.step()
            optimizer.zero_grad()
            session.step_done()  # + cursor, progress, periodic snapshot, stop check
            if session.should_stop:  # + coordinated stop (preemption)
                break
session.finish()  # + final snapshot; exit code the supervisor understands

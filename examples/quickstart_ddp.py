"""hvd_compress as a PyTorch DDP communication hook (torch alone, no Horovod).

torchrun --nproc_per_node 2 examples/quickstart_ddp.py
"""

import torch
import torch.distributed as dist

import hvd_compress
import hvd_compress.ddp
from toy_task import small_model, train

dist.init_process_group("gloo")  # "nccl" on GPUs
model = torch.nn.parallel.DistributedDataParallel(small_model())
state = hvd_compress.ddp.register(model, hvd_compress.PowerSGD(rank=4))
loss = train(model, torch.optim.SGD(model.parameters(), lr=0.1))
if dist.get_rank() == 0:
    print(f"loss {loss:.3f}; per step: {state.compressor.traffic.summary()}")
dist.barrier()  # every rank done before the group is torn down
dist.destroy_process_group()
# DDP holds its process group: released here, the group's Gloo threads stop now and not during
# interpreter exit, where one can abort the process (DEVELOPERS.md).
del model, state

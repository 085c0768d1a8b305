"""hvd_compress on FSDP2's HSDP: the replicate (inter-node) all-reduce compressed, the shard
group's reduce-scatter left exact (torch alone, no Horovod). Ranks form a 2 x (world / 2) mesh.

    torchrun --nproc_per_node 4 examples/quickstart_fsdp.py
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hvd_compress
import hvd_compress.fsdp
from toy_task import small_model, train

dist.init_process_group("gloo")  # "nccl", and "cuda" below, on GPUs
nodes = 2
mesh = init_device_mesh("cpu", (nodes, dist.get_world_size() // nodes), mesh_dim_names=("replicate", "shard"))
model = small_model()
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
state = hvd_compress.fsdp.register(model, hvd_compress.PowerSGD(rank=4))  # the added line
loss = train(model, torch.optim.SGD(model.parameters(), lr=0.1))
if dist.get_rank() == 0:
    print(f"loss {loss:.3f}; per step: {state.compressor.traffic.summary()}")
dist.barrier()  # every rank done before the group is torn down
dist.destroy_process_group()

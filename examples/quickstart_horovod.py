"""hvd_compress through Horovod: stock hvd.DistributedOptimizer, or with --wrapper
hvd_compress.DistributedOptimizer (every round overlapped with backward).

    horovodrun -np 2 python examples/quickstart_horovod.py [--wrapper]
"""

import sys

import horovod.torch as hvd
import torch

import hvd_compress
from toy_task import small_model, train

hvd.init()
model = small_model()
compression = hvd_compress.PowerSGD(rank=4)  # as hvd.Compression.fp16
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if "--wrapper" in sys.argv:
    optimizer = hvd_compress.DistributedOptimizer(optimizer, model.named_parameters(), compression)
else:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
loss = train(model, optimizer)
if hvd.rank() == 0:
    print(f"loss {loss:.3f}; last step: {compression.metrics()}")

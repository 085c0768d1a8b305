"""DiLoCo with compressed pseudo-gradients: 10 local steps, then an outer step whose
pseudo-gradients travel through QSGD (torch alone; under horovodrun, hvd.init() instead).

    torchrun --nproc_per_node 2 examples/quickstart_diloco.py
"""

import torch
import torch.distributed as dist

import hvd_compress
from toy_task import small_model, train

dist.init_process_group("gloo")
model = small_model(seed=dist.get_rank())  # the first step starts every replica from rank 0's
inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
optimizer = hvd_compress.DiLoCo(inner, model.named_parameters(), hvd_compress.QSGD(bits=4), inner_steps=10)
loss = train(model, optimizer, steps=40)  # every 10th step() is also the outer step
if dist.get_rank() == 0:
    print(f"loss {loss:.3f}; per outer step: {optimizer.compression.traffic.summary()}")
dist.barrier()  # every rank done before the group is torn down
dist.destroy_process_group()

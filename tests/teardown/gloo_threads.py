"""Run by tests/test_ddp.py under ``torchrun --nproc_per_node 2``: with hvd_compress's torch
integrations bound to the default group (the DDP hook, and DiLoCo over L-GreCo, whose decision
service talks to the other rank outside the rounds), ``destroy_process_group`` stops Gloo's
worker threads. A thread left running into interpreter shutdown aborts the process when it
drops a finished collective's tensors (torch 2.13: "terminate called without an active
exception"; DEVELOPERS.md). hvd_compress is imported before ``init_process_group``, as in the
README's examples."""

import gc
import os

import torch
import torch.distributed as dist

import hvd_compress
import hvd_compress.ddp
from toy_task import small_model, train  # examples/: the README's examples' model and loop

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # the names torch gives them


def gloo_threads():
    tasks = f"/proc/{os.getpid()}/task"
    names = [open(f"{tasks}/{task}/comm").read().strip() for task in os.listdir(tasks)]
    return [name for name in names if name in GLOO_THREADS]


dist.init_process_group("gloo")
assert gloo_threads(), "no Gloo worker threads to watch: has torch renamed them?"
ddp = torch.nn.parallel.DistributedDataParallel(small_model())
state = hvd_compress.ddp.register(ddp, hvd_compress.PowerSGD(rank=2))
train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), steps=3)
net = small_model()
lgreco = hvd_compress.LGreCo(hvd_compress.TopK(density=0.05), warmup_steps=1, decide_every=2, apply_delay=1)
diloco = hvd_compress.DiLoCo(
    torch.optim.AdamW(net.parameters(), lr=1e-3), net.named_parameters(), lgreco, inner_steps=2
)
train(net, diloco, steps=8)
# The default group, named without being held, still makes "auto" torch.distributed's transport.
assert type(lgreco.service.transport).__name__ == "TorchTransport", lgreco.service.transport
dist.barrier()
dist.destroy_process_group()
del ddp, state  # DDP's own reference to the group: torch's, released as the README's example does
gc.collect()
left = gloo_threads()
assert not left, f"rank {os.environ['RANK']}: Gloo threads {left} outlive destroy_process_group"
print(f"rank {os.environ['RANK']}: no Gloo thread left", flush=True)

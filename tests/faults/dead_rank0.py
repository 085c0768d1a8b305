"""Run by tests/test_elastic.py under plain ``horovodrun -np 2``: rank 0 freezes itself
(SIGSTOP, as a hung host) as it enters L-GreCo's exchange of decision 1, after the step's
gradients were exchanged; rank 1 waits there and must raise DecisionTimeout within the timeout.
Rank 1 prints ``DEAD_RANK0_RESULT waited <seconds> s: <exception>``."""

import os
import signal
import time

import horovod.torch as hvd
import torch
from torch import nn

import hvd_compress as hc
from examples.workloads.digits import DigitsCNN

hvd.init()
torch.manual_seed(0)
model = DigitsCNN()
compression = hc.LGreCo(
    hc.PowerSGD(model.named_parameters(), rank=2, min_numel=0),
    warmup_steps=3,
    decide_every=100,
    apply_delay=1,
    timeout=float(os.environ["DECISION_TIMEOUT"]),
)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(), compression=compression
)
exchange, entered = compression.service.exchange, []


def stop_or_time(*args, **kwargs):
    if hvd.rank() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    entered.append(time.monotonic())
    return exchange(*args, **kwargs)


compression.service.exchange = stop_or_time
try:
    for step in range(10):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(16, 1, 8, 8)), torch.randint(10, (16,))).backward()
        optimizer.step()
    raise AssertionError("rank 1 was not stopped by the missing decision")
except hc.DecisionTimeout as error:
    print(
        f"DEAD_RANK0_RESULT waited {time.monotonic() - entered[0]:.2f} s: {type(error).__name__}: {error}", flush=True
    )

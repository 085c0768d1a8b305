"""Horovod alone, no hvd_compress: the start of examples/train_digits.py, where the random
Gloo timeouts struck (hvd.init, then hvd.broadcast_parameters of the digits CNN's state, then a
few all-reduces of its gradients' shapes). Run by docker/soak.sh ("start") to tell a failure of
Horovod's Gloo controller at start-up apart from ours.

    horovodrun --gloo -np 4 -H c1:2,c2:2 python gloo_start.py [STEPS]
"""

import logging
import sys
import time

import horovod.torch as hvd
import torch
from torch import nn


def digits_cnn() -> nn.Module:
    # examples/workloads/digits.py's DigitsCNN, repeated so that this probe imports no
    # hvd_compress code.
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    started = time.time()
    hvd.init()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    initialised = time.time()
    torch.manual_seed(hvd.rank())
    model = digits_cnn()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast = time.time()
    for step in range(steps):
        handles = [
            hvd.allreduce_async_(torch.ones_like(p), name=f"grad.{name}", op=hvd.Average)
            for name, p in model.named_parameters()
        ]
        for handle in handles:
            hvd.synchronize(handle)
    logging.info(
        "rank %d: init %.1f s, broadcast %.1f s, %d steps %.1f s",
        hvd.rank(),
        initialised - started,
        broadcast - initialised,
        steps,
        time.time() - broadcast,
    )
    if hvd.rank() == 0:
        logging.info("final: %d steps", steps)


if __name__ == "__main__":
    main()

"""Horovod alone, no hvd_compress: all-reduces under fixed names whose shapes alternate
between steps (what ACP-SGD's P and Q payloads did when they rode Horovod's all-reduce under
the parameter's name), or keep one shape. Run by docker/soak.sh ("shapes", "fixed-shapes")
to tell Horovod's behaviour under the Gloo controller apart from ours.

    horovodrun --gloo -np 4 -H c1:2,c2:2 python gloo_shapes.py [STEPS] [alternate|fixed]
"""

import logging
import random
import sys
import time

import horovod.torch as hvd
import torch

# (rows at even steps, rows at odd steps) of four tensors: the digits CNN's P and Q shapes.
SHAPES = [(512, 64), (64, 32), (4608, 32), (144, 16)]


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    alternate = (sys.argv[2] if len(sys.argv) > 2 else "alternate") == "alternate"
    hvd.init()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rng = random.Random(hvd.rank())
    start = time.time()
    for step in range(steps):
        handles = []
        for i, (even, odd) in enumerate(SHAPES):
            rows = odd if alternate and step % 2 else even
            handles.append(
                hvd.allreduce_async_(torch.full((4 * rows,), float(hvd.rank())), name=f"allreduce.p{i}", op=hvd.Average)
            )
        order = list(range(len(handles)))
        rng.shuffle(order)  # ranks wait in different orders, as Horovod's synchronize() may
        for i in order:
            hvd.synchronize(handles[i])
        time.sleep(rng.random() * 0.01)  # and reach the next step at different times
    if hvd.rank() == 0:
        logging.info(
            "final: %d steps, shapes %s, %.1f s", steps, "alternating" if alternate else "fixed", time.time() - start
        )


if __name__ == "__main__":
    main()

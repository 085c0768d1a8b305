"""What recovers PowerSGD's quality on a short AdamW run of the character LM: a dense start,
or a higher rank?

    mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl self,tcp python examples/lm_quality.py

The convergence benchmark's character-LM training (d_model 128, 2 layers, 16 sequences per
rank, 300 AdamW steps, seed 0), with PowerSGD rank 4 starting after 0, 30 and 100 dense steps,
ACP-SGD rank 4 after 100, and PowerSGD at rank 16 and 32 from the start. Rank 0 prints each run's
validation perplexity and the ratio of
float32 all-reduce bytes to bytes sent, over the whole run.
"""

import logging
import sys

import horovod.torch as hvd
import torch
from workloads import charlm

import hvd_compress as hc

logger = logging.getLogger("lm_quality")

RUNS = [
    (hc.PowerSGD, 4, 0),
    (hc.PowerSGD, 4, 30),
    (hc.PowerSGD, 4, 100),
    (hc.ACPSGD, 4, 100),
    (hc.PowerSGD, 16, 0),
    (hc.PowerSGD, 32, 0),
]


def main():
    # Result lines to stdout, one write each (mpirun --tag-output then tags each line whole).
    logger.addHandler(logging.StreamHandler(sys.stdout))
    logger.setLevel(logging.INFO)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    hvd.init()
    for compressor_class, rank, start_step in RUNS:
        compressors = []

        def make_optimizer(model, optimizer):
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            named = list(model.named_parameters())
            compressors.append(compressor_class(named, rank=rank, start_step=start_step))
            return hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compressors[-1])

        _, perplexity = charlm.train(
            make_optimizer,
            hvd.rank(),
            hvd.size(),
            steps=300,
            batch_size=16,
            seed=0,
            model_kwargs={"d_model": 128, "layers": 2, "heads": 4, "context": 64},
        )
        if hvd.rank() == 0:
            logger.info(
                f"{compressor_class.__name__} rank {rank}, start_step {start_step}: "
                f"validation perplexity {perplexity:.3f}, "
                f"{compressors[-1].traffic.ratio:.1f}x fewer bytes"
            )


if __name__ == "__main__":
    main()

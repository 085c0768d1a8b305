"""Data-parallel training of a small CNN on scikit-learn's digits with gradient compression.

    horovodrun -np 2 python examples/train_digits.py --compression powersgd --rank 2
    horovodrun -np 2 python examples/train_digits.py --compression acpsgd --rank 4 --adapt lgreco

Prints loss and test accuracy per epoch, then bytes sent per step and the compression ratio.
``--tensorboard DIR`` writes the compression's per-step metrics (bytes, ratio, codec time,
controller state) there from rank 0: ``tensorboard --logdir DIR``.
"""

import argparse
import logging
import sys

import horovod.torch as hvd
import torch
from workloads import digits

import hvd_compress

logger = logging.getLogger("train_digits")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=sorted(hvd_compress.COMPRESSORS), default="powersgd")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD/ACP-SGD rank")
    parser.add_argument("--density", type=float, default=0.01, help="Top-K density")
    parser.add_argument("--bits", type=int, default=4, help="QSGD bits")
    parser.add_argument(
        "--optimizer",
        choices=["stock", "wrapper"],
        default="stock",
        help="hvd.DistributedOptimizer or hvd_compress.DistributedOptimizer",
    )
    parser.add_argument(
        "--adapt",
        choices=["none", "lgreco", "gravac"],
        default="none",
        help="wrap the compressor in L-GreCo (per-layer settings) or GraVAC (adaptive factor; Top-K, low-rank or QSGD)",
    )
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--tensorboard", metavar="DIR", help="write per-step compression metrics here")
    parser.add_argument("--metrics-every", type=int, default=5, help="steps between metric writes")
    args = parser.parse_args()
    # Result lines to stdout, one write each (mpirun --tag-output then tags each line whole).
    logger.addHandler(logging.StreamHandler(sys.stdout))
    logger.setLevel(logging.INFO)

    hvd.init()
    torch.set_num_threads(1)
    method = hvd_compress.COMPRESSORS[args.compression]
    # The command line's values for whichever settings this method has.
    given = {"rank": args.rank, "density": args.density, "bits": args.bits}
    kwargs = {key: given[key] for key in method.defaults if key in given}
    made = {}
    steps_per_epoch = len(digits.load_digits_split()[1]) // hvd.size() // 32

    def watched(compressor):
        if args.tensorboard:
            made["exporter"] = hvd_compress.metrics.TensorBoard(args.tensorboard, every=args.metrics_every)
            return made["exporter"].watch(compressor)
        return compressor

    def adapted(compressor):
        if args.adapt == "lgreco":
            return hvd_compress.LGreCo(
                compressor,
                warmup_steps=steps_per_epoch,
                decide_every="epoch",
                steps_per_epoch=steps_per_epoch,
                apply_delay=5,
            )
        if args.adapt == "gravac":
            return hvd_compress.GraVAC(compressor, theta_min=10, theta_max=100, window=steps_per_epoch, epsilon=0.5)
        return compressor

    def make_optimizer(model, optimizer):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if args.optimizer == "stock":
            made["compressor"] = watched(adapted(method.build(model.named_parameters(), **kwargs)))
            return hvd.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters(), compression=made["compressor"]
            )
        made["compressor"] = watched(adapted(method.build(**kwargs)))
        return hvd_compress.DistributedOptimizer(optimizer, model.named_parameters(), made["compressor"])

    def log(epoch, loss, acc):
        if hvd.rank() == 0:
            logger.info(f"epoch {epoch + 1:2d}  loss {loss:.4f}  test accuracy {acc:.4f}")

    if hvd.rank() == 0:
        logger.info(
            f"{hvd.size()} ranks, compression={args.compression} {kwargs}, "
            f"adapt={args.adapt}, optimizer={args.optimizer}"
        )
    _, acc = digits.train(make_optimizer, hvd.rank(), hvd.size(), epochs=args.epochs, lr=0.1, log=log)
    if "exporter" in made:
        made["exporter"].close()
    if hvd.rank() == 0:
        traffic = made["compressor"].traffic.summary()
        logger.info(
            f"final test accuracy {acc:.4f}\n"
            f"bytes on the wire per step: {traffic['wire_bytes_per_step']} sent vs "
            f"{traffic['float32_allreduce_wire_bytes_per_step']} for an uncompressed "
            f"float32 all-reduce; compression ratio {traffic['compression_ratio']}x"
        )
        if args.tensorboard:
            logger.info(
                f"metrics every {args.metrics_every} steps in {args.tensorboard} "
                f"(tensorboard --logdir {args.tensorboard})"
            )


if __name__ == "__main__":
    main()

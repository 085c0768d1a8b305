"""Data-parallel training of a small CNN on scikit-learn's digits with gradient compression.

    horovodrun -np 2 python examples/train_digits.py --compression powersgd --rank 2

Prints loss and test accuracy per epoch, then bytes sent per step and the compression ratio.
"""
import argparse

import horovod.torch as hvd
import torch

import hvd_compress
from hvd_compress.compressors import BY_NAME
from hvd_compress.workloads import digits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=sorted(BY_NAME), default="powersgd")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD/ACP-SGD rank")
    parser.add_argument("--density", type=float, default=0.01, help="Top-K density")
    parser.add_argument("--bits", type=int, default=4, help="QSGD bits")
    parser.add_argument("--optimizer", choices=["stock", "wrapper"], default="stock",
                        help="hvd.DistributedOptimizer or hvd_compress.DistributedOptimizer")
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    options = {"powersgd": {"rank": args.rank}, "acpsgd": {"rank": args.rank},
               "topk": {"density": args.density}, "qsgd": {"bits": args.bits}}
    kwargs = options.get(args.compression, {})
    made = {}

    def make_optimizer(model, optimizer):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if args.optimizer == "stock":
            made["compressor"] = BY_NAME[args.compression](model.named_parameters(), **kwargs)
            return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            compression=made["compressor"])
        made["compressor"] = BY_NAME[args.compression](**kwargs)
        return hvd_compress.DistributedOptimizer(optimizer, model.named_parameters(),
                                                 made["compressor"])

    def log(epoch, loss, acc):
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}  loss {loss:.4f}  test accuracy {acc:.4f}", flush=True)

    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, compression={args.compression} {kwargs}, "
              f"optimizer={args.optimizer}", flush=True)
    _, acc = digits.train(make_optimizer, hvd.rank(), hvd.size(), epochs=args.epochs, lr=0.1,
                          log=log)
    if hvd.rank() == 0:
        traffic = made["compressor"].traffic.summary()
        print(f"final test accuracy {acc:.4f}")
        print(f"bytes on the wire per step: {traffic['wire_bytes_per_step']} sent vs "
              f"{traffic['float32_allreduce_wire_bytes_per_step']} for an uncompressed "
              f"float32 all-reduce; compression ratio {traffic['compression_ratio']}x")


if __name__ == "__main__":
    main()

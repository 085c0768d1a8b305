"""Mixed precision with gradient compression: torch.autocast + GradScaler through stock
hvd.DistributedOptimizer, overflow steps included.

    horovodrun -np 2 python examples/train_digits_amp.py --compression powersgd
    horovodrun -np 2 python examples/train_digits_amp.py --compression acpsgd --rank 4 --lgreco

float16 autocast where this device supports it, else bfloat16. GradScaler starts at 2^16 and
doubles every --growth-interval clean steps, so overflow steps recur; --overflow-every N also
puts an Inf into the last rank's gradient every N steps (a scripted overflow: bfloat16 has
float32's range and rarely overflows). A step with an Inf or NaN anywhere is skipped by
GradScaler on every rank, and the compressor drops it from its state (error feedback, warm
starts, L-GreCo's sums), so training goes on as if it had not happened.

Prints test accuracy per epoch, the overflow steps GradScaler skipped and the compressor dropped,
and (with --baseline) the float32 uncompressed run's accuracy for comparison.
"""

import argparse
import logging

import horovod.torch as hvd
import torch
from torch import nn
from workloads import digits

import hvd_compress

logger = logging.getLogger("train_digits_amp")


def autocast_dtype(device_type):
    """float16 if autocast supports it on this device, else bfloat16."""
    try:
        with torch.autocast(device_type, dtype=torch.float16):
            torch.nn.functional.conv2d(torch.ones(1, 1, 3, 3), torch.ones(1, 1, 3, 3))
        return torch.float16
    except (RuntimeError, AssertionError):
        return torch.bfloat16


def train(args, compressed, log_epochs):
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = digits.load_digits_split()
    x_train, y_train = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    model = digits.DigitsCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    steps_per_epoch = len(y_train) // args.batch_size
    scaler = torch.amp.GradScaler("cpu", enabled=compressed, growth_interval=args.growth_interval)
    if compressed:
        compression = hvd_compress.COMPRESSORS[args.compression].build(
            model.named_parameters(),
            **({"rank": args.rank} if "rank" in hvd_compress.COMPRESSORS[args.compression].defaults else {}),
        )
        if args.lgreco:
            compression = hvd_compress.LGreCo(
                compression,
                warmup_steps=steps_per_epoch,
                decide_every="epoch",
                steps_per_epoch=steps_per_epoch,
                apply_delay=5,
            )
        compression.track(scaler)  # error feedback in unscaled units
        if args.tensorboard:  # per-step metrics, skipped overflow steps among them
            exporter = hvd_compress.metrics.TensorBoard(args.tensorboard, every=args.metrics_every)
            exporter.watch(compression)
    else:
        compression = hvd_compress.NoCompression(model.named_parameters())
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * steps_per_epoch)
    dtype = autocast_dtype("cpu")
    weight = next(p for p in model.parameters() if p.dim() >= 2)
    step_number = {"now": 0}

    def scripted_overflow(grad):
        if (
            compressed
            and args.overflow_every
            and hvd.rank() == hvd.size() - 1
            and step_number["now"] % args.overflow_every == args.overflow_every - 1
        ):
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    weight.register_hook(scripted_overflow)
    generator = torch.Generator().manual_seed(0)
    skipped = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(y_train), generator=generator)
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=dtype, enabled=compressed):
                loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            # Horovod's order for GradScaler: synchronize, unscale, clip, then step without
            # synchronizing again.
            scaler.scale(loss).backward()
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            with optimizer.skip_synchronize():
                scale_before = scaler.get_scale()
                scaler.step(optimizer)
            scaler.update()
            skipped += compressed and scaler.get_scale() < scale_before
            schedule.step()
            step_number["now"] += 1
        if log_epochs and hvd.rank() == 0:
            logger.info(
                "epoch %2d  loss %.4f  test accuracy %.4f  loss scale %g",
                epoch + 1,
                loss.item(),
                digits.accuracy(model, x_test, y_test),
                scaler.get_scale(),
            )
    if compressed and args.tensorboard:
        exporter.close()
    inner = compression.wrapped or compression
    return digits.accuracy(model, x_test, y_test), skipped, inner.skipped_steps, dtype


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=sorted(hvd_compress.COMPRESSORS), default="powersgd")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD/ACP-SGD rank")
    parser.add_argument("--lgreco", action="store_true", help="wrap the compressor in L-GreCo")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--growth-interval", type=int, default=20, help="GradScaler doubles its scale after this many clean steps"
    )
    parser.add_argument(
        "--overflow-every",
        type=int,
        default=50,
        help="put an Inf into the last rank's gradient every N steps (0: never)",
    )
    parser.add_argument("--tensorboard", metavar="DIR", help="write per-step compression metrics here")
    parser.add_argument("--metrics-every", type=int, default=5, help="steps between metric writes")
    parser.add_argument("--baseline", action="store_true", help="also train float32, uncompressed, and compare")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("hvd_compress").setLevel(logging.ERROR)  # one warning per overflow step
    hvd.init()
    torch.set_num_threads(1)
    accuracy, skipped, dropped, dtype = train(args, compressed=True, log_epochs=True)
    if hvd.rank() == 0:
        logger.info(
            "%s autocast, %s%s: final test accuracy %.4f; GradScaler skipped %d overflow "
            "steps, the compressor dropped %d and trained on",
            str(dtype)[6:],
            args.compression,
            " + L-GreCo" if args.lgreco else "",
            accuracy,
            skipped,
            dropped,
        )
    if args.baseline:
        reference, _, _, _ = train(args, compressed=False, log_epochs=False)
        if hvd.rank() == 0:
            logger.info(
                "float32 uncompressed: final test accuracy %.4f (difference %+.2f points)",
                reference,
                100 * (accuracy - reference),
            )


if __name__ == "__main__":
    main()

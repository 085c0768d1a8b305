import horovod.torch as hvd
import torch

import hvd_compress as hc
from hvd_compress.workloads import digits

# Small settings so that every compressor actually compresses the digits CNN's layers.
CONFIGS = {
    "fp16": lambda named: hc.FP16(named),
    "bf16": lambda named: hc.BF16(named),
    "powersgd": lambda named: hc.PowerSGD(named, rank=2),
    "acpsgd": lambda named: hc.ACPSGD(named, rank=4),
    "qsgd": lambda named: hc.QSGD(named, bits=4, bucket_size=128),
    "topk": lambda named: hc.TopK(named, density=0.05),
    "scalecom": lambda named: hc.ScaleCom(named, density=0.05),
}
PATHS = ["stock", "wrapper"]


def distributed(model, optimizer, compressor_name, path, broadcast=True, **kwargs):
    """Wraps ``optimizer`` the way a user would, on the stock or the wrapper path."""
    if broadcast:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if path == "stock":
        compressor = CONFIGS[compressor_name](model.named_parameters())
        opt = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                       compression=compressor, **kwargs)
    else:
        compressor = CONFIGS[compressor_name](None)
        opt = hc.DistributedOptimizer(optimizer, model.named_parameters(), compressor, **kwargs)
    return opt, compressor


def rank_batches(steps, batch_size=32, seed=0):
    """Different data on every rank: rank r's batches from its shard of the digits."""
    x, y, _, _ = digits.load_digits_split()
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(y), (batch_size,), generator=g)
        yield x[idx], y[idx]


def gathered(tensor, name):
    """(W, numel) rows: every rank's copy of ``tensor``."""
    return hvd.allgather(tensor.detach().reshape(1, -1), name=name)

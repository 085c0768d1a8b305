import horovod.torch as hvd
import torch

import hvd_compress as hc
from benchmarks.workloads import digits

# Every registered compressor but the baseline, at settings that compress the digits CNN's layers.
CONFIGS = sorted(name for name in hc.COMPRESSORS if name != "none")
PATHS = ["stock", "wrapper"]


def distributed(model, optimizer, compressor_name, path, broadcast=True, **kwargs):
    """Wraps ``optimizer`` the way a user would, on the stock or the wrapper path."""
    if broadcast:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if path == "stock":
        compressor = hc.COMPRESSORS[compressor_name].build(model.named_parameters(), small=True)
        opt = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                       compression=compressor, **kwargs)
    else:
        compressor = hc.COMPRESSORS[compressor_name].build(small=True)
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


def sends_whole(compressor, shape):
    """A setting at which ``compressor`` sends a tunable gradient of ``shape`` uncompressed
    (the one that would compress it 1x), or None where every setting compresses it."""
    setting = compressor.setting_for_factor(shape, 1.0)
    return None if compressor.compresses(shape, setting) else setting


# The registered compressors whose settings can send the digits CNN's largest layer whole.
DENSE_SWITCHABLE = [name for name in hc.registry.controllable()
                    if sends_whole(hc.COMPRESSORS[name].build(small=True), (64, 512)) is not None]

import horovod.torch as hvd
import torch

import hvd_compress as hc
from examples.workloads import digits

# sends_whole: test_exchange takes it from here.
from dense_switch import dense_switchable, sends_whole  # noqa: F401

# Every registered compressor but the baseline, at settings that compress the digits CNN's layers.
CONFIGS = sorted(name for name in hc.COMPRESSORS if name != "none")
PATHS = ["stock", "wrapper"]


def distributed(model, optimizer, compressor_name, path, broadcast=True, settings=None, **kwargs):
    """Wraps ``optimizer`` the way a user would, on the stock or the wrapper path; the
    compressor at its small settings, with ``settings`` on top."""
    if broadcast:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    settings = settings or {}
    if path == "stock":
        compressor = hc.COMPRESSORS[compressor_name].build(model.named_parameters(), small=True, **settings)
        opt = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compressor, **kwargs
        )
    else:
        compressor = hc.COMPRESSORS[compressor_name].build(small=True, **settings)
        opt = hc.DistributedOptimizer(optimizer, model.named_parameters(), compressor, **kwargs)
    return opt, compressor


def rank_batches(steps, batch_size=32, seed=0):
    """Different data on every rank: rank r's batches from its shard of the digits."""
    x, y, _, _ = digits.load_digits_split()
    x, y = x[hvd.rank() :: hvd.size()], y[hvd.rank() :: hvd.size()]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(y), (batch_size,), generator=g)
        yield x[idx], y[idx]


def gathered(tensor, name):
    """(W, numel) rows: every rank's copy of ``tensor``."""
    return hvd.allgather(tensor.detach().reshape(1, -1), name=name)


def assert_parameters_identical(model, prefix):
    """Every parameter of ``model`` is bit-identical on every rank; the collectives are named
    ``prefix.<parameter name>``."""
    for name, p in model.named_parameters():
        rows = gathered(p, f"{prefix}.{name}")
        assert all(torch.equal(rows[0], row) for row in rows), name


def assert_same_on_every_rank(value, name):
    """``value`` (picklable: decisions, histories) is equal on every rank; ``name`` names the
    collective."""
    everyone = hvd.allgather_object(value, name=name)
    assert all(theirs == everyone[0] for theirs in everyone)


# The registered compressors whose settings can send the digits CNN's largest layer whole.
DENSE_SWITCHABLE = dense_switchable((64, 512))

"""What the DDP test files share: a small CNN with a parameter used on rank 0 only and one used
by no rank, rank-sharded digits, and all-gathers for cross-rank checks."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hvd_compress as hc
import hvd_compress.ddp
from hvd_compress.comm.torch_backend import all_gather_single

# Every registered compressor, the baseline included.
METHODS = sorted(hc.COMPRESSORS)
# How close the real aggregate must be to the simulated reference (relative to its largest
# entry): the methods are deterministic given the same gradients; only summation order differs.
TOLERANCE = {"fp16": 2e-3, "bf16": 2e-2}


class Net(nn.Module):
    """The digits CNN's layers (conv 144 and 4608 weights, 512 x 64 fully connected) plus
    ``extra`` (64 x 64), used on rank 0 only, and ``spare`` (64 x 64), used by no rank: DDP
    with find_unused_parameters=True hands both to the hook as zeros. ``partial=False``: every
    rank uses every parameter."""

    def __init__(self, partial=True):
        super().__init__()
        self.partial = partial
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 64)
        self.extra = nn.Linear(64, 64)
        self.spare = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        h = nn.functional.max_pool2d(torch.relu(self.conv2(h)), 2)
        h = torch.relu(self.fc(h.flatten(1)))
        if not self.partial or dist.get_rank() == 0:
            h = h + torch.relu(self.extra(h))
        if not self.partial:
            h = h + torch.relu(self.spare(h))
        return self.head(h)


def make_ddp(compressor, seed=0, partial=True, bucket_cap_mb=0.05, **options):
    """A DDP model (rank-dependent initial weights: DDP broadcasts rank 0's) with ``compressor``
    registered; returns (module, ddp model, hook state)."""
    torch.manual_seed(seed + dist.get_rank())
    module = Net(partial=partial)
    options.setdefault("find_unused_parameters", partial)
    model = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, **options)
    state = hvd_compress.ddp.register(model, compressor)
    return module, model, state


_DIGITS = None


def batches(steps, batch_size=32, seed=0):
    """Different data on every rank: rank r's batches from its shard of the digits."""
    global _DIGITS
    if _DIGITS is None:
        from sklearn.datasets import load_digits

        data = load_digits()
        _DIGITS = (
            torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0,
            torch.tensor(data.target, dtype=torch.long),
        )
    x, y = _DIGITS
    x, y = x[dist.get_rank() :: dist.get_world_size()], y[dist.get_rank() :: dist.get_world_size()]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(y), (batch_size,), generator=g)
        yield x[idx], y[idx]


def train(model, data, optimizer=None, lr=0.05):
    """SGD steps through the DDP model, one per (x, y) in ``data``; returns the optimizer."""
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return optimizer


def gathered(tensor):
    """(W, numel) rows: every rank's copy of ``tensor``."""
    flat = tensor.detach().reshape(-1).contiguous()
    rows = torch.empty(dist.get_world_size() * flat.numel(), dtype=flat.dtype)
    all_gather_single(rows, flat)  # Gloo wants a flat output
    return rows.view(dist.get_world_size(), -1)


def everyone(obj):
    """``obj`` from every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def assert_identical_across_ranks(module):
    for name, p in module.named_parameters():
        rows = gathered(p)
        assert all(torch.equal(rows[0], row) for row in rows), f"{name} differs between ranks"


def raw_gradients(module, x, y):
    """This rank's own gradients (zeros for parameters it did not use), computed on the module
    directly, so DDP's hooks never see them."""
    names, params = zip(*module.named_parameters())
    loss = nn.functional.cross_entropy(module(x), y)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g for name, p, g in zip(names, params, grads)}


def check_step_against_reference(module, model, optimizer, reference, method, x, y):
    """One step; every aggregated p.grad must equal what ``reference`` (a simulated world of W
    identically configured compressors) computes from every rank's raw gradients."""
    raw = raw_gradients(module, x, y)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    per_rank = [{} for _ in range(dist.get_world_size())]
    for name, grad in raw.items():
        for r, row in enumerate(gathered(grad)):
            per_rank[r][name] = row.view_as(grad)
    expected = reference.step(per_rank)[dist.get_rank()]
    for name, p in module.named_parameters():
        if p.grad is None:  # unused on every rank: DDP leaves it alone
            assert name.startswith("spare"), name
            continue
        # Rounding in a low-precision sum scales with the summands, not with a result that
        # cancels: the bound is relative to the largest rank's gradient.
        largest = max((rows[name].abs().max().item() for rows in per_rank if rows[name].numel()), default=0.0)
        tol = TOLERANCE.get(method, 1e-5) * largest + 1e-7
        assert torch.allclose(p.grad, expected[name], rtol=0, atol=tol), (method, name)
    optimizer.step()

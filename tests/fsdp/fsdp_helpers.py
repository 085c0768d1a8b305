"""What the FSDP test files share: HSDP over a ("replicate", "shard") mesh of a small network
with a layer used on rank 0 only and one used by no rank, rank-dependent data, and a
reference computed from every rank's raw gradients."""

import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hvd_compress as hc
import hvd_compress.fsdp

# Every registered compressor, the baseline included.
METHODS = sorted(hc.COMPRESSORS)
# How close the aggregate must be to the simulated reference (relative to its largest entry).
TOLERANCE = {"fp16": 2e-3, "bf16": 2e-2}


class Poison(torch.autograd.Function):
    """Identity forward; backward puts an Inf in one entry of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad


class Net(nn.Module):
    """fc1 64 -> 128, fc2 128 -> 128, head 128 -> 10; ``extra`` (128 x 128) on rank 0 only,
    ``spare`` (128 x 128) on no rank. Shards of the 128-row weights are 64 rows: compressed;
    the head's 5 rows and the biases go dense. ``poison``: an Inf in fc1's gradient, row 0
    (shard 0 only), on this rank's next backward."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 128)
        self.extra = nn.Linear(128, 128)
        self.spare = nn.Linear(128, 128)
        self.head = nn.Linear(128, 10)
        self.poison = False

    def forward(self, x):
        h = self.fc1(x)
        if self.poison:
            h = Poison.apply(h)
        h = torch.relu(h)
        h = torch.relu(self.fc2(h))
        if dist.get_rank() == 0:
            h = h + torch.relu(self.extra(h))
        return self.head(h)


def mesh(shape=(2, 2)):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def make_hsdp(compressor=None, seed=0, shape=(2, 2), fusion=None, **fsdp_options):
    """(plain reference module, HSDP model, state or None): one fully_shard per layer and the
    root; ``compressor`` None leaves HSDP's own all-reduce; ``fusion`` (a ScaledFusion) goes to
    ``register``."""
    return make_sharded(mesh(shape), compressor, seed, fusion, **fsdp_options)


def make_fsdp(compressor=None, seed=0, **fsdp_options):
    """As ``make_hsdp``, pure FSDP: a 1-D ("shard",) mesh over the world."""
    device_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    return make_sharded(device_mesh, compressor, seed, None, **fsdp_options)


def make_sharded(device_mesh, compressor, seed, fusion, **fsdp_options):
    torch.manual_seed(seed)
    plain = Net()
    model = Net()
    model.load_state_dict(plain.state_dict())
    # ``extra`` stays in the root's group: FSDP all-gathers each group on every rank of its
    # shard group, so a group of its own, used on rank 0 only, would leave rank 0 waiting.
    for layer in [model.fc1, model.fc2, model.spare, model.head]:
        fully_shard(layer, mesh=device_mesh, **fsdp_options)
    fully_shard(model, mesh=device_mesh, **fsdp_options)
    if compressor is None:  # as register does: ``extra`` has gradients on rank 0 only
        model.set_reduce_scatter_unused_params(True)
    options = {} if fusion is None else {"fusion": fusion}
    state = None if compressor is None else hvd_compress.fsdp.register(model, compressor, **options)
    return plain, model, state


def batches(steps, batch_size=16, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    for _ in range(steps):
        yield torch.randn(batch_size, 64, generator=g), torch.randint(10, (batch_size,), generator=g)


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def train(model, data, optimizer=None, lr=0.05):
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in data:
        optimizer.zero_grad()
        loss_of(model, x, y).backward()
        optimizer.step()
    return optimizer


def gathered(tensor, group=None):
    """(group size, numel) rows: every group member's copy of ``tensor``."""
    flat = tensor.detach().reshape(-1).contiguous()
    size = dist.get_world_size(group)
    rows = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(rows, flat, group=group)
    return torch.stack(rows)


def everyone(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def local_shards(model):
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def assert_replicas_identical(model, state):
    """Each parameter's local shard equals, bit for bit, that of every rank of its replicate
    group (the ranks holding the same rows)."""
    for name, p in model.named_parameters():
        local = p.to_local()
        if local.numel():
            rows = gathered(local, state.replicate_group)
            assert all(torch.equal(rows[0], row) for row in rows), f"{name} differs between replicas"


def expected_shards(plain, model, x, y, reference, replicate_group, shard_group):
    """What the aggregate of this step must be on this rank: every rank's raw gradients (from
    the plain module loaded with the full parameters) all-gathered, averaged over each shard
    group, cut into that group's row shards, and the shards of this rank's replicate group fed
    to ``reference`` (a simulated world of identically configured compressors)."""
    with torch.no_grad():
        for (name, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
            p.copy_(q.full_tensor())
    names, params = zip(*plain.named_parameters())
    grads = torch.autograd.grad(loss_of(plain, x, y), params, allow_unused=True)
    world = dist.get_world_size()
    shard_ranks = dist.get_process_group_ranks(shard_group)
    replicate_ranks = dist.get_process_group_ranks(replicate_group)
    my_shard = shard_ranks.index(dist.get_rank())
    per_replica = [{} for _ in replicate_ranks]
    for name, p, g in zip(names, params, grads):
        g = torch.zeros_like(p) if g is None else g
        rows = gathered(g).view(world, *g.shape)
        for r, member in enumerate(replicate_ranks):
            # Rank `member`'s shard group: the ranks at its replicate coordinate.
            group = [member - my_shard + s for s in range(len(shard_ranks))]
            mean = sum(rows[m] for m in group) / len(group)
            per_replica[r][name] = torch.chunk(mean, len(shard_ranks), dim=0)[my_shard].contiguous()
    return reference.step(per_replica)[replicate_ranks.index(dist.get_rank())]


def shared_directory():
    path = [tempfile.mkdtemp(prefix="hvd_compress_fsdp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def save(model, optimizer, state, path):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "compression": state}, checkpoint_id=path)


def load(model, optimizer, state, path):
    model_sd, optim_sd = get_state_dict(model, optimizer)
    everything = {"model": model_sd, "optim": optim_sd, "compression": state}
    # Partial: get_state_dict makes a momentum buffer for every parameter of a fresh
    # optimizer, but ``spare`` never had a gradient, so the checkpoint has none for it.
    dcp.load(everything, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=everything["model"], optim_state_dict=everything["optim"])

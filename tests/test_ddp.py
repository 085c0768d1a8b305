"""The PyTorch DDP tier: each file in tests/ddp runs as one ``torchrun`` job (Gloo, no Horovod
initialised) at np 2 and np 4. Every launch has a hard timeout and its whole process group is
killed on expiry, so no rank can hang the suite. The np 2 launch of test_ddp_exchange.py runs in
the quick tier (``-m "not slow"``); the others are marked ``slow``.

Also here, single-process: ``hvd_compress.ddp.scaled_bucket_cap_mb``."""

import os
import shutil
import sys
from pathlib import Path

import pytest
from torch import nn

import hvd_compress as hc
import hvd_compress.ddp
from launching import run_launch

HERE = Path(__file__).parent / "ddp"
# Seconds per launch; on this 2-core machine a launch took 13-31 s at np 2 and 26-71 s at np 4
# (10-20 s of it importing torch._dynamo, which DDP pulls in, Horovod and the package in every
# rank), up to twice that while other jobs ran.
TIMEOUTS = {"test_ddp_exchange.py": 300, "test_ddp_state.py": 300, "test_ddp_backend.py": 300, "test_ddp_outer.py": 300}
QUICK = {(2, "test_ddp_exchange.py")}


def launches():
    for np in [2, 4]:
        for test_file in sorted(TIMEOUTS):
            marks = [] if (np, test_file) in QUICK else [pytest.mark.slow]
            yield pytest.param(np, test_file, marks=marks, id=f"torchrun-{np}-{test_file}")


def command(np, test_file):
    # --standalone: a rendezvous on a free local port, so launches never collide.
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(np),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        test_file,
    ]


def run_torchrun(np, test_file, folder, timeout):
    """``test_file`` (in ``folder``) under ``torchrun --nproc_per_node np``, killed with every
    rank after ``timeout`` seconds; fails the calling test if it fails or times out."""
    run_launch(
        command(np, test_file), folder, timeout, f"torchrun --nproc_per_node {np} {test_file}", [" passed", " failed"]
    )


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun (comes with torch)")
@pytest.mark.parametrize("np, test_file", list(launches()))
def test_launch(np, test_file):
    run_torchrun(np, test_file, HERE, TIMEOUTS[test_file])


@pytest.mark.skipif(
    shutil.which("torchrun") is None or not Path("/proc/self/task").is_dir(),
    reason="needs torchrun and Linux's /proc (the threads' names)",
)
@pytest.mark.parametrize("np", [pytest.param(2, id="torchrun-2-gloo_threads.py")])  # ci/torch_only.sh's
def test_destroy_process_group_stops_gloo_threads_with_integrations_bound(np):
    """tests/teardown/gloo_threads.py at np 2: after the DDP hook and DiLoCo over L-GreCo ran on
    the default group, destroy_process_group leaves no Gloo worker thread (one left into
    interpreter shutdown can abort the process; DEVELOPERS.md)."""
    folder = HERE.parent / "teardown"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(np),
        "gloo_threads.py",
    ]
    # The folder above tests/ first: the checkout's package here, the installed one in
    # ci/torch_only.sh; then examples/, for the examples' toy task.
    root = HERE.parents[1]
    run_launch(
        command,
        folder,
        300,
        f"torchrun --nproc_per_node {np} gloo_threads.py",
        ["Gloo thread"],
        {"PYTHONPATH": os.pathsep.join([str(root), str(root / "examples")])},
    )


class Layers(nn.Module):
    """Eight 256 x 256 weights: 256 KiB each in float32, 2 MiB in all."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256, bias=False) for _ in range(8))


@pytest.mark.parametrize(
    "name, settings", [("none", {}), ("powersgd", {"rank": 4}), ("topk", {"density": 0.01}), ("fp16", {})]
)
def test_scaled_bucket_cap_keeps_as_many_layers_per_bucket_as_dense(name, settings):
    """The scaled rule fuses payloads up to dense_mb x rate, i.e. as many layers as a dense
    buffer of dense_mb holds, whatever the rate: here 4 layers (1 MiB) per bucket at 1 MiB and 2
    (0.5 MiB) at 0.5 MiB. In DDP's terms (dense bytes) that is a cap of dense_mb, not dense_mb x
    rate (PowerSGD rank 4: rate 1/32, which would make 32 times smaller buckets)."""
    model = Layers()
    compressor = hc.COMPRESSORS[name].build(**settings)
    assert hvd_compress.ddp.scaled_bucket_cap_mb(model, compressor, dense_mb=1) == pytest.approx(1.0)
    assert hvd_compress.ddp.scaled_bucket_cap_mb(model, compressor, dense_mb=0.5) == pytest.approx(0.5)
    # Larger than the model: one bucket, the whole model.
    assert hvd_compress.ddp.scaled_bucket_cap_mb(model, compressor) == pytest.approx(2.0)


def test_scaled_bucket_cap_follows_the_payloads_where_layers_compress_differently():
    """Layers 0-3 compressed 32-fold (8 KiB payloads), 4-7 sent dense (256 KiB: rank 200 would
    not shrink them): the rate is (4/32 + 4) / 8 = 33/64, the threshold 1 MiB x 33/64 = 528
    KiB, and in backward order the plan is [7, 6], [5, 4, 3, 2], [1, 0]: 3 buckets for 2 MiB,
    2/3 MiB each on average."""
    model = Layers()
    compressor = hc.PowerSGD(model.named_parameters(), rank=4)
    for i in range(4, 8):
        compressor.set_setting(f"layers.{i}.weight", 200)
    cap = hvd_compress.ddp.scaled_bucket_cap_mb(model, compressor, dense_mb=1)
    assert cap == pytest.approx(2.0 / 3)


def test_scaled_bucket_cap_refuses_nonsense():
    with pytest.raises(ValueError, match="dense_mb"):
        hvd_compress.ddp.scaled_bucket_cap_mb(Layers(), hc.FP16(), dense_mb=0)
    with pytest.raises(ValueError, match="no parameters"):
        hvd_compress.ddp.scaled_bucket_cap_mb(nn.ReLU(), hc.FP16())


def test_every_ddp_file_is_launched():
    """A file missing from TIMEOUTS would never run: none may be."""
    assert sorted(path.name for path in HERE.glob("test_*.py")) == sorted(TIMEOUTS)

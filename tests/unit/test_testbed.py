"""The emulated cluster of ``benchmarks.testbed``: the mpirun command it builds, and a
real 2-namespace testbed carrying a tiny mpi4py job (skipped where network namespaces cannot be
created). Seconds long; no timing assertions."""

import os
import shutil
import subprocess
import sys

import pytest

from benchmarks.testbed import EmulatedCluster, NetworkNamespacesUnavailable, emulated_cluster

# Its jobs start ranks of their own: ci/test.sh runs it one at a time, after the parallel pass.
pytestmark = pytest.mark.serial

# Prefix and subnet of their own, so the test never touches a benchmark's testbed (hvdc*).
PREFIX, SUBNET = "hvdt", "10.77.1"

HELLO = """
import os, subprocess
from mpi4py import MPI

world = MPI.COMM_WORLD
namespace = subprocess.check_output(["ip", "netns", "identify", str(os.getpid())], text=True)
total = world.allreduce(world.rank + 1)
reports = world.gather(f"{world.rank} {namespace.strip()} {total}")
if world.rank == 0:  # one writer: the ranks' output is not interleaved
    print("\\n".join(reports), flush=True)
"""


def test_mpirun_command_starts_rank_r_in_namespace_r_over_tcp_on_the_bridge():
    cluster = EmulatedCluster(ranks=4, rate_gbit=0.5, prefix=PREFIX, subnet=SUBNET)
    command = cluster.mpirun_command(["python", "train.py"], env={"PYTHONPATH": "/x"})
    joined = " ".join(command)
    assert command[:3] == ["mpirun", "--allow-run-as-root", "--oversubscribe"]
    assert "-np 4" in joined and "--mca btl tcp,self" in joined and "--mca pml ob1" in joined
    assert f"--mca btl_tcp_if_include {SUBNET}.0/24" in joined
    assert f"--mca oob_tcp_if_include {PREFIX}br" in joined and "-x PYTHONPATH" in joined
    assert command[-2:] == ["python", "train.py"]
    assert f'ip netns exec "{PREFIX}$OMPI_COMM_WORLD_RANK"' in joined
    environment = cluster.mpirun_environment({"PYTHONPATH": "/x"})
    assert environment["PMIX_MCA_ptl_tcp_remote_connections"] == "1"
    assert environment["PMIX_MCA_ptl_tcp_if_include"] == f"{PREFIX}br"
    assert cluster.tbf_parameters() == ["rate", "0.5gbit", "burst", "131072", "latency", "50ms"]
    assert [cluster.address(r) for r in range(2)] == [f"{SUBNET}.2", f"{SUBNET}.3"]


def test_ranks_of_one_node_share_its_namespace_and_address():
    cluster = EmulatedCluster(ranks=4, rate_gbit=1.0, prefix=PREFIX, subnet=SUBNET, ranks_per_node=2)
    assert cluster.nodes == 2 and [cluster.address(n) for n in range(2)] == [f"{SUBNET}.2", f"{SUBNET}.3"]
    assert f'ip netns exec "{PREFIX}$((OMPI_COMM_WORLD_RANK / 2))"' in " ".join(cluster.mpirun_command(["x"]))
    assert "2 network namespaces" in cluster.describe() and "2 ranks in each" in cluster.describe()
    with pytest.raises(ValueError, match="ranks_per_node"):
        EmulatedCluster(ranks=3, rate_gbit=1.0, ranks_per_node=2)


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split()


@pytest.fixture(params=["as found", "FORWARD policy DROP"])
def forward_policy(request):
    """As found, and as Docker's daemon leaves it: iptables' FORWARD policy DROP (put back after)."""
    if request.param == "as found":
        yield
        return
    if shutil.which("iptables") is None:
        pytest.skip("no iptables here (Docker's daemon brings it)")
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True, timeout=10)
    if rules.returncode != 0:
        pytest.skip(f"iptables not usable here: {rules.stderr.strip()}")
    policy = rules.stdout.split()[2]  # "-P FORWARD ACCEPT"
    subprocess.run(["iptables", "-P", "FORWARD", "DROP"], check=True, timeout=10)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-P", "FORWARD", policy], check=True, timeout=10)


def _skip_without_testbed():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("mpirun") is None:
        pytest.skip("needs ip (iproute2) and mpirun")
    pytest.importorskip("mpi4py")


@pytest.mark.slow
def test_two_namespace_testbed_runs_mpi_between_ranks_and_is_removed(forward_policy):
    _skip_without_testbed()
    try:
        with emulated_cluster(2, rate_gbit=1.0, prefix=PREFIX, subnet=SUBNET) as cluster:
            shaping = subprocess.run(
                ["ip", "netns", "exec", cluster.namespace(1), "tc", "qdisc", "show"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            returncode, stdout, stderr = cluster.run([sys.executable, "-c", HELLO], timeout=60)
    except NetworkNamespacesUnavailable as error:
        pytest.skip(f"network namespaces not permitted here: {error}")
    assert "tbf" in shaping and "rate 1Gbit" in shaping
    assert returncode == 0, stderr
    # Each rank in its own namespace; the all-reduce crossed the bridge: 1 + 2.
    assert sorted(line for line in stdout.splitlines() if line) == [f"0 {PREFIX}0 3", f"1 {PREFIX}1 3"]
    assert not [name for name in _namespaces() if name.startswith(PREFIX)]
    if shutil.which("iptables"):  # the testbed's ACCEPT rule went with its bridge
        rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True, timeout=10)
        assert f"{PREFIX}br" not in rules.stdout


@pytest.mark.slow
def test_two_nodes_of_two_ranks_each_run_mpi_across_the_bridge():
    _skip_without_testbed()
    try:
        with emulated_cluster(4, rate_gbit=1.0, prefix=PREFIX, subnet=SUBNET, ranks_per_node=2) as cluster:
            returncode, stdout, stderr = cluster.run([sys.executable, "-c", HELLO], timeout=60)
    except NetworkNamespacesUnavailable as error:
        pytest.skip(f"network namespaces not permitted here: {error}")
    assert returncode == 0, stderr
    # Ranks 0 and 1 on node 0, 2 and 3 on node 1; the all-reduce: 1 + 2 + 3 + 4.
    assert sorted(line for line in stdout.splitlines() if line) == [
        f"0 {PREFIX}0 10",
        f"1 {PREFIX}0 10",
        f"2 {PREFIX}1 10",
        f"3 {PREFIX}1 10",
    ]
    assert not [name for name in _namespaces() if name.startswith(PREFIX)]

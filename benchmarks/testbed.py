"""An emulated cluster on one machine: one network namespace per rank (or per node of several
ranks), joined by a bridge, with every namespace's link rate-limited by ``tc tbf``, and the
``mpirun`` command that starts rank r inside namespace r (or its node's).

Why: fusion and overlap only matter when bytes cost time, and ranks on one host otherwise talk
through shared memory or loopback at memory speed. In the testbed each rank has one veth link
to the bridge, shaped in both directions (the rank's end shapes what it sends, the bridge's end
what it receives), like a host on a full-duplex Ethernet switch port.

    with emulated_cluster(ranks=4, rate_gbit=1.0) as cluster:
        returncode, stdout, stderr = cluster.run(["python", "train.py"], timeout=120)

Nodes: ``ranks_per_node`` ranks (default 1) share one namespace, its link and its address, as
the ranks of one host do: rank r runs in namespace r // ranks_per_node, and ranks of one node
talk over its loopback, unshaped. ``namespace(node)`` and ``address(node)`` take a node, which
is the rank where ``ranks_per_node`` is 1.

Addresses: a private /24 (default 10.77.0.0/24), the bridge .1 (where mpirun's PMIx server
listens), node n .(n + 2). The namespaces have no default route, so ranks can reach only each
other and the bridge, never any other address.

Shaping (``tbf``): ``burst`` is one millisecond of traffic at the rate (125 kB at 1 Gbit/s),
at least 128 KiB. A real NIC has no credit: after an idle period tbf lets ``burst`` bytes
through at memory speed, so a message arrives at most about 1 ms early (2 ms at 0.5 Gbit/s),
below the resolution of a training step. The floor admits a whole 64 KiB GSO segment of the
veth with its headers, which tbf would otherwise split in software: at 0.5 Gbit/s with a 64 KiB
burst, 6-10% of the CPU went to work charged to no process during jobs with large buckets.
``latency`` 50 ms bounds the queue at rate x 50 ms + burst (6.3 MB at 1 Gbit/s): enough
that TCP never sees drops, and so never a retransmission timeout of 200 ms, which a switch port
that pauses (as data-centre Ethernet does) would not cause either. TCP Small Queues keep the
queue actually used far shorter.

Open MPI runs over TCP only (``pml ob1``, ``btl tcp,self``: no shared memory between the
namespaces), and rank r is bound to core r mod cores (``pin_ranks``).

Docker's daemon sets iptables' FORWARD policy to DROP, and with ``br_netfilter`` loaded frames
crossing a bridge go through that chain: where ``iptables`` exists, the testbed inserts an
ACCEPT rule for its own bridge (in and out) while it exists, and removes it with the bridge.

Every namespace, link and the bridge carry a fixed prefix (``hvdc`` by default). A set-up first
takes a lock file for that prefix, so two testbeds with the same prefix cannot overlap; whatever
a killed earlier run left under the prefix is then removed. Leaving the context, also on errors,
Ctrl-C and SIGTERM, removes everything it created. Every command runs under a timeout.
"""

import contextlib
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

COMMAND_TIMEOUT = 10  # seconds for one ip/tc command


class NetworkNamespacesUnavailable(RuntimeError):
    """The testbed could not be built here: no ``ip``/``tc``, or no permission to create
    namespaces, bridges or qdiscs (not root, a sandbox)."""


@dataclass(frozen=True)
class EmulatedCluster:
    ranks: int
    rate_gbit: float
    prefix: str = "hvdc"
    subnet: str = "10.77.0"  # first three octets of a private /24
    pin_ranks: bool = True
    ranks_per_node: int = 1

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.ranks % self.ranks_per_node:
            raise ValueError(
                f"emulated cluster: ranks_per_node ({self.ranks_per_node}) must be a "
                f"positive divisor of ranks ({self.ranks})"
            )

    @property
    def nodes(self):
        return self.ranks // self.ranks_per_node

    @property
    def bridge(self):
        return f"{self.prefix}br"

    @property
    def bridge_address(self):
        return f"{self.subnet}.1"

    def namespace(self, node):
        return f"{self.prefix}{node}"

    def address(self, node):
        return f"{self.subnet}.{node + 2}"

    def tbf_parameters(self):
        rate_bytes = self.rate_gbit * 1e9 / 8
        burst = max(128 * 1024, int(rate_bytes * 1e-3))
        return ["rate", f"{self.rate_gbit}gbit", "burst", str(burst), "latency", "50ms"]

    def mpirun_command(self, argv, env=None):
        """``mpirun`` starting ``argv`` as rank r inside its node's namespace, exporting the variables
        named in ``env`` to every rank; run it with :meth:`mpirun_environment`."""
        exports = [item for name in sorted(env or {}) for item in ("-x", name)]
        # $OMPI_COMM_WORLD_RANK is expanded by each rank's own shell, after mpirun set it.
        node = (
            "$OMPI_COMM_WORLD_RANK"
            if self.ranks_per_node == 1
            else f"$((OMPI_COMM_WORLD_RANK / {self.ranks_per_node}))"
        )
        enter = f'exec ip netns exec "{self.prefix}{node}" "$@"'
        # Rank r bound to core r mod cores: unbound, the scheduler moves oversubscribed ranks
        # around and step times of two identical jobs differ several times more.
        placement = (
            ["--map-by", "core:OVERSUBSCRIBE", "--bind-to", "core:overload-allowed"]
            if self.pin_ranks
            else ["--bind-to", "none"]
        )
        # TCP on the shaped links only: no shared memory, no UCX or other fabrics.
        transports = {"pml": "ob1", "btl": "tcp,self", "btl_tcp_if_include": f"{self.subnet}.0/24"}
        transports["oob_tcp_if_include"] = self.bridge
        return [
            *("mpirun", "--allow-run-as-root", "--oversubscribe", *placement, "-np", str(self.ranks)),
            *(item for name, value in transports.items() for item in ("--mca", name, value)),
            *("-x", "PMIX_MCA_ptl_tcp_remote_connections", "-x", "PMIX_MCA_ptl_tcp_if_include", *exports),
            *("sh", "-c", enter, "sh", *argv),
        ]

    def mpirun_environment(self, env=None):
        """The environment for :meth:`mpirun_command`: ranks in other namespaces reach mpirun's
        PMIx server only over TCP on the bridge."""
        return {
            **os.environ,
            **(env or {}),
            "PMIX_MCA_ptl_tcp_remote_connections": "1",
            "PMIX_MCA_ptl_tcp_if_include": self.bridge,
        }

    def run(self, argv, timeout, env=None):
        """Runs ``argv`` on every rank under :func:`run_bounded`; ``env`` is added to this
        process's environment."""
        return run_bounded(self.mpirun_command(argv, env), timeout, self.mpirun_environment(env))

    def describe(self):
        per_node = (
            f", {self.ranks_per_node} ranks in each (unshaped loopback between them)" if self.ranks_per_node > 1 else ""
        )
        return (
            f"{self.nodes} network namespaces {self.namespace(0)}..{self.namespace(self.nodes - 1)}{per_node} "
            f"on bridge {self.bridge} ({self.subnet}.0/24), each link shaped both ways by "
            f"tc tbf {' '.join(self.tbf_parameters())}; ranks "
            f"{'bound to core r mod cores' if self.pin_ranks else 'not bound to cores'}"
        )


def _run(*args, namespace=None):
    """Runs one command (``ip ...``, ``tc ...``), inside ``namespace`` if given."""
    command = (["ip", "netns", "exec", namespace] if namespace else []) + list(args)
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT).stdout


def _remove(cluster_prefix):
    """Removes every namespace and link named with ``cluster_prefix`` (errors ignored)."""
    namespaces = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT
    ).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT).stdout
    link_names = [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()]
    for name in namespaces:
        if name.startswith(cluster_prefix) and name[len(cluster_prefix) :].isdigit():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT)
    # Deleting a namespace deletes the veth ends in it, and so their peers on the bridge;
    # a namespace still held by a lingering process keeps them, hence the explicit deletes.
    for name in link_names:
        if name.startswith(cluster_prefix):
            subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT)
    if shutil.which("iptables"):
        bridge = f"{cluster_prefix}br"
        while (
            subprocess.run(
                ["iptables", "-D", *_forward_rule(bridge)], capture_output=True, timeout=COMMAND_TIMEOUT
            ).returncode
            == 0
        ):
            pass


def _forward_rule(bridge):
    return ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]


def _build(cluster):
    try:
        _build_links(cluster)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        command = getattr(error, "cmd", None)
        raise NetworkNamespacesUnavailable(
            f"{shlex.join(command) + ': ' if command else ''}{str(detail).strip()}"
        ) from error


def _build_links(cluster):
    tbf = cluster.tbf_parameters()
    _run("ip", "link", "add", cluster.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{cluster.bridge_address}/24", "dev", cluster.bridge)
    _run("ip", "link", "set", cluster.bridge, "up")
    if shutil.which("iptables"):  # Docker's FORWARD policy would drop what crosses the bridge
        _run("iptables", "-I", *_forward_rule(cluster.bridge))
    for node in range(cluster.nodes):
        namespace = cluster.namespace(node)
        host_end, rank_end = f"{namespace}b", f"{namespace}e"
        _run("ip", "netns", "add", namespace)
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", rank_end, "netns", namespace)
        _run("ip", "link", "set", host_end, "master", cluster.bridge, "up")
        _run("tc", "qdisc", "add", "dev", host_end, "root", "tbf", *tbf)  # what the rank receives
        _run("ip", "link", "set", "lo", "up", namespace=namespace)
        _run("ip", "addr", "add", f"{cluster.address(node)}/24", "dev", rank_end, namespace=namespace)
        _run("ip", "link", "set", rank_end, "up", namespace=namespace)
        _run("tc", "qdisc", "add", "dev", rank_end, "root", "tbf", *tbf, namespace=namespace)  # sends


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def emulated_cluster(ranks, rate_gbit=1.0, prefix="hvdc", subnet="10.77.0", pin_ranks=True, ranks_per_node=1):
    """Sets up an :class:`EmulatedCluster`, yields it, and always removes it again."""
    cluster = EmulatedCluster(ranks, rate_gbit, prefix, subnet, pin_ranks, ranks_per_node)
    lock_path = Path(tempfile.gettempdir()) / f"hvd_compress-testbed-{prefix}.lock"
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another process holds testbed prefix {prefix!r} ({lock_path})") from None
        # SIGTERM becomes SystemExit so that the teardown below runs, as on Ctrl-C.
        previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
        try:
            _remove(prefix)  # left by an earlier run that was killed: it no longer holds the lock
            _build(cluster)
            yield cluster
        finally:
            _remove(prefix)
            signal.signal(signal.SIGTERM, previous)


def run_bounded(command, timeout, env=None):
    """Runs ``command`` in a session of its own; past ``timeout`` seconds (or on any exception
    here, Ctrl-C included) the whole session is terminated, then killed. Returns
    (returncode, stdout, stderr); returncode is None after a timeout."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    _inherit_autogroup_nice(process.pid)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        _stop_session(process)
        stdout, stderr = process.communicate()
        return None, stdout, stderr + f"\n[timed out after {timeout} s: {shlex.join(command)}]"
    except BaseException:
        _stop_session(process)
        raise


def _inherit_autogroup_nice(pid):
    """A new session is a new scheduler autogroup, at nice 0 whatever this one's: a benchmark
    started in the background with its autogroup at nice 19 would otherwise run its jobs at full
    weight beside other users' work. Where autogroups are absent, nothing to do."""
    try:
        nice = Path("/proc/self/autogroup").read_text().split()[-1]
        if nice != "0":
            Path(f"/proc/{pid}/autogroup").write_text(nice)
    except (OSError, IndexError):
        pass


def _stop_session(process, grace=5):
    """SIGTERM to the session (mpirun forwards it to its ranks), then SIGKILL to whatever is
    left of it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)

"""--net job: one job's network across its nodes (starter/net/overlay.py), on
a cluster of network namespaces (nethosts.Fabric): each "node" has its own
fabric address, state directory and nft table; a starter runs on a node by
running in its namespace.  Real VXLAN devices, real nft counters.
"""

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nethosts  # noqa: E402
import pytest  # noqa: E402

from conftest import GID, STARTER, SLOWDOWN, UID, process_alive, wait_running  # noqa: E402

# A TCP server in the job: one connection, prints the bytes it got.
SERVER = r"""
import socket, sys
fam = socket.AF_INET6 if sys.argv[1] == "6" else socket.AF_INET
s = socket.socket(fam); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::" if fam == socket.AF_INET6 else "", int(sys.argv[2]))); s.listen()
s.settimeout(float(sys.argv[3]) if len(sys.argv) > 3 else 60)
try:
    c, peer = s.accept()
except socket.timeout:
    print("got none", flush=True); sys.exit(0)
n = 0
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    n += len(b)
print("got", n, flush=True)
"""

# The client: for each NAME:FAMILY:BYTES, connect by the node's name (its
# /etc/hosts) and send; then exit with argv[1].
CLIENT = r"""
import socket, sys, time
for item in sys.argv[3:]:
    name, fam, n = item.split(":")
    fam = socket.AF_INET6 if fam == "6" else socket.AF_INET
    addr = socket.getaddrinfo(name, int(sys.argv[2]), fam, socket.SOCK_STREAM)[0][4]
    for _ in range(200):
        try:
            s = socket.socket(fam); s.connect(addr); break
        except OSError:
            s.close(); time.sleep(0.05)
    s.sendall(b"x" * int(n)); s.close()
    print("sent", name, addr[0], n, flush=True)
sys.exit(int(sys.argv[1]))
"""


def start(fab, i, net_id, cmd, report, *extra):
    """A starter on node i, in job network net_id -> Popen."""
    return fab.popen(i, STARTER, "run", "--net", "job", "--peers", fab.peers, "--node", f"n{i}",
                     "--net-id", str(net_id), "--state-dir", fab.state_dirs[i - 1], "--report", str(report),
                     *extra, "--", *cmd)


def finish(p, timeout=60):
    out, err = p.communicate(timeout=timeout * SLOWDOWN)
    return p.returncode, out, err


def overlay(report):
    with open(report) as f:
        return json.load(f)["network"]["overlay"]


def test_ranks_on_three_nodes_reach_each_other_by_name_and_are_counted_per_peer(tmp_path):
    with nethosts.fabric(3, tmp_path / "nodes") as fab:
        r = {i: tmp_path / f"r{i}.json" for i in (1, 2, 3)}
        s2 = start(fab, 2, 4242, ["python3", "-c", SERVER, "4", "5000"], r[2])
        s3 = start(fab, 3, 4242, ["python3", "-c", SERVER, "6", "5000"], r[3])
        c1 = start(fab, 1, 4242, ["python3", "-c", CLIENT, "3", "5000", "n2:4:1000000", "n3:6:2000000"], r[1])
        rc, out, err = finish(c1)
        # The job's exit code is the starter's; both families, by name.
        assert rc == 3, (out, err)
        assert "sent n2 10.214.0.2 1000000" in out and "sent n3 fd70:7639:1865::3 2000000" in out, out
        for p, n in ((s2, 1000000), (s3, 2000000)):
            rc, out, err = finish(p)
            assert rc == 0 and f"got {n}" in out, (rc, out, err)
        m1, m2, m3 = overlay(r[1]), overlay(r[2]), overlay(r[3])
        for i in (2, 3):        # the client's part ended first, with a bye: no peer was lost
            with open(r[i]) as f:
                assert json.load(f)["reason"] == "exited"
        assert (m1["vni"], m1["node"], m1["address"]) == (4242, "n1", "10.214.0.1")
        # What each end counted of one flow agrees (but for connection
        # attempts made before the peer's part was up), and is the bytes
        # sent plus their IP and TCP headers.
        for sent, mine, theirs in ((1000000, m1["peers"]["n2"], m2["peers"]["n1"]),
                                   (2000000, m1["peers"]["n3"], m3["peers"]["n1"])):
            assert 0 <= mine["out"]["bytes"] - theirs["in"]["bytes"] < sent * 0.001, (mine, theirs)
            assert sent < mine["out"]["bytes"] < sent * 1.10 + 20000, mine     # (+ retransmissions)
            assert 0 < mine["in"]["bytes"] < sent * 0.05, mine         # the acks
        assert m2["peers"]["n3"]["out"]["bytes"] == 0 and m3["peers"]["n2"]["in"]["bytes"] == 0
        assert m1["out"]["bytes"] == m1["peers"]["n2"]["out"]["bytes"] + m1["peers"]["n3"]["out"]["bytes"]
        assert nethosts.fabric_leftovers(fab) == {}


def vxlan_frame(vni, dst_mac, src_ip, dst_ip, port, payload=b"inject"):
    """A VXLAN packet's UDP payload: the header with vni, and an inner
    Ethernet/IPv4/UDP frame to dst_ip:port."""
    udp = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                      socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    s = sum(struct.unpack("!10H", hdr))
    s = (s & 0xFFFF) + (s >> 16)
    hdr = hdr[:10] + struct.pack("!H", ~s & 0xFFFF) + hdr[12:]
    eth = dst_mac + bytes.fromhex("020000000001") + b"\x08\x00"
    return struct.pack("!II", 0x08000000, vni << 8) + eth + hdr + udp


# Sends hex-encoded UDP payloads to HOST:PORT, each three times; prints the errors.
INJECT = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for h in sys.argv[3:]:
    for _ in range(3):
        try:
            u.sendto(bytes.fromhex(h), (host, port))
        except OSError as e:
            print("send", e.errno)
try:
    socket.create_connection(("10.214.0.2", 5000), timeout=2)
    print("connected")
except OSError as e:
    print("connect", type(e).__name__)
"""


def test_another_job_a_user_on_the_node_and_a_crafted_vxlan_packet_reach_nothing(tmp_path):
    with nethosts.fabric(2, tmp_path / "nodes") as fab:
        ra, ra1, rb = tmp_path / "a.json", tmp_path / "a1.json", tmp_path / "b.json"
        site = ("--uplink", "fab0", "--lan", fab.cidr)     # every job on a node: one table
        a2 = start(fab, 2, 7001, ["python3", "-c", SERVER, "4", "5000", str(8 * SLOWDOWN)], ra, *site)
        # Job A's part on n1 sends nothing: whatever n2 counts from n1 came in otherwise.
        a1 = start(fab, 1, 7001, ["sleep", str(8 * SLOWDOWN)], ra1, *site)
        time.sleep(0.5 * SLOWDOWN)
        # Frames for job A's part on n2, as if from its part on n1 (VNI 7001).
        mac = bytes([2]) + (7001).to_bytes(3, "big") + (2).to_bytes(2, "big")     # n2's in job 7001
        frame = vxlan_frame(7001, mac, "10.214.0.1", "10.214.0.2", 5000).hex()
        # Job B on n1, allowed out through the fabric (--uplink): its own
        # network id, then A's VXLAN frames to n2's VXLAN port.
        b1 = start(fab, 1, 7002, ["python3", "-c", INJECT, fab.addrs[1], "4789", frame], rb, *site)
        rc, out, err = finish(b1)
        assert rc == 0 and "connect" in out and "connected" not in out, (out, err)
        # A user's process on n1 (not in a job): no route into a job
        # network; its VXLAN frames are dropped at n1's table.
        user = subprocess.run(fab.argv(1, "setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                                       nethosts.PY, "-c", INJECT, fab.addrs[1], "4789", frame),
                              capture_output=True, text=True, timeout=30 * SLOWDOWN)
        assert "connect" in user.stdout and "connected" not in user.stdout, user
        rc, out, err = finish(a2)
        assert rc == 0 and "got none" in out, (out, err)
        assert finish(a1)[0] == 0
        # The receiving side counted nothing from n1; B's attempts are its drops.
        assert overlay(ra)["peers"]["n1"]["in"] == {"bytes": 0, "packets": 0}
        with open(rb) as f:
            assert json.load(f)["network"]["dropped"]["packets"] >= 3
        assert nethosts.fabric_leftovers(fab) == {}
        # The frame is a good one: root on a node (the fabric is trusted) gets
        # it through, into a job network that listens.
        a2 = start(fab, 2, 7001, ["python3", "-c", "import socket,sys; u=socket.socket(socket.AF_INET, "
                                  "socket.SOCK_DGRAM); u.bind(('', 5000)); u.settimeout(float(sys.argv[1]));"
                                  "print('got', u.recv(100))", str(8 * SLOWDOWN)], ra, *site)
        time.sleep(0.5 * SLOWDOWN)
        root = subprocess.run(fab.argv(1, nethosts.PY, "-c", INJECT, fab.addrs[1], "4789", frame),
                              capture_output=True, text=True, timeout=30 * SLOWDOWN)
        rc, out, err = finish(a2)
        assert rc == 0 and "got b'inject'" in out, (out, err, root)


# A task: who it is, in which namespaces, what it sees in the shared /dev/shm.
TASK = r"""
import os, sys, time
name = sys.argv[1]
open("/dev/shm/from-" + name, "w").write(name)
time.sleep(float(sys.argv[2]))
print("pid", os.getpid(), "net", os.readlink("/proc/self/ns/net"), "ipc", os.readlink("/proc/self/ns/ipc"),
      "pidns", os.readlink("/proc/self/ns/pid"), "shm", ",".join(sorted(os.listdir("/dev/shm"))), flush=True)
"""


def test_the_tasks_of_a_job_on_one_node_share_its_part(tmp_path):
    """srun's tasks on a node: the first makes the node's part, the next
    joins its network, IPC and PID namespaces and /dev/shm, with a mount
    namespace, cgroup and report of its own; the first waits for it before
    the network goes, and its report counts the joiner's bytes too."""
    with nethosts.fabric(2, tmp_path / "nodes") as fab:
        r = {k: tmp_path / f"{k}.json" for k in ("a", "b", "s")}
        a = start(fab, 1, 555, ["python3", "-c", TASK, "a", "0.5"], r["a"], "--id", "task-a")
        wait_running(fab.state_dirs[0], "task-a", a)
        b = start(fab, 1, 555, ["sh", "-c", 'python3 -c "$1" b 1.5 && python3 -c "$2" 0 5000 n2:4:300000',
                                "sh", TASK, CLIENT], r["b"], "--id", "task-b")
        srv = start(fab, 2, 555, ["python3", "-c", SERVER, "4", "5000"], r["s"])
        (rca, outa, erra), (rcb, outb, errb) = finish(a), finish(b)
        assert rca == 0 and rcb == 0, (outa, erra, outb, errb)
        assert finish(srv)[0] == 0
        ta, tb = (dict(zip(o.split()[0::2], o.split()[1::2])) for o in (outa.splitlines()[0], outb.splitlines()[0]))
        # One PID namespace for the node's part (its PID 1 the part's init),
        # so MPI's shared memory tells the ranks apart by pid.
        assert (ta["net"], ta["ipc"], ta["pidns"]) == (tb["net"], tb["ipc"], tb["pidns"])
        assert ta["pid"] != tb["pid"] and "1" not in (ta["pid"], tb["pid"])
        assert tb["shm"] == "from-a,from-b", tb
        with open(r["a"]) as f:
            ra = json.load(f)
        with open(r["b"]) as f:
            rb = json.load(f)
        assert rb["network"]["overlay"]["part_of"] == "task-a" and "peers" not in rb["network"]["overlay"]
        # The owner ended first but waited: the part's counters hold the joiner's bytes.
        assert ra["network"]["overlay"]["peers"]["n2"]["out"]["bytes"] > 300000
        assert rb["ended_at"] <= ra["ended_at"]
        assert nethosts.fabric_leftovers(fab) == {}
        assert not os.path.exists(os.path.join(fab.state_dirs[0], "parts"))


def test_kill_9_of_a_starter_ends_the_other_parts_and_gc_leaves_nothing(tmp_path):
    with nethosts.fabric(2, tmp_path / "nodes") as fab:
        parts = [start(fab, i, 31337, ["sleep", "60"], tmp_path / f"{i}.json", "--id", f"part{i}")
                 for i in (1, 2)]
        try:
            for i, p in enumerate(parts, 1):
                wait_running(fab.state_dirs[i - 1], f"part{i}", p)
            # The metrics read each part's counters per peer in its namespace.
            m = subprocess.run(fab.argv(1, STARTER, "metrics", "--state-dir", fab.state_dirs[0]),
                               capture_output=True, text=True, timeout=60 * SLOWDOWN)
            assert 'starter_job_network_peer_bytes_total{job_id="part1",user="' in m.stdout, m
            assert 'peer="n2",direction="out"}' in m.stdout, m.stdout
            st = subprocess.run(fab.argv(1, STARTER, "status", "--state-dir", fab.state_dirs[0], "part1"),
                                capture_output=True, text=True, timeout=60 * SLOWDOWN)
            assert '"overlay": {"peers": {"n2": {"in": {"bytes": ' in st.stdout, st
            time.sleep(2.5)         # each part has heard the other's heartbeats
            parts[0].kill()
            parts[0].wait()
            # Its job dies with it (parent-death signal), and the job's
            # namespace with its overlay device.
            gc = subprocess.run(fab.argv(1, STARTER, "gc", "--state-dir", fab.state_dirs[0]),
                                capture_output=True, text=True, timeout=60 * SLOWDOWN)
            assert gc.returncode == 0, gc
            deadline = time.monotonic() + 10 * SLOWDOWN
            while nethosts.fabric_leftovers(fab).get("n1") and time.monotonic() < deadline:
                time.sleep(0.1)
                subprocess.run(fab.argv(1, STARTER, "gc", "--state-dir", fab.state_dirs[0]), capture_output=True)
            assert "n1" not in nethosts.fabric_leftovers(fab)
            # The other node's part hears no more heartbeats, and no bye: it
            # ends its job, and its report says why.
            rc, out, err = finish(parts[1], timeout=30)
            with open(tmp_path / "2.json") as f:
                rep = json.load(f)
            assert (rep["reason"], rep.get("peer_lost"), rc) == ("peer_lost", "n1", 128 + 15), (rep, err)
        finally:
            for p in parts:
                if p.poll() is None:
                    p.terminate()
                finish(p)
        assert nethosts.fabric_leftovers(fab) == {}
        assert not process_alive(parts[0].pid)


def test_the_admin_guides_two_node_check_runs_as_written(tmp_path):
    import shlex

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                           "admin-guide.md")) as f:
        text = f.read()
    block = text[text.index("<!-- multinode-check"):].split("\n")[1:3]
    n2, n1 = (shlex.split(line.strip()) for line in block)
    assert n2[:2] == n1[:2] == ["starter", "run"]
    with nethosts.fabric(2, tmp_path / "nodes") as fab:
        def on(i, argv):
            # The guide's addresses are the fabric's here; the state dir is the node's.
            argv = [a.replace("10.0.0.1", fab.addrs[0]).replace("10.0.0.2", fab.addrs[1]) for a in argv]
            return fab.popen(i, STARTER, "run", "--state-dir", fab.state_dirs[i - 1], *argv[2:])

        server = on(2, n2)
        for _ in range(50):     # (until the server listens, as one would by hand)
            rc, out, err = finish(on(1, n1))
            if rc == 0 or server.poll() is not None:
                break
            time.sleep(0.2)
        assert rc == 0, err
        rc, out, err = finish(server)
        assert (rc, out.strip()) == (0, "10.214.0.1"), err
        assert nethosts.fabric_leftovers(fab) == {}


def test_net_job_errors_are_one_line(starter, tmp_path):
    for args, what in ((["--net", "job"], "needs the job network's id"),
                       (["--net", "job", "--net-id", "5", "--peers", "a=10.1.1.1"], "is not one of the job's nodes"),
                       (["--net", "job", "--net-id", "5", "--peers", "n[1-"], "without its ']'"),
                       (["--net", "nat", "--peers", "n1"], "only applies with --net job"),
                       (["--net", "job", "--net-id", "5", "--peers", "me=192.0.2.7", "--node", "me"],
                        "is not an address of this host")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        p = starter("run", *args, "--", "true", env=env)
        assert p.returncode == 125 and p.stderr.count("\n") == 1 and what in p.stderr, (args, p.stderr)


# ---------------------------------------------------------------- under Slurm

MPI_HELLO = r"""
#include <mpi.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int rank, size, len; char node[MPI_MAX_PROCESSOR_NAME];
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank); MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Get_processor_name(node, &len);
    /* who shares this node's memory with me: the ranks MPI found local */
    MPI_Comm local; int nlocal;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
    MPI_Comm_size(local, &nlocal);
    /* a ping-pong of 1 MiB between rank 0 and each other rank */
    static char buf[1 << 20];
    for (int peer = 1; peer < size; peer++) {
        if (rank == 0) {
            MPI_Send(buf, sizeof buf, MPI_CHAR, peer, 0, MPI_COMM_WORLD);
            MPI_Recv(buf, sizeof buf, MPI_CHAR, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else if (rank == peer) {
            MPI_Recv(buf, sizeof buf, MPI_CHAR, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Send(buf, sizeof buf, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
        }
    }
    printf("rank %d of %d on %s, %d local, pingpong ok\n", rank, size, node, nlocal);
    MPI_Finalize();
    return rank == 0 ? 3 : 0;
}
"""


@pytest.mark.parametrize("who", ["root", "user"])
def test_an_mpi_job_across_three_nodes_under_slurm(who, state_root, tmp_path, request):
    """srun -N3 --ntasks-per-node=2 --mpi=pmix starter run --net job: every
    rank reports, the two ranks of a node share its part (MPI finds them
    local: shared memory), rank 0's exit code is the step's, and the job's
    bytes between nodes are in the reports.  As root (--user root), and as
    an ordinary user (nobody) through the set-user-ID starter: its network's
    id is its Slurm job's (proven by its slurmstepd), its nodes must be in
    the node policy's LAN (the fabric) and its environment (SLURM_*, PMIX_*,
    OMPI_* by --env-pass) is read from its relay."""
    import shutil

    from slurm import skip_reason
    import slurmnodes

    if shutil.which("mpicc") is None:
        pytest.fail("mpicc is missing: scripts/setup --test installs openmpi-bin and libopenmpi-dev")
    why = skip_reason("linuxproc")
    assert not why, why
    with contextlib.ExitStack() as stack:
        fab = stack.enter_context(nethosts.fabric(4, tmp_path / "nodes"))
        if who == "user":
            request.getfixturevalue("policy")(
                '[callers]\nallow = true\nnet = ["none", "nat", "job"]\n', defaults=f'lan = ["{fab.cidr}"]')
        c = stack.enter_context(slurmnodes.SlurmNodes(fab, state_root, **({"user": (UID, GID)} if who == "user"
                                                                           else {})))
        hello = c.compile("mpi_hello", MPI_HELLO)
        reports = os.path.join(c.sockdir, "out")
        os.mkdir(reports)
        os.chmod(reports, 0o777)
        # MPI over the job network only (eth0 is every job's own NAT, the
        # same address on every node); no single-copy between ranks (each
        # task is PID 1 of a PID namespace of its own).
        env = ["--export=ALL,OMPI_MCA_btl_tcp_if_include=vx0,OMPI_MCA_oob_tcp_if_include=vx0,"
               "OMPI_MCA_btl_vader_single_copy_mechanism=none"]
        task = (f"exec {STARTER} run --net job {'--user root' if who == 'root' else ''} --env-pass 'OMPI_*' "
                f"--report {reports}/$SLURM_PROCID.json -- {hello}")
        r = c.srun(["-N3", "--ntasks-per-node=2", "--mpi=pmix", *env, "sh", "-c", task], timeout=180)
        lines = sorted(l for l in r.stdout.splitlines() if l.startswith("rank "))
        assert len(lines) == 6, (r.returncode, r.stdout, r.stderr, c.logs())
        assert all(l.endswith("2 local, pingpong ok") for l in lines), lines
        assert r.returncode == 3, (r.returncode, r.stderr)
        # Node 1's part (ranks 0 and 1): one report counts it, the other
        # names it; rank 0 sent 1 MiB to each of the four ranks elsewhere.
        nets = []
        for procid in (0, 1):
            with open(os.path.join(reports, f"{procid}.json")) as f:
                nets.append(json.load(f)["network"]["overlay"])
        owner = [n for n in nets if "peers" in n]
        assert len(owner) == 1 and [n.get("part_of") for n in nets].count(None) == 1, nets
        for name in c.names[1:]:
            assert owner[0]["peers"][name]["out"]["bytes"] > 2 << 20, owner
        for i in range(1, 4):
            assert nethosts.fabric_leftovers(fab).get(f"n{i}") is None


def test_a_users_job_network_is_its_slurm_jobs_own(state_root, tmp_path, policy):
    """An ordinary user's --net job (through the set-user-ID starter), each
    refused in one line with nothing left, where its word would reach what
    is not its own: outside a Slurm step (no slurmstepd proves its job);
    a part on the node with its job's VNI that root started (another's: not
    joined); a node list reaching out of the node's LAN; a PMIx URI naming
    a port of the node's loopback that is not its step's server."""
    import slurmnodes

    with contextlib.ExitStack() as stack:
        fab = stack.enter_context(nethosts.fabric(2, tmp_path / "nodes"))
        policy('[callers]\nallow = true\nnet = ["none", "nat", "job"]\n', defaults=f'lan = ["{fab.cidr}"]')
        c = stack.enter_context(slurmnodes.SlurmNodes(fab, state_root, user=(UID, GID)))
        node, addr, own_state = c.names[0], fab.addrs[0], c.node_state_dir(1)

        def refused(r, what):
            # (srun adds a line of its own: "task 0: Exited with exit code 125")
            ours = [l for l in r.stderr.splitlines() if not l.startswith("srun:")]
            assert r.returncode == 125 and len(ours) == 1 and what in ours[0], (r.returncode, r.stderr)

        # Outside Slurm: its relay's first ancestor of root's is not a slurmstepd.
        r = subprocess.run(fab.argv(1, "setpriv", f"--reuid={UID}", f"--regid={GID}", "--clear-groups", "env", "-i",
                                    f"SLURM_JOB_NODELIST={node}", f"SLURMD_NODENAME={node}", STARTER, "run",
                                    "--net", "job", "--", "true"), capture_output=True, text=True, timeout=60)
        refused(r, "needs its Slurm job proven")

        # Root's part of job network 1 on the node: the user's Slurm job 1 (the
        # cluster's first) has that VNI, and is not let in.
        root_job = fab.popen(1, STARTER, "run", "--net", "job", "--peers", f"{node}={addr}", "--node", node,
                             "--net-id", "1", "--state-dir", own_state, "--id", "rootpart", "--", "sleep", "60")
        wait_running(own_state, "rootpart", root_job)
        r = c.srun(["-N1", f"-w{node}", STARTER, "run", "--net", "job", "--", "true"], timeout=120)
        refused(r, "is another's")
        root_job.terminate()
        finish(root_job)

        # A node list of its own making that leaves the LAN (the host's own loopback).
        r = c.srun(["-N1", f"-w{node}", "sh", "-c", f'SLURM_JOB_NODELIST="$SLURMD_NODENAME,localhost" '
                    f"exec {STARTER} run --net job -- true"], timeout=120)
        refused(r, "is not in the node's LAN")

        # A PMIx server URI of its own making: a port root listens on in the node's loopback.
        listener = fab.popen(1, sys.executable, "-c", "import socket, time; s = socket.socket(); "
                             "s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True); "
                             "time.sleep(120)")
        port = int(listener.stdout.readline())
        r = c.srun(["-N1", f"-w{node}", "sh", "-c", f"PMIX_SERVER_URI='pmix-server.1;tcp4://127.0.0.1:{port}' "
                    f"exec {STARTER} run --net job -- true"], timeout=120)
        refused(r, "which is not where the PMIx server of Slurm step")
        listener.kill()
        listener.wait()

        from starter.state import store

        assert store.list_ids(own_state) == [] and not os.path.exists(os.path.join(own_state, "parts"))
        assert nethosts.fabric_leftovers(fab) == {}


# ---------------------------------------------------------------- WireGuard

def has_wireguard():
    """Can this kernel make a WireGuard device (in a namespace of its own)?"""
    r = subprocess.run(["unshare", "-n", "ip", "link", "add", "wgprobe", "type", "wireguard"],
                       capture_output=True, text=True)
    return r.returncode == 0


def node_key(path, data=None, mode=0o600):
    with open(path, "wb") as f:
        f.write(data if data is not None else os.urandom(32))
    os.chmod(path, mode)
    return str(path)


def test_wireguard_transport_errors_are_one_line_and_leave_nothing(tmp_path):
    """--net-transport wireguard: a node key that is missing, readable by
    others or too short, and (on a kernel without WireGuard, as this
    host's) the missing kernel support: each one line, exit 125, nothing
    left on the node."""
    with nethosts.fabric(2, tmp_path / "nodes") as fab:
        good = node_key(tmp_path / "good.key")
        cases = [(str(tmp_path / "none.key"), "No such file"),
                 (node_key(tmp_path / "open.key", mode=0o644), "mode 0600"),
                 (node_key(tmp_path / "short.key", b"x" * 16), "fewer than 32")]
        if not has_wireguard():
            cases.append((good, "the kernel lacks WireGuard support"))
        for key, what in cases:
            rc, out, err = finish(start(fab, 1, 77, ["true"], tmp_path / "r.json", "--net-transport", "wireguard",
                                        "--net-key", key))
            assert rc == 125 and err.count("\n") == 1 and what in err, (key, rc, err)
        rc, out, err = finish(start(fab, 1, 77, ["true"], tmp_path / "r.json", "--net-key", good))
        assert rc == 125 and "only applies with --net-transport wireguard" in err, err
        assert nethosts.fabric_leftovers(fab) == {}


def test_a_job_network_over_wireguard(tmp_path):
    """--net-transport wireguard between two nodes: ranks reach each other by
    name over both families, counted per peer as over VXLAN; a node with
    another node key reaches nothing; a packet crafted to the WireGuard port
    (from root on a node: the fabric is not trusted here) gets nothing in."""
    import pytest

    if not has_wireguard():
        pytest.skip("this kernel has no WireGuard (this host's has no modules): it runs in the VMs "
                    "(scripts/test); the errors are tested everywhere")
    with nethosts.fabric(2, tmp_path / "nodes") as fab:
        key = node_key(tmp_path / "node.key")
        wg = ("--net-transport", "wireguard", "--net-key", key)
        r1, r2 = tmp_path / "r1.json", tmp_path / "r2.json"
        # Two servers on n2 (IPv4 at 5000, IPv6 at 5001), one client after the other on n1.
        s2 = start(fab, 2, 4343, ["sh", "-c", 'python3 -c "$0" 4 5000 & python3 -c "$0" 6 5001; wait', SERVER],
                   r2, *wg)
        c1 = start(fab, 1, 4343, ["sh", "-c", 'python3 -c "$0" 0 5000 n2:4:500000 && '
                                  'exec python3 -c "$0" 3 5001 n2:6:300000', CLIENT], r1, *wg)
        rc, out, err = finish(c1)
        assert rc == 3 and "sent n2 10.214.0.2 500000" in out and "sent n2 fd70:7639:1865::2 300000" in out, \
            (out, err)
        rc, out, err = finish(s2)
        assert rc == 0 and "got 500000" in out and "got 300000" in out, (out, err)
        m1, m2 = overlay(r1), overlay(r2)
        assert m1["transport"] == "wireguard" and m1["address"] == "10.214.0.1", m1
        # The sender counts a GSO burst's headers once, the receiver each
        # packet's (WireGuard decrypts them one by one): the payload is in
        # both, the headers (at most ~5% at wg0's MTU) only in the second.
        sent, got = m1["peers"]["n2"]["out"]["bytes"], m2["peers"]["n1"]["in"]["bytes"]
        assert 800000 < sent < 800000 * 1.02 + 20000 and 800000 < got < 800000 * 1.06 + 20000, (m1, m2)
        assert nethosts.fabric_leftovers(fab) == {}

        # Another node key on n1: its part's handshakes fail, nothing arrives.
        other = node_key(tmp_path / "other.key")
        s2 = start(fab, 2, 4343, ["python3", "-c", SERVER, "4", "5000", str(6 * SLOWDOWN)], r2, *wg)
        c1 = start(fab, 1, 4343, ["python3", "-c", "import socket; s = socket.socket(); s.settimeout(4); "
                                  "print('connect', s.connect_ex(('n2', 5000)))"], r1,
                   "--net-transport", "wireguard", "--net-key", other)
        rc, out, err = finish(c1)
        assert rc == 0 and "connect 0" not in out, (out, err)
        # Root on n1 sends datagrams of its own making to n2's WireGuard port.
        from starter.net import wireguard

        junk = (bytes([1, 0, 0, 0]) + os.urandom(144)).hex()
        root = subprocess.run(fab.argv(1, nethosts.PY, "-c", INJECT, fab.addrs[1], str(wireguard.port_of(4343)),
                                       junk), capture_output=True, text=True, timeout=30 * SLOWDOWN)
        rc, out, err = finish(s2)
        assert rc == 0 and "got none" in out, (out, err, root)
        assert overlay(r2)["peers"]["n1"]["in"] == {"bytes": 0, "packets": 0}
        assert nethosts.fabric_leftovers(fab) == {}

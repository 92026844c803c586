"""A private multi-node Slurm on one machine, for --net job (test_multinode):
slurm.py's cluster with one slurmd per node of a nethosts.Fabric.

    fabric node i (1..n)   slurmd -N <prefix>i, NodeAddr = its fabric address,
                           in the node's network namespace and a mount
                           namespace of its own: there /etc/hosts names every
                           node (so a starter's --peers from SLURM_JOB_NODELIST
                           resolves, as DNS would on a cluster), and the tests'
                           state directory and Slurm's TmpFS are the node's own
    fabric node n+1        slurmctld, and every client (srun, sinfo, scancel)

Debian builds Slurm with multiple-slurmd support (slurmd -N, per-node Port,
%n in the spool and pid paths).  proctrack/linuxproc: the nodes share the
host's cgroup tree, which Slurm's cgroup plugins would share too.  Slurm's
spool and TmpFS (where the PMIx server's sockets are) lie under /var/spool,
which a job sees (its /tmp, /var/tmp and /run are its own).
"""

import os
import shutil
import subprocess
import tempfile

from slurm import SlurmCluster, _free_ports, _which


class SlurmNodes(SlurmCluster):
    def __init__(self, fabric, state_dir, **kw):
        kw.setdefault("proctrack", "linuxproc")
        super().__init__(**kw)
        self.fabric = fabric
        self.n = len(fabric.nodes) - 1              # the last one is the head
        self.state_dir = state_dir                  # the path every node's starter uses
        self.names = [f"{self.node}{i}" for i in range(1, self.n + 1)]
        self.nodelist = f"{self.node}[1-{self.n}]"
        self.head_argv = fabric.nodes[-1].argv()

    # -- where things run ------------------------------------------------------
    def _run(self, argv, check=True, timeout=60, **kw):
        return super()._run(self.head_argv + list(argv), check=check, timeout=timeout, **kw)

    def _spawn(self, name, argv):
        if name == "slurmctld":
            argv = self.head_argv + list(argv)
        super()._spawn(name, argv)

    def _prepare_dirs(self):
        super()._prepare_dirs()
        shutil.rmtree(self.sockdir, ignore_errors=True)
        # Short (unix socket paths), and visible in jobs: the PMIx server's
        # sockets are in the spool and TmpFS, and ranks connect to them.
        self.sockdir = tempfile.mkdtemp(prefix="slurm-mn-", dir="/var/spool")
        os.chmod(self.sockdir, 0o755)
        for sub in ("spool", "tmp", "etc", "bin"):
            os.mkdir(os.path.join(self.sockdir, sub))
            os.chmod(os.path.join(self.sockdir, sub), 0o755)
        self.munge_socket = os.path.join(self.sockdir, "munge.sock")
        with open(os.path.join(self.sockdir, "etc", "hosts"), "w") as f:
            f.write("127.0.0.1\tlocalhost\n")
            f.writelines(f"{a}\t{n}\n" for n, a in zip(self.names, self.fabric.addrs))
        os.chmod(os.path.join(self.sockdir, "etc", "hosts"), 0o644)

    def _write_config(self):
        super()._write_config()
        ctld_port, *ports = _free_ports(1 + self.n)
        head = self.fabric.addrs[-1]
        keep = ("SlurmctldHost", "SlurmctldPort", "SlurmdPort", "SlurmdSpoolDir", "SlurmdPidFile",
                "SlurmdLogFile", "TmpFS", "NodeName", "PartitionName", "MpiDefault")
        with open(self.conf) as f:
            lines = [l for l in f.read().splitlines() if not l.startswith(keep)]
        cpus = max(2, self.cpus)
        # srun in the head's namespace: it tells the steps the address it
        # reaches slurmctld from, not the host's name's.
        lines = [l for l in lines if not l.startswith("CommunicationParameters")]
        lines += [
            f"SlurmctldHost=localhost({head})",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdSpoolDir={self.sockdir}/spool/%n",
            f"SlurmdPidFile={self.dir}/run/slurmd-%n.pid",
            f"SlurmdLogFile={self.dir}/log/slurmd-%n.log",
            f"TmpFS={self.sockdir}/tmp",
            "MpiDefault=none",
            *(f"NodeName={n} NodeHostname=localhost NodeAddr={a} Port={p} CPUs={cpus} RealMemory={self.real_memory_mb} "
              "State=UNKNOWN" for n, a, p in zip(self.names, self.fabric.addrs, ports)),
            f"PartitionName=debug Nodes={self.nodelist} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _start_slurmd(self):
        hosts = os.path.join(self.sockdir, "etc", "hosts")
        for i, name in enumerate(self.names, 1):
            own = os.path.join(self.dir, "state-" + name)
            os.makedirs(own, exist_ok=True)
            os.makedirs(os.path.join(self.sockdir, "spool", name), exist_ok=True)
            tmp = os.path.join(self.sockdir, "tmp-" + name)     # TmpFS, the node's own
            os.makedirs(tmp, mode=0o755, exist_ok=True)
            script = ('mount --bind "$1" /etc/hosts && mkdir -p "$3" && mount --bind "$2" "$3" && '
                      'mount --bind "$7" "$8" && exec "$4" -D -N "$5" -f "$6"')
            self._spawn("slurmd-" + name, self.fabric.argv(
                i, "unshare", "-m", "--propagation", "slave", "sh", "-c", script, "sh", hosts, own,
                self.state_dir, _which("slurmd"), name, self.conf, tmp, os.path.join(self.sockdir, "tmp")))

    def _wait_node_idle(self):
        def idle():
            r = self._run([_which("sinfo"), "-h", "-N", "-o", "%T"], check=False, timeout=10)
            states = [s.strip().rstrip("*") for s in r.stdout.split()] if r.returncode == 0 else []
            return len(states) == self.n and all(s == "idle" for s in states)
        self._wait_for(idle, f"nodes {self.nodelist} to become idle", "slurmd-" + self.names[0])

    def node_state_dir(self, i):
        """Node i's own state directory (what its starters see at state_dir)."""
        return os.path.join(self.dir, "state-" + self.names[i - 1])

    def compile(self, name, source, compiler="mpicc"):
        """Compile C source into a directory every job sees -> its path."""
        src = os.path.join(self.sockdir, "bin", name + ".c")
        out = os.path.join(self.sockdir, "bin", name)
        with open(src, "w") as f:
            f.write(source)
        subprocess.run([_which(compiler), "-O2", "-o", out, src], check=True, capture_output=True)
        os.chmod(out, 0o755)
        return out

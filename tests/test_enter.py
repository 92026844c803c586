"""ns.enter and nsidentity.open_namespaces against the real kernel, as root: what
`starter enter` rests on (a process joins the namespaces a running job was
cloned with, and only those).  The jobs and the leak check (no fd, no child
outlives a test) are test_ns.py's."""

import os

import pytest

from starter.isolate import ns, nsidentity
from starter.errors import SpawnError, SpecError, StarterError
from test_ns import ENV, NOBODY, Running, _read_all, no_leaks  # noqa: F401  (no_leaks: autouse)


def test_enter_sees_the_jobs_processes_network_and_mounts():
    with Running(["sh", "-c", "echo ready; hostname; read x"],
                 namespaces=frozenset({"pid", "net", "mnt", "uts"}), hostname="jobhost") as job:
        os.read(job.out_r, 100)
        r, w = os.pipe()
        fds = nsidentity.open_namespaces(job.child.pidfd,
                                         nsidentity.identities(job.child.pid, {"pid", "net", "mnt", "uts"}))
        try:
            entered = ns.enter(fds,
                               ["sh", "-c", "ps -e -o pid=,comm=; ip -o link | wc -l; hostname; "
                                "grep -E '^(NSpid|Uid|CapEff)' /proc/self/status; echo x > /tmp/mine"],
                               ENV, uid=NOBODY, gid=NOBODY, stdio=(None, w, None))
        finally:
            os.close(w)
            nsidentity.close_namespaces(fds)
        with entered:
            entered.wait_started()
            out = _read_all(r)
            assert entered.wait() == 0, out
        os.close(r)
        lines = out.splitlines()
        procs = [line.split() for line in lines[:3]]
        assert procs[0] == ["1", "sh"]
        assert [p[1] for p in procs[1:]] == ["sh", "ps"]
        assert lines[3] == "1"            # only lo
        assert lines[4] == "jobhost"
        status = {line.split()[0]: line.split()[1:] for line in lines[5:]}
        # grep's own status, in the job's /proc: one level, a pid of the job's ns
        assert len(status["NSpid:"]) == 1 and int(status["NSpid:"][0]) < 100
        assert status["Uid:"] == [str(NOBODY)] * 4
        assert int(status["CapEff:"][0], 16) == 0
        assert not os.path.exists("/tmp/mine") or open("/tmp/mine").read() != "x\n"
        job.finish()


def test_enter_failure_names_the_step():
    with Running() as job:
        made = nsidentity.identities(job.child.pid, {"pid", "mnt"})
        fds = nsidentity.open_namespaces(job.child.pidfd, made)
        try:
            entered = ns.enter(fds, ["true"], ENV, cwd="/nope")
        finally:
            nsidentity.close_namespaces(fds)
        with entered, pytest.raises(SpawnError) as e:
            entered.wait_started()
        assert e.value.step == "chdir /nope"
        assert os.WEXITSTATUS(entered.wait()) == 125
        job.finish()
        # The job is gone: its namespaces cannot be opened.
        with pytest.raises(StarterError, match="is gone"):
            nsidentity.open_namespaces(job.child.pidfd, made)


def test_open_namespaces_refuses_namespaces_other_than_the_recorded_ones():
    """What `starter enter` rests on: a namespace of the job's PID 1 that is
    not the one recorded at clone is refused, each by name, and no fd stays
    open (no_leaks)."""
    with Running(namespaces=frozenset({"pid", "mnt", "net", "ipc"})) as job:
        made = nsidentity.identities(job.child.pid, {"pid", "mnt", "net", "ipc"})
        other = dict(made, mnt=[made["mnt"][0], made["mnt"][1] + 1],
                     net=nsidentity.identities(os.getpid(), {"net"})["net"])
        with pytest.raises(nsidentity.NamespacesChanged) as e:
            nsidentity.open_namespaces(job.child.pidfd, other)
        assert sorted(e.value.changed) == ["mnt", "net"]
        fds = nsidentity.open_namespaces(job.child.pidfd, made)
        assert sorted(fds) == ["ipc", "mnt", "net", "pid"]
        nsidentity.close_namespaces(fds)
        # Only the cgroup namespace may go unrecorded (then its owner is
        # checked: the host's user namespace, as here).
        with pytest.raises(StarterError, match="no record"):
            nsidentity.open_namespaces(job.child.pidfd, dict(made, mnt=None))
        nsidentity.close_namespaces(nsidentity.open_namespaces(job.child.pidfd, {"cgroup": None}))
        with pytest.raises(SpecError):
            ns.enter({"mnt": None}, ["true"], ENV)
        job.finish()

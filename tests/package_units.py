"""The package's systemd units under a real systemd (issue 27):
scripts/vm-package-test runs this after tests/package_check.py, in the same
boot of the v2 VM, with the two package revisions and Debian's systemd
packages (fetched on the host) in /job/carry.  Not a pytest module: it
installs into the VM's own system, which only a throwaway boot may do.

The image has no systemd (vm-init is PID 1), so this installs bookworm's and
boots it the way a container manager does: PID 1 of its own PID, mount,
cgroup, UTS and IPC namespaces, in a cgroup of its own that its cgroup
namespace makes its root, with a fresh /run.  Everything below runs in there:

  install   apt install: starter-netd.service and starter-gc.timer enabled
            and active, the metrics units installed and disabled; netd's
            socket answers a NAT job started as a systemd service
  upgrade   apt install of revision 2 restarts netd (a new main pid)
  remove    apt remove stops every unit of starter
  purge     apt purge leaves no unit file or enablement link"""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from package_check import CARRY, ENV, apt_install, deb, sh, step, uplink  # noqa: E402

BOX = "/sys/fs/cgroup/systemd-box"          # the v2 VM's cgroup2 root is /sys/fs/cgroup
ENABLED = ("starter-netd.service", "starter-gc.timer")
INSTALLED = ("starter-metrics.service", "starter-metrics-textfile.timer")
# In the box's mount namespace: a fresh /proc (unshare), a cgroup2 mount that
# shows the box's cgroup as its root, and a /run of its own.
INIT = ("umount -l /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup"
        " && mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run"
        " && exec /lib/systemd/systemd --unit=multi-user.target --show-status=0 --log-level=warning")
NAT_JOB = """[Service]
Type=oneshot
Delegate=yes
StandardOutput=file:/var/tmp/nat-job.out
ExecStart=/usr/bin/starter run --net nat --uplink up0 --pool 10.231.0.0/16 -- ip -4 -o addr show eth0
"""


def install_systemd():
    where = os.path.join(CARRY, "systemd")
    sh("dpkg", "-i", *sorted(os.path.join(where, n) for n in os.listdir(where)))
    # No login prompt on the VM's serial console.
    for unit in ("console-getty.service", "getty.target", "getty@.service"):
        link = f"/etc/systemd/system/{unit}"
        if not os.path.lexists(link):
            os.symlink("/dev/null", link)


def boot():
    os.mkdir(BOX)

    def into_box():
        with open(os.path.join(BOX, "cgroup.procs"), "w") as f:
            f.write("0")

    log = open("/tmp/systemd-box.log", "w")
    outer = subprocess.Popen(
        ["unshare", "--pid", "--mount", "--cgroup", "--uts", "--ipc", "--fork", "--mount-proc",
         "--propagation", "private", "--", "sh", "-c", INIT],
        env={**ENV, "container": "starter-vm"}, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        preexec_fn=into_box)
    deadline = time.monotonic() + 30
    while True:
        with open(f"/proc/{outer.pid}/task/{outer.pid}/children") as f:
            kids = f.read().split()
        if kids:
            break
        assert outer.poll() is None and time.monotonic() < deadline, open("/tmp/systemd-box.log").read()
        time.sleep(0.05)
    # unshare itself leaves the box (it stays outside the box's namespaces):
    # the box's cgroup then holds systemd alone, which may enable controllers
    # for its children only in a cgroup with no process of its own.
    with open("/sys/fs/cgroup/cgroup.procs", "w") as f:
        f.write(str(outer.pid))
    return outer, int(kids[0])


def main():
    step("systemd")
    install_systemd()
    outer, pid1 = boot()

    def box(*argv, ok=True, **kw):
        return sh("nsenter", "-t", str(pid1), "-m", "-p", "-C", "-u", "-i", "--", *argv, ok=ok, **kw)

    def prop(unit, name):
        return box("systemctl", "show", "-P", name, unit).stdout.strip()

    try:
        deadline = time.monotonic() + 120
        while (state := box("systemctl", "is-system-running", "--wait", ok=False).stdout.strip()) in ("", "offline"):
            assert time.monotonic() < deadline, "systemd in the box did not come up"
            time.sleep(0.2)      # not yet listening on its socket
        print("systemd in the box:", box("systemctl", "--version").stdout.splitlines()[0] + ";", state)
        if state != "running":
            print(box("systemctl", "--failed", "--no-legend", ok=False).stdout)

        step("install")
        apt_install(deb(1), run=box)
        for unit in ENABLED:
            assert box("systemctl", "is-enabled", unit).stdout.strip() == "enabled", unit
            box("systemctl", "is-active", "--quiet", unit)
        for unit in INSTALLED:
            assert box("systemctl", "is-enabled", unit, ok=False).stdout.strip() == "disabled", unit
        print(box("systemctl", "status", "--no-pager", "--lines=0", *ENABLED).stdout)
        netd = prop("starter-netd.service", "MainPID")
        box("test", "-S", "/run/starter/netd.sock")      # where every starter asks

        # A NAT job through the unit's netd, run by a service with a delegated
        # cgroup, as a batch system's daemon is (no D-Bus here for systemd-run).
        uplink()
        with open("/etc/systemd/system/starter-nat-job.service", "w") as f:
            f.write(NAT_JOB)
        box("systemctl", "daemon-reload")
        box("systemctl", "start", "starter-nat-job.service")     # oneshot: returns when it ended
        with open("/var/tmp/nat-job.out") as f:
            out = f.read()
        assert " inet 10.231." in out, (out, box("systemctl", "status", "starter-nat-job", ok=False).stdout)
        os.unlink("/etc/systemd/system/starter-nat-job.service")
        box("systemctl", "daemon-reload")
        print("a NAT job under systemd, through the unit's netd:", out.split()[3])

        step("upgrade")
        apt_install(deb(2), run=box)
        box("systemctl", "is-active", "--quiet", *ENABLED)
        after = prop("starter-netd.service", "MainPID")
        assert after not in ("0", netd), (netd, after)
        print(f"netd restarted by the upgrade: pid {netd} -> {after}")

        step("remove")
        box("apt-get", "remove", "-y", "-q", "starter")
        for unit in ENABLED + INSTALLED:
            assert box("systemctl", "is-active", unit, ok=False).stdout.strip() == "inactive", unit
        print("apt remove stopped the units")

        step("purge")
        box("apt-get", "purge", "-y", "-q", "starter")
        left = box("systemctl", "list-unit-files", "--no-legend", "starter*", ok=False).stdout.strip()
        assert not left, left
        links = sh("find", "/etc/systemd", "-name", "starter*").stdout.split()
        assert not links, links
        print("apt purge left no unit file and no enablement link")
    finally:
        box("systemctl", "poweroff", ok=False)
        try:
            outer.wait(60)
        finally:
            if outer.poll() is None:
                outer.kill()



if __name__ == "__main__":
    main()

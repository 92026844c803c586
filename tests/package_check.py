"""The Debian package in a fresh VM boot with no package index (issue 27):
scripts/vm-package-test builds two revisions of it (scripts/build-deb) and
runs this in the v2 VM with them in /job/carry.  Not a pytest module: it
installs into the VM's own system, which only a throwaway boot may do.

  install   apt install ./starter_*-1.deb with no network: /usr/bin/starter
            (set-user-ID root), the job account, the bundle postinst made
  run       `starter run -- id` as root and as an ordinary user, under the
            package's (empty) node policy: a transient uid, and the caller's
  nat       a NAT job through `starter netd` (a dummy uplink: the VM has no
            network), its address; `starter metrics`
  upgrade   a job started before `apt install` of revision 2 ends with its
            report after it
  purge     on a busy node the account stays and the message says why; on an
            idle node no file, account or state of starter is left
  wheel     the wheelhouse (scripts/build-wheel, in /job/carry/wheelhouse)
            installs into a fresh venv with `pip install --no-index`, and its
            `starter` runs a job.
No systemd runs in the VM (vm-init is PID 1): the units are checked as
installed files here, and under a systemd of their own by
tests/package_units.py."""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import wait_running  # noqa: E402  (the checkout's starter.state reads the entry)

CARRY = sys.argv[1] if len(sys.argv) > 1 else "/job/carry"
STARTER = "/usr/bin/starter"
ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}


def sh(*argv, ok=True, **kw):
    p = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=600, **kw)
    if ok and p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def deb(rev):
    (name,) = [n for n in os.listdir(CARRY) if n.endswith(f"-{rev}_amd64.deb")]
    return os.path.join(CARRY, name)


def apt_install(path, run=sh):
    # No index, no network: everything it depends on is already installed.
    # apt takes a local package from a local file system (not the 9p share;
    # the root disk's /var/tmp, which package_units.py's systemd box sees too).
    local = os.path.join("/var/tmp", os.path.basename(path))
    sh("cp", path, local)
    return run("apt-get", "install", "-y", "-q", local)


def uplink():
    """up0, a dummy uplink for NAT jobs (the VM has no network), once."""
    if not os.path.exists("/sys/class/net/up0"):
        sh("ip", "link", "add", "up0", "type", "dummy")
        sh("ip", "link", "set", "up0", "up")
        sh("ip", "addr", "add", "198.51.100.1/24", "dev", "up0")


def step(name):
    print(f"== {name}", flush=True)


def main():
    step("install")
    apt_install(deb(1))
    st = os.stat(STARTER)
    assert st.st_uid == 0 and st.st_mode & 0o4000, oct(st.st_mode)
    assert sh("getent", "passwd", "starter-job").stdout.startswith("starter-job:")
    assert os.path.exists("/usr/lib/starter/starter/__pycache__/bundle.cpython-311")
    for unit in ("starter-netd.service", "starter-gc.timer", "starter-metrics.service"):
        assert os.path.exists(f"/lib/systemd/system/{unit}"), unit
    print(sh("dpkg-query", "-W", "starter").stdout.strip())

    step("run")
    p = sh(STARTER, "run", "--", "id")
    assert "uid=" in p.stdout and "uid=0(" not in p.stdout, p.stdout
    print("root's job:", p.stdout.strip())
    p = sh("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", STARTER, "run", "--", "id", "-u",
           cwd="/tmp")
    assert p.stdout.strip() == "65534", (p.stdout, p.stderr)
    print("a user's job: uid", p.stdout.strip())
    assert sh(STARTER, "run", "--", "sh", "-c", "exit 3", ok=False).returncode == 3

    step("nat")
    uplink()
    netd = subprocess.Popen([STARTER, "netd"], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists("/run/starter/netd.sock"):
            assert netd.poll() is None and time.monotonic() < deadline, netd.communicate()
            time.sleep(0.1)
        p = sh(STARTER, "run", "--net", "nat", "--uplink", "up0", "--pool", "10.231.0.0/16", "--report", "/tmp/nat.json",
               "--", "ip", "-4", "-o", "addr", "show", "eth0")
        assert " inet 10.231." in p.stdout, p.stdout
        with open("/tmp/nat.json") as f:
            assert json.load(f).get("network"), "the report has no network object"
        print("a NAT job through netd:", p.stdout.split()[3])
        m = sh(STARTER, "metrics")
        assert "starter_" in m.stdout, m.stdout[:500]
    finally:
        netd.terminate()
        netd.wait(60)

    step("upgrade")
    job = subprocess.Popen([STARTER, "run", "--id", "across", "--report", "/tmp/up.json", "--", "sleep", "6"],
                           env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_running("/run/starter", "across", job)
    apt_install(deb(2))
    assert sh("dpkg-query", "-W", "-f", "${Version}", "starter").stdout == "0.1.0-2"
    assert job.wait(120) == 0, job.stderr.read()
    with open("/tmp/up.json") as f:
        r = json.load(f)
    assert r["reason"] == "exited" and r["exit_code"] == 0, r
    print("a job started before the upgrade ended after it with its report")

    step("purge")
    job = subprocess.Popen([STARTER, "run", "--id", "busy", "--", "sleep", "8"], env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_running("/run/starter", "busy", job)
    p = sh("apt-get", "purge", "-y", "-q", "starter")
    said = [line for line in (p.stdout + p.stderr).splitlines() if "still run" in line]   # dpkg's output: either
    assert len(said) == 2, (p.stdout, p.stderr)          # prerm's and postrm's
    assert sh("getent", "passwd", "starter-job", ok=False).returncode == 0, "the account went with a job running"
    job.wait(120)
    print("a busy purge kept the account:", *said, sep="\n  ")
    apt_install(deb(2))
    sh("apt-get", "purge", "-y", "-q", "starter")
    left = [x for x in ("/usr/bin/starter", "/usr/lib/starter", "/etc/starter", "/run/starter",
                        "/lib/systemd/system/starter-netd.service", "/usr/share/doc/starter") if os.path.exists(x)]
    assert not left, left
    assert sh("getent", "passwd", "starter-job", ok=False).returncode != 0
    assert sh("dpkg-query", "-W", "starter", ok=False).returncode != 0
    cgroups = sh("find", "/sys/fs/cgroup", "-name", "*starter*").stdout.split()
    assert not cgroups, cgroups
    print("an idle purge left nothing: no file, account, state or cgroup")

    step("wheel")
    venv = "/tmp/wheel-venv"
    sh("python3", "-m", "venv", venv)
    sh(f"{venv}/bin/pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--find-links",
       os.path.join(CARRY, "wheelhouse"), "starter")
    p = sh(f"{venv}/bin/starter", "run", "--report", "/tmp/wheel.json", "--", "id", "-u")
    with open("/tmp/wheel.json") as f:
        r = json.load(f)
    assert r["exit_code"] == 0 and p.stdout.strip() not in ("", "0"), (p.stdout, r)
    print("the wheel, installed with no index, ran a job as uid", p.stdout.strip())
    sh("rm", "-rf", venv)
    cgroups = sh("find", "/sys/fs/cgroup", "-name", "*starter*").stdout.split()
    assert not cgroups, cgroups


if __name__ == "__main__":
    main()

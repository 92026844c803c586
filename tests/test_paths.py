"""Every path the starter opens as root for a job is resolved without
following the job's links: the report and events files, bind sources, --cwd.

The job is hostile: it runs as `nobody` and may write the directory the
report goes to (bind-mounted at /mnt), so during its run it plants links
there, swaps directory components for links to /etc, or leaves a FIFO.
"""

import json
import os
import secrets
import subprocess
import time

import pytest

USER = ("--user", "nobody")


@pytest.fixture
def out(tmp_path):
    """A directory the job can write, shown to it at /mnt."""
    d = tmp_path / "out"
    d.mkdir()
    d.chmod(0o777)
    return d


def _name():
    return f"starter-test-{secrets.token_hex(4)}.json"


@pytest.fixture
def etc_name():
    """A name that must never appear in /etc; removed if a bug put it there."""
    name = _name()
    yield name
    for n in (name, name.replace(".json", ".jsonl")):
        if os.path.lexists(f"/etc/{n}"):
            os.unlink(f"/etc/{n}")
            pytest.fail(f"the starter wrote /etc/{n}")


def _one_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# ---------------------------------------------------------------- report

def test_link_planted_at_the_report_path_during_the_run_is_replaced(starter, out, tmp_path, etc_name):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    report = out / etc_name
    p = starter("run", *USER, "--bind", f"{out}:/mnt", "--report", str(report), "--",
                "ln", "-s", str(victim), f"/mnt/{etc_name}")
    assert p.returncode == 0, p.stderr
    assert victim.read_text() == "precious\n"
    assert not report.is_symlink() and json.loads(report.read_text())["exit_code"] == 0


def test_directory_swapped_for_a_link_during_the_run_is_not_followed(starter, out, etc_name):
    """The job replaces the report's directory with a link to /etc: the report
    goes into the real directory (the starter holds it since the start)."""
    (out / "sub").mkdir()
    (out / "sub").chmod(0o777)
    report = out / "sub" / etc_name
    events = out / "sub" / etc_name.replace(".json", ".jsonl")
    p = starter("run", *USER, "--bind", f"{out}:/mnt", "--report", str(report), "--events", str(events),
                "--", "sh", "-c", "mv /mnt/sub /mnt/sub.old && ln -s /etc /mnt/sub")
    assert p.returncode == 0, p.stderr
    assert (out / "sub").is_symlink()
    moved = out / "sub.old"
    assert json.loads((moved / etc_name).read_text())["exit_code"] == 0
    kinds = [json.loads(l)["event"] for l in (moved / events.name).read_text().splitlines()]
    assert kinds[-1] == "exited", kinds
    assert not os.path.lexists(f"/etc/{etc_name}")


def test_events_file_swapped_for_a_link_during_the_run_is_not_followed(starter, out, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    events = out / "e.jsonl"
    p = starter("run", *USER, "--bind", f"{out}:/mnt", "--events", str(events), "--",
                "sh", "-c", f"rm /mnt/e.jsonl && ln -s {victim} /mnt/e.jsonl")
    assert p.returncode == 0, p.stderr
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("opt", ["--report", "--events"])
def test_link_at_a_directory_component_is_refused_before_the_job_runs(starter, out, opt):
    (out / "real").mkdir()
    (out / "link").symlink_to(out / "real")
    marker = out / "ran"
    p = starter("run", *USER, "--bind", f"{out}:/mnt", opt, str(out / "link" / "r.json"),
                "--", "touch", "/mnt/ran")
    assert p.returncode == 125
    line = _one_line(p.stderr)
    assert f"{out}/link is a symlink (not followed)" in line and f"{out}/real/r.json" in line, line
    assert not marker.exists()
    assert os.listdir(out / "real") == []


def test_link_at_the_events_path_is_refused(starter, out, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (out / "e.jsonl").symlink_to(victim)
    p = starter("run", *USER, "--events", str(out / "e.jsonl"), "--", "true")
    assert p.returncode == 125 and "symlink" in _one_line(p.stderr)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("opt", ["--report", "--events"])
def test_fifo_at_the_path_is_refused_without_blocking(starter, out, opt):
    os.mkfifo(out / "r.json")
    t0 = time.monotonic()
    p = starter("run", *USER, opt, str(out / "r.json"), "--", "true", timeout=10)
    assert time.monotonic() - t0 < 5
    assert p.returncode == 125 and "is a FIFO, not a regular file" in _one_line(p.stderr)


def test_fifo_planted_by_the_job_does_not_block_the_starter(starter, out):
    report = out / "r.json"
    t0 = time.monotonic()
    p = starter("run", *USER, "--bind", f"{out}:/mnt", "--report", str(report), "--",
                "mkfifo", "/mnt/r.json", timeout=10)
    assert time.monotonic() - t0 < 5
    assert p.returncode == 0  # the job's own outcome
    assert "cannot write report" in _one_line(p.stderr) and "FIFO" in p.stderr
    assert report.is_fifo()  # left alone


def test_dev_stdout_and_fd_are_written_in_place(starter):
    p = starter("run", *USER, "--report", "/dev/stdout", "--", "true", check=0)
    assert json.loads(p.stdout)["exit_code"] == 0
    p = starter("run", *USER, "--report", "fd:2", "--events", "/dev/stderr", "--", "true", check=0)
    events = [json.loads(l) for l in p.stderr.splitlines()]
    assert [e.get("event") for e in events][:2] == ["starting", "running"]


# ---------------------------------------------------------------- binds

@pytest.mark.parametrize("kind", ["--bind", "--ro-bind"])
def test_bind_source_with_a_link_component_is_refused(starter, tmp_path, kind):
    (tmp_path / "real" / "data").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    marker = tmp_path / "ran"
    p = starter("run", *USER, kind, f"{tmp_path}/link/data:/mnt", "--bind", f"{tmp_path}:/t",
                "--", "touch", "/t/ran")
    assert p.returncode == 125
    line = _one_line(p.stderr)
    assert f"{tmp_path}/link is a symlink (not followed)" in line, line
    assert f"if the link is yours, give the real path (it leads to {tmp_path}/real/data)" in line, line
    assert not marker.exists()


def test_bind_source_that_is_a_link_is_refused(starter, tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "l").symlink_to("/etc/shadow")
    p = starter("run", *USER, "--ro-bind", f"{tmp_path}/l:/mnt/x", "--", "true")
    assert p.returncode == 125 and "is a symlink" in _one_line(p.stderr)


def test_bind_of_a_shared_mount_does_not_propagate_back(starter, tmp_path):
    """The tree is cloned in the starter's namespace, so it starts as a peer
    of a shared source; the job must see it as a slave."""
    src = tmp_path / "shared"
    src.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(src)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(src)], check=True)
        p = starter("run", *USER, "--bind", f"{src}:/mnt", "--", "grep", " /mnt ", "/proc/self/mountinfo", check=0)
        fields = p.stdout.split(" - ")[0].split()
        assert not any(f.startswith("shared:") for f in fields), p.stdout
        assert any(f.startswith("master:") for f in fields), p.stdout
    finally:
        subprocess.run(["umount", str(src)], check=True)


# ---------------------------------------------------------------- cwd

@pytest.mark.parametrize("cwd", ["/proc/self/cwd", "/proc/1/cwd", "/proc/self/root/etc", "/sys/kernel", "/dev/fd/3"])
def test_cwd_under_proc_sys_or_dev_fd_is_refused(starter, cwd):
    p = starter("run", *USER, "--cwd", cwd, "--", "pwd")
    assert p.returncode == 125 and "magic links" in _one_line(p.stderr)
    assert p.stdout == ""


def test_cwd_elsewhere_still_works(starter, tmp_path):
    p = starter("run", "--user", "root", "--cwd", "/usr", "--", "pwd", check=0)
    assert p.stdout.strip() == "/usr"


# ---------------------------------------------------------------- binds, in the shim

@pytest.fixture
def no_open_tree():
    """As on a kernel without open_tree: bind sources mounted by path, then
    checked against the fd the starter resolved."""
    from starter._native import lib

    lib.shim_test_no_open_tree(1)
    yield
    lib.shim_test_no_open_tree(0)


def _spawn_cat(mounts, path):
    from conftest import spawn_output

    return spawn_output(["cat", path], mounts=mounts)


def test_bind_by_path_fallback_mounts_the_resolved_source(tmp_path, no_open_tree):
    from starter.isolate.mounts import Mount

    src = tmp_path / "src"
    src.mkdir(mode=0o755)
    (src / "f").write_text("mine\n")
    (src / "f").chmod(0o644)
    status, out = _spawn_cat((Mount("ro-bind", "/mnt", str(src)),), "/mnt/f")
    assert status == 0 and out == b"mine\n"


def test_bind_by_path_fallback_refuses_a_source_that_changed(tmp_path, no_open_tree, monkeypatch):
    """The path no longer leads to the inode the starter resolved (a link was
    swapped in between): the child refuses it, the job does not start."""
    from starter.storage import paths
    from starter.errors import SpawnError
    from starter.isolate.mounts import Mount

    (tmp_path / "f").write_text("mine\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = paths.open_path
    monkeypatch.setattr(paths, "open_path", lambda p, what: real(str(elsewhere), what))
    with pytest.raises(SpawnError) as e:
        _spawn_cat((Mount("bind", "/mnt", str(tmp_path)),), "/mnt/f")
    assert e.value.step == f"bind source changed while resolving {tmp_path}" and e.value.exit_code == 125


# ---------------------------------------------------------------- the walk itself

def test_walk_refuses_links_fifos_relative_and_dotdot(tmp_path):
    from starter.storage import paths

    (tmp_path / "d").mkdir()
    (tmp_path / "l").symlink_to(tmp_path / "d")
    os.mkfifo(tmp_path / "d" / "fifo")
    os.close(paths.open_dir(str(tmp_path / "d")))
    for bad, msg in ((f"{tmp_path}/l", "is a symlink"), ("rel/path", "absolute"),
                     (f"{tmp_path}/d/../d", "'..'"), (f"{tmp_path}/d/fifo", "is a FIFO, not a directory")):
        with pytest.raises(paths.LinkError, match=msg):
            paths.open_dir(bad)
    t0 = time.monotonic()
    with pytest.raises(paths.LinkError, match="is a FIFO, not a regular file"):
        paths.open_file(f"{tmp_path}/d/fifo")
    assert time.monotonic() - t0 < 1
    fd = paths.open_dir(str(tmp_path / "new"), create=0o755, readable=True)
    try:
        assert os.listdir(fd) == []
    finally:
        os.close(fd)

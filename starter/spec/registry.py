"""Every option of `starter run`, once: how the command line takes it, its
key in a job file, its key in the node policy's [defaults] (and the check
its value gets there), the [callers] key that caps or allows it for a caller
that is not root, and who may set it at all.  The command line (cli/main.py),
the job file (jobfile.py), the policy (callers/policy.py) and the reference's
table of where each option is set (docs/reference.md; `python -m
starter.spec.registry` prints it) all read this table; none keeps a list of
its own.  Pure data: imported on every start, it imports nothing.
"""


class Option:
    """name: the run option without its dashes.  kind: how the command line
    takes it (flag, value, multi: repeatable, mount: repeatable, into the
    mount list).  file: its job-file key ("section.key" inside limits or
    network; "mounts" and "rlimits" are read by jobfile.py itself).
    default: ([defaults] key, the policy's check of its value), or None.
    caller: the [callers] key that caps its value (max_*) or allows the flag.
    who: any caller; root (only root sets it); nat (root only, and only
    meaningful for a NAT job); job (root only, --net job only).  help: `starter run --help`'s line."""

    __slots__ = ("name", "kind", "file", "default", "caller", "who", "help")

    def __init__(self, name, kind, file, default, caller, who, help):
        self.name, self.kind, self.file, self.default = name, kind, file, default
        self.caller, self.who, self.help = caller, who, help


OPTIONS = (
    Option("job", "value", None, None, None, "any",
           "FILE  JSON job description; options given here override it"),
    Option("id", "value", "id", None, None, "any",
           "ID  job id (default: random); [A-Za-z0-9_.-], at most 64"),
    Option("user", "value", "user", ("user", "user"), None, "any",
           "USER  run as this user (name or uid; default: the starter-job account; root only if named)"),
    Option("group", "value", "group", None, None, "any",
           "GROUP  primary group (default: the user's)"),
    Option("userns-root", "flag", "userns_root", None, "userns_root", "any",
           "be uid 0 in a user namespace that maps 0 to the job's user (not host root)"),
    Option("rlimit", "multi", "rlimits", ("rlimits", "rlimits"), None, "any",
           "NAME=SOFT[:HARD]  resource limit (repeatable), e.g. nofile=4096:65536, core=unlimited"),
    Option("cwd", "value", "cwd", None, None, "any",
           "DIR  working directory inside the job (default: the scratch, else the caller's if the job can enter it, else home, else /)"),
    Option("env", "multi", "env", None, None, "any",
           "K=V  set a variable (repeatable); the job gets only these plus HOME/USER/PATH"),
    Option("net", "value", "network.mode", None, None, "any",
           "MODE  none (default: own namespace, loopback only), host, nat"),
    Option("hostname", "value", "hostname", None, None, "any",
           "NAME  host name inside the job (own UTS namespace)"),
    Option("bind", "mount", "mounts", None, None, "any",
           "SRC[:DST]  bind mount (repeatable)"),
    Option("ro-bind", "mount", "mounts", None, None, "any",
           "SRC[:DST]  read-only bind mount (repeatable)"),
    Option("tmpfs", "mount", "mounts", None, None, "any",
           "DST[:OPTS]  a tmpfs (size=,mode=,nr_inodes=)"),
    Option("device", "multi", "devices", None, None, "any",
           "PATH[:rwm]  pass a device node, bound at its path (repeatable; access read, write, mknod; default rw)"),
    Option("gpus", "value", "gpus", ("gpus", "gpus"), None, "any",
           "LIST  NVIDIA GPUs by index or UUID (0,1 | GPU-... | all) and their control nodes; sets CUDA_VISIBLE_DEVICES"),
    Option("init", "flag", "init", None, "init", "any",
           "keep a tiny init as PID 1 (reaps orphans, forwards signals)"),
    Option("seccomp", "value", "seccomp", ("seccomp", "profile"), None, "any",
           "default|off|FILE  syscall filter (default: the built-in profile)"),
    Option("require", "multi", "require", None, None, "any",
           "LIST  refuse the job unless these are enforced (memory,cpu,pids,kill,freeze,accounting,own-uid,"
           "network; or all): for a starter without root"),
    Option("allow-userns", "flag", "allow_userns", None, "allow_userns", "any",
           "let the job create user namespaces (unprivileged container runtimes)"),
    Option("memory", "value", "limits.memory", ("memory", "size"), "max_memory", "any",
           "SIZE  memory limit, no swap beyond it (e.g. 512M)"),
    Option("cpus", "value", "limits.cpus", ("cpus", "cpus"), "max_cpus", "any",
           "N  cpu quota in cores (e.g. 1.5)"),
    Option("cpu-weight", "value", "limits.cpu_weight", ("cpu_weight", "weight"), None, "any",
           "N  cpu weight 1..10000 (default 100)"),
    Option("cpuset", "value", "limits.cpuset", None, None, "any",
           "LIST  CPUs the job may run on, e.g. 0,2-3 (within its cgroup parent's)"),
    Option("mems", "value", "limits.mems", None, None, "any",
           "LIST  NUMA memory nodes the job may use, e.g. 0"),
    Option("io-max", "multi", "limits.io_max", None, None, "any",
           "DEV:KEY=V,..  block I/O limit (repeatable); KEY rbps, wbps (bytes/s, e.g. 10M), riops, wiops"),
    Option("pids", "value", "limits.pids", ("pids", "count"), "max_pids", "any",
           "N  most processes/threads at once"),
    Option("wall-time", "value", "limits.wall_time", ("wall_time", "duration"), "max_wall_time", "any",
           "SECONDS  wall-clock limit; then the job is killed (reason timeout)"),
    Option("delegate", "flag", "delegate", None, "delegate", "any",
           "give the job its cgroup subtree to manage (pilots; cgroup v2 with nsdelegate only)"),
    Option("oom-policy", "value", "oom_policy", None, None, "any",
           "kill|continue  kill: an OOM kill of any process ends the job (reason oom; default); continue: only that process dies"),
    Option("grace", "value", "grace", ("grace", "duration"), None, "any",
           "SECONDS  vacate: time between SIGTERM and the kill (default 10)"),
    Option("on-signal", "multi", "on_signal", None, None, "any",
           "SIG=ACTION  map a signal to vacate|suspend|resume|kill"),
    Option("report", "value", "report", None, None, "any",
           "FILE|fd:N  write the JSON usage report here when the job ends"),
    Option("report-format", "value", "report_format", None, None, "any",
           "FMT  json (default) or classad (HTCondor job attributes)"),
    Option("events", "value", "events", None, None, "any",
           "FILE|fd:N  write JSON lines, one per state change"),
    Option("state-dir", "value", "state_dir", ("state_dir", "dir"), None, "root",
           "DIR  per-job state (default /run/starter)"),
    Option("cgroup-parent", "value", "cgroup_parent", None, None, "root",
           "PATH  job cgroups' parent: a NAME goes under the starter's own cgroup (default: starter), a /PATH (must exist) is used as is"),
    Option("lan", "multi", "network.lan", ("lan", "cidrs"), None, "nat",
           "CIDR  network counted as LAN (repeatable, IPv4 or IPv6); the rest is WAN"),
    Option("pool", "value", "network.pool", ("pool", "cidr"), None, "nat",
           "CIDR  address pool for job networks (default 10.213.0.0/16)"),
    Option("pool6", "value", "network.pool6", ("pool6", "cidr"), None, "nat",
           "CIDR  IPv6 unique local pool for job networks (default fd70:7639:1864::/64)"),
    Option("ipv6", "value", "network.ipv6", ("ipv6", "ipv6"), None, "nat",
           "auto|on|off  IPv6 for NAT jobs: auto (default) where an uplink has IPv6; on: required"),
    Option("uplink", "multi", "network.uplink", ("uplink", "ifnames"), None, "nat",
           "IFACE  interface jobs are NATed out of (repeatable: each destination leaves by the host's routing)"),
    Option("allow-host-port", "multi", "network.allow_host_ports", ("allow_host_ports", "ports"), None, "nat",
           "PROTO:PORT  let jobs reach this port on the host"),
    Option("net-rate", "value", "network.rate", ("net_rate", "netrate"), "max_net_rate", "any",
           "RATE|SCOPE=RATE,..  bandwidth caps, shaped by the kernel; SCOPE all, in, out, lan, wan, lan-in, lan-out, wan-in, wan-out (e.g. 100mbit, out=50mbit,lan=1gbit)"),
    Option("resolver", "value", "network.resolver", ("resolver", "ip"), None, "nat",
           "IP  name server (IPv4 or IPv6) written to the job's /etc/resolv.conf"),
    Option("env-pass", "multi", "env_pass", None, None, "any",
           "NAME|PREFIX*  copy these of the caller's environment into the job's (--env wins; --net job passes SLURM_*, PMIX_*, PMI_* itself)"),
    Option("peers", "value", "network.peers", None, None, "job",
           "HOSTLIST  --net job: the job's nodes, NAME or NAME=ADDRESS, Slurm's [] ranges (default $SLURM_JOB_NODELIST)"),
    Option("net-id", "value", "network.net_id", None, None, "job",
           "ID  --net job: the job network's id, the same on every node (default $SLURM_JOB_ID)"),
    Option("node", "value", "network.node", None, None, "job",
           "NAME  --net job: this node's name in --peers (default $SLURMD_NODENAME, else the host name)"),
    Option("net-transport", "value", "network.transport", ("net_transport", "transport"), None, "job",
           "vxlan|wireguard  --net job: how the job network crosses the fabric: vxlan (default), or wireguard (encrypted, per-job keys)"),
    Option("net-key", "value", "network.net_key", ("net_key", "file"), None, "job",
           "FILE  --net-transport wireguard: the node network key, the same on every node (default /etc/starter/network.key)"),
    Option("scratch", "value", "scratch", None, None, "any",
           "DIR  fresh private working directory, removed at the end"),
    Option("execute-dir", "value", "execute_dir", ("execute_dir", "dir"), None, "any",
           "DIR  make the scratch directory as DIR/job-ID"),
    Option("keep-scratch", "flag", "keep_scratch", None, None, "any",
           "keep the scratch directory of a job that ran"),
    Option("disk", "value", "limits.disk", ("disk", "size"), "max_disk", "any",
           "SIZE  the scratch is a file system of this size (e.g. 20G): writes past it fail (ENOSPC)"),
    Option("disk-inodes", "value", "limits.disk_inodes", ("disk_inodes", "inodes"), None, "any",
           "N  with --disk: at least this many files and directories (default: one per 16 KiB)"),
    Option("on-vacate", "value", None, None, None, "root",
           "checkpoint:DIR  a vacate first dumps the job to DIR with CRIU (bounded by --grace; if it fails: the ordinary vacate)"),
    Option("checkpoint-every", "value", None, None, None, "root",
           "DURATION  with --on-vacate checkpoint:DIR, also dump the running job there this often (the last good image is kept)"),
    Option("image-cache", "value", "image_cache", ("image_cache", "dir"), None, "root",
           "DIR  the node's image cache, where --image finds and imports images (default $STARTER_IMAGE_CACHE, else /var/lib/starter/images)"),
    Option("image-digest", "value", "image_digest", None, None, "any",
           "sha256:HEX  with --image FILE: the digest the image must have (pinned), else the job is refused"),
    Option("image", "value", "image", None, None, "any",
           "REF  the job's root: an image of the node's cache (sha256:HEX) or a squashfs or SIF file (imported first); read-only, the job's writes in a tmpfs of its own"),
    Option("restore", "value", None, None, None, "any",
           "DIR  restore the job checkpointed to DIR (`starter checkpoint`), no CMD"),
    Option("manifest", "value", "manifest", None, None, "any",
           "FILE  signature file listing the inputs (sha256sum format)"),
    Option("manifest-digest", "value", "manifest_digest", None, None, "any",
           "SHA256  trusted digest of the signature file"),
    Option("inputs", "value", "inputs", None, None, "any",
           "DIR  where the manifest's files are read from"),
)

BY_NAME = {o.name: o for o in OPTIONS}


def cli_table():
    """{"--name": (name, kind, help)}: the parser's table (cli/parse.py)."""
    return {"--" + o.name: (o.name, o.kind, o.help) for o in OPTIONS}


def file_keys(section=""):
    """{job-file key: option} in `section` (limits, network) or at the top ("")."""
    out = {}
    for o in OPTIONS:
        if o.file is None:
            continue
        sec, _, key = o.file.rpartition(".")
        if sec == section:
            out[key] = o.name
    return out


def policy_defaults():
    """{[defaults] key: (option, check)}."""
    return {o.default[0]: (o.name, o.default[1]) for o in OPTIONS if o.default}


def caller_caps():
    """{option: [callers] max_* key} for the value options a caller's policy caps."""
    return {o.name: o.caller for o in OPTIONS if o.caller and o.kind != "flag"}


def cap_kinds():
    """{[callers] max_* key: the check its value gets}: the capped option's
    own [defaults] check (a maximum is a value of the option)."""
    return {o.caller: o.default[1] for o in OPTIONS if o.caller and o.kind != "flag"}


def caller_flags():
    """{flag: [callers] key that allows it}."""
    return {o.name: o.caller for o in OPTIONS if o.caller and o.kind == "flag"}


def root_only():
    return tuple(o.name for o in OPTIONS if o.who in ("root", "nat", "job"))


def job_only():
    return tuple(o.name for o in OPTIONS if o.who == "job")


def nat_only():
    return tuple(o.name for o in OPTIONS if o.who == "nat")


def markdown_table():
    """The reference's table of where each option is set (docs/reference.md)."""
    def code(x):
        return f"`{x}`" if x else "-"

    who = {"any": "any caller", "root": "root", "nat": "root (NAT jobs)", "job": "root (--net job)"}
    lines = ["| option | job file | [defaults] | [callers] | who |", "| --- | --- | --- | --- | --- |"]
    for o in OPTIONS:
        lines.append(f"| `--{o.name}` | {code(o.file)} | {code(o.default and o.default[0])} | "
                     f"{code(o.caller)} | {who[o.who]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(markdown_table())

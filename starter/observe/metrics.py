"""`starter metrics`: every job on the node in the Prometheus text format.

One pass: the state directory is listed once; for each entry its JSON, its
lock (live or not), its cgroup files (the same reads as `status`), and for a
NAT job its five nft counters, asked of the kernel by name (one
NFT_MSG_GETOBJ each, starter/net/nft.py).  No pyroute2, no `nft list`, no
psutil.  Three ways out:

    starter metrics                       print once (exposition format 0.0.4)
    starter metrics --textfile DIR        write DIR/starter.prom atomically, for
                                          node_exporter's textfile collector
    starter metrics --listen [ADDR:]PORT  serve GET /metrics (127.0.0.1 unless
                                          an address is given)

What a job controls never reaches a metric name; label values (job id, user,
state) are escaped as the exposition format says.  Schema: docs/reference.md,
"Metrics".
"""

import os
import sys

from starter.state import store as S
from starter.spec.options import NAT_MODES
from starter.errors import StarterError, one_line
from starter.fileio import unlink_quiet, write_all

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXTFILE_NAME = "starter.prom"
# Every state a job entry can be in: one 0/1 series each (the enum pattern),
# so a dashboard can sum by state without knowing which exist right now.
# "dead": the entry's lock is free (its starter is gone; gc reclaims it).
STATES = ("starting", "running", "suspended", "exited", "reclaiming", "dead")

# name -> (type, help).  Order here is the order of the output.
FAMILIES = {
    "starter_jobs": ("gauge", "Jobs on this node by state."),
    "starter_job_state": ("gauge", "1 for the state the job is in, 0 for the others."),
    "starter_job_image_info": ("gauge", "1 for a job that runs in an image (--image), by the image's digest."),
    "starter_job_start_time_seconds": ("gauge", "When the job's starter began, Unix time."),
    "starter_job_cpu_seconds_total": ("counter", "CPU time of every process the job ever had, by mode."),
    "starter_job_memory_bytes": ("gauge", "Memory the job's cgroup uses now."),
    "starter_job_memory_peak_bytes": ("gauge", "Most memory the job's cgroup has used."),
    "starter_job_pids": ("gauge", "Tasks (processes and threads) in the job now."),
    "starter_job_pids_peak": ("gauge", "Most tasks in the job at once."),
    "starter_job_io_bytes_total": ("counter", "Block-device bytes, by direction (read, write)."),
    "starter_job_oom_kills_total": ("counter", "Processes of the job killed by the OOM killer."),
    "starter_job_pressure_stall_seconds_total": ("counter", "Time the job stalled on a resource (PSI), by resource and kind."),
    "starter_job_network_bytes_total": ("counter", "Bytes through the job's NAT, by zone (lan, wan) and direction (in, out)."),
    "starter_job_network_packets_total": ("counter", "Packets through the job's NAT, by zone and direction."),
    "starter_job_network_dropped_packets_total": ("counter", "Packets of the job dropped by the isolation rules."),
    "starter_job_network_dropped_bytes_total": ("counter", "Bytes of the job dropped by the isolation rules."),
    "starter_job_network_rate_limit_bits": ("gauge", "The job's bandwidth cap (--net-rate) in bits/s, by zone and direction; capped zones only."),
    "starter_job_network_shaped_bytes_total": ("counter", "Bytes through the job's shaper, by zone and direction; capped zones only."),
    "starter_job_network_shaped_overlimits_total": ("counter", "Times a packet of the job had to wait for its cap, by zone and direction."),
    "starter_job_network_shaped_dropped_packets_total": ("counter", "Packets of the job its shaper dropped (queue full), by zone and direction."),
    "starter_job_network_peer_bytes_total": ("counter", "Bytes of a --net job job's part on this node to and from each other node of its job network (layer 3), by peer and direction."),
    "starter_job_network_peer_packets_total": ("counter", "Packets of a --net job job's part on this node to and from each other node, by peer and direction."),
    "starter_uplink_network_bytes_total": ("counter", "Bytes of all NAT jobs through each uplink, by direction (in, out); restarts at 0 when a NAT job starts on an idle node."),
    "starter_uplink_network_packets_total": ("counter", "Packets of all NAT jobs through each uplink, by direction."),
    "starter_metrics_read_errors": ("gauge", "Jobs whose cgroup or counters could not be read in this scrape."),
}


# ---------------------------------------------------------------- rendering (pure)

def escape_label(value):
    """A label value as the exposition format wants it: backslash, double
    quote and line feed escaped; everything else as is (UTF-8)."""
    return str(value).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _fmt(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def labels(**kw):
    """Label pairs -> the text between the braces, values escaped."""
    return ",".join(f'{k}="{escape_label(v)}"' for k, v in kw.items())


def render(samples):
    """samples: {family: [(label text, value), ...]} -> exposition text.
    Every family gets HELP and TYPE, then all its samples together."""
    out = []
    for name, (kind, text) in FAMILIES.items():
        rows = samples.get(name)
        if not rows:
            continue
        out.append(f"# HELP {name} {text}\n# TYPE {name} {kind}")
        out.extend(f"{name}{{{lab}}} {_fmt(value)}" if lab else f"{name} {_fmt(value)}" for lab, value in rows)
    return "\n".join(out) + "\n"


_STATE_LABELS = {s: f',state="{s}"' for s in STATES}


def job_samples(entry, live, usage, network):
    """One job's samples -> ({family: [(label text, value)]}, state) (pure).

    entry: its state JSON; usage: cgroup stats() or None; network: nft
    counters ({lan_in: {bytes, packets}, ...}) or None.  The job's labels
    are escaped once; the other label values are our own constants or the
    kernel's PSI keys."""
    user = entry.get("user")
    if user is None:
        user = entry.get("uid", "")
    base = labels(job_id=entry.get("id", ""), user=user)
    state = (entry.get("state") or "starting") if live else "dead"
    out = {}

    def add(name, value, extra=""):
        if value is not None:
            out.setdefault(name, []).append((base + extra, value))

    for s in STATES + ((state,) if state not in STATES else ()):
        add("starter_job_state", int(s == state), _STATE_LABELS.get(s) or "," + labels(state=s))
    add("starter_job_start_time_seconds", entry.get("started_at"))
    if entry.get("image"):
        add("starter_job_image_info", 1, "," + labels(digest=entry["image"]))
    if usage:
        add("starter_job_cpu_seconds_total", usage.get("cpu_user_s"), ',mode="user"')
        add("starter_job_cpu_seconds_total", usage.get("cpu_system_s"), ',mode="system"')
        add("starter_job_memory_bytes", usage.get("memory_current_bytes"))
        add("starter_job_memory_peak_bytes", usage.get("memory_peak_bytes"))
        add("starter_job_pids", usage.get("pids_current"))
        add("starter_job_pids_peak", usage.get("pids_peak"))
        add("starter_job_io_bytes_total", usage.get("io_read_bytes"), ',direction="read"')
        add("starter_job_io_bytes_total", usage.get("io_write_bytes"), ',direction="write"')
        add("starter_job_oom_kills_total", usage.get("oom_kills"))
        for res, kinds in sorted((usage.get("psi") or {}).items()):
            for kind, us in sorted(kinds.items()):
                add("starter_job_pressure_stall_seconds_total", us / 1e6, "," + labels(resource=res, kind=kind))
    if network:
        for key in ("lan_in", "lan_out", "wan_in", "wan_out"):
            c = network.get(key) or {}
            zone, direction = key.split("_")
            extra = f',zone="{zone}",direction="{direction}"'
            add("starter_job_network_bytes_total", c.get("bytes"), extra)
            add("starter_job_network_packets_total", c.get("packets"), extra)
        d = network.get("dropped") or {}
        add("starter_job_network_dropped_packets_total", d.get("packets"))
        add("starter_job_network_dropped_bytes_total", d.get("bytes"))
        for key, c in sorted((network.get("shaping") or {}).items()):
            zone, direction = key.split("_")
            extra = f',zone="{zone}",direction="{direction}"'
            add("starter_job_network_rate_limit_bits", c.get("rate_bits"), extra)
            add("starter_job_network_shaped_bytes_total", c.get("bytes"), extra)
            add("starter_job_network_shaped_overlimits_total", c.get("overlimits"), extra)
            add("starter_job_network_shaped_dropped_packets_total", c.get("dropped"), extra)
        for peer, row in sorted(((network.get("overlay") or {}).get("peers") or {}).items()):
            for direction in ("in", "out"):
                c = row.get(direction) or {}
                extra = "," + labels(peer=peer, direction=direction)
                add("starter_job_network_peer_bytes_total", c.get("bytes"), extra)
                add("starter_job_network_peer_packets_total", c.get("packets"), extra)
    return out, state


# ---------------------------------------------------------------- reading

def collect(state_dir):
    """Read every job once -> {family: [(label text, value)]}."""
    from starter.admin.live import job_cgroup

    samples, counts, errors = {}, dict.fromkeys(STATES, 0), 0
    backends, links = {}, []
    for job_id in S.list_ids(state_dir):
        entry = S.load(state_dir, job_id)
        if not entry:
            # Cut short or not JSON: a job of unknown owner while a root
            # process holds its lock; else ended since the listing.
            entry = S.unreadable(state_dir, job_id)
            if "starter_pid" not in entry:
                continue
        if not isinstance(entry, dict) or entry.get("id") != job_id:
            continue
        live = S.starter_alive(entry)
        usage = network = None
        try:
            if entry.get("cgroup"):
                usage = job_cgroup(entry, job_id, backends).stats()
        except (StarterError, OSError, ValueError):
            errors += 1
        if entry.get("net") in NAT_MODES and live:
            try:
                network = _nat_counters(job_id, entry.get("host_ifname"))
                if network is not None and entry.get("net_rate"):
                    network["shaping"] = _shaping(entry, job_id, links)
                if network is not None and entry.get("overlay"):
                    from starter.net import overlay

                    network["overlay"] = overlay.read_live(entry)
            except (StarterError, OSError, TypeError, ValueError):
                errors += 1
        try:
            one, state = job_samples(entry, live, usage, network)
            for rows in one.values():
                for _, value in rows:
                    _fmt(value)         # what render() will do: a value it cannot write fails here
        except (TypeError, ValueError, AttributeError, OverflowError):
            errors += 1     # an entry not as the starter writes it: the others are still served
            continue
        counts[state] = counts.get(state, 0) + 1
        for k, v in one.items():
            samples.setdefault(k, []).extend(v)
    try:
        for (uplink, direction), c in sorted(_uplink_counters(state_dir).items()):
            lab = labels(uplink=uplink, direction=direction)
            samples.setdefault("starter_uplink_network_bytes_total", []).append((lab, c.get("bytes")))
            samples.setdefault("starter_uplink_network_packets_total", []).append((lab, c.get("packets")))
    except (StarterError, OSError, ValueError):
        errors += 1
    for l in links:
        l.close()
    samples["starter_jobs"] = [(labels(state=s), n) for s, n in counts.items()]
    samples["starter_metrics_read_errors"] = [("", errors)]
    return samples


def _uplink_counters(state_dir):
    """{(uplink, direction): {bytes, packets}} of the node's job table, named
    in the table record the state dir keeps while NAT jobs run (net/ipam.py);
    {} when none runs."""
    try:
        with open(os.path.join(state_dir, "net", "table.json"), "rb") as f:
            cfg = S.loads(f.read().decode()).get("cfg") or {}
    except FileNotFoundError:
        return {}
    from starter.net import nft

    uplinks = cfg.get("uplink") or []
    uplinks = [uplinks] if isinstance(uplinks, str) else uplinks
    out = {}
    for uplink, by_dir in nft.read_uplink_counters(cfg.get("table") or "starter", uplinks).items():
        for direction, c in by_dir.items():
            out[(uplink, direction)] = c
    return out


def _shaping(entry, job_id, links):
    """A capped job's shaper figures now: the host end's classes, and its
    eth0's, read in the job's network namespace: the one the starter
    recorded at clone, opened from the job's PID 1 only if it is still that
    one (nsidentity.open_namespaces, as `starter enter` does; a pid reused
    since is not the job's).  links: a list holding the one host netlink
    handle of this collect()."""
    from starter.isolate import nsidentity
    from starter.net import shaping
    from starter.net.ipam import is_job_key

    key = entry.get("host_ifname")
    if not (isinstance(key, str) and is_job_key(key)):
        return None
    if not links:
        from starter.net.veth import Links

        links.append(Links())
    try:
        fds = nsidentity.open_recorded(entry, ("net",))
    except (StarterError, TypeError, ValueError):
        fds = {}                # gone, or no longer the job's namespace: the host end alone
    try:
        return shaping.report(dict(entry["net_rate"]), links[0].shaping_stats(key, fds.get("net")))
    finally:
        nsidentity.close_namespaces(fds)


def _nat_counters(job_id, key):
    """The job's counters are named after its key, which is also its host
    veth's name (net/ipam.py job_key), recorded in the entry: no hashing."""
    from starter.net import ipam, nft

    if not (isinstance(key, str) and ipam.is_job_key(key)):
        key = ipam.job_key(job_id, "starter")
    return nft.read_counters("starter", key)


def text(state_dir):
    try:
        return render(collect(state_dir))
    except PermissionError as e:
        raise StarterError(f"cannot read {e.filename or state_dir}: {e.strerror}",
                           "run it as root: the state directory is root-only and the counters need CAP_NET_ADMIN") from None


# ---------------------------------------------------------------- outputs

def write_textfile(state_dir, directory):
    """DIR/starter.prom, replaced atomically: the temp name does not end in
    .prom, so node_exporter never reads half a file."""
    data = text(state_dir).encode()
    dest = os.path.join(directory, TEXTFILE_NAME)
    tmp = os.path.join(directory, f".{TEXTFILE_NAME}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileExistsError:   # left by a crash of a process with our pid
            os.unlink(tmp)
            fd = os.open(tmp, flags, 0o644)
        try:
            write_all(fd, data)
            os.fchmod(fd, 0o644)   # readable by node_exporter whatever our umask
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    except OSError as e:
        unlink_quiet(tmp)
        raise StarterError(f"cannot write {dest}: {e.strerror}",
                           "--textfile names node_exporter's --collector.textfile.directory; it must exist") from None
    return dest


def parse_listen(value):
    """[ADDR:]PORT, [V6ADDR]:PORT -> (host, port).  A bare port is loopback."""
    import ipaddress

    host, sep, port = value.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        if not (port.isascii() and port.isdigit()):      # int() takes '１２', '1_0', ' 1'
            raise ValueError
        port = int(port)
        if not 0 <= port <= 65535:
            raise ValueError
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise StarterError(f"--listen {value!r}: want [ADDR:]PORT with a numeric address, e.g. 127.0.0.1:9110",
                           "a bare port listens on 127.0.0.1") from None
    return str(addr), port, addr.is_loopback


MAX_CLIENTS = 16      # connections served at once; more are closed at once


def serve(state_dir, listen):
    """GET /metrics until SIGTERM/SIGINT.  Each scrape reads the node afresh.
    A thread per connection (at most MAX_CLIENTS), so a client that stalls
    (a byte every few seconds) holds only its own; the scrapes themselves
    run one at a time."""
    import http.server
    import signal
    import socket
    import socketserver
    import threading

    host, port, loopback = parse_listen(listen)
    if not loopback:
        sys.stderr.write(f"starter metrics: listening on {host}, not loopback: job ids and users are visible "
                         "to whoever reaches it; firewall it\n")

    scrape = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "starter-metrics"
        timeout = 10          # per read: an idle connection is dropped

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                try:
                    with scrape:
                        body, code, ctype = text(state_dir).encode(), 200, CONTENT_TYPE
                except StarterError as e:
                    body, code, ctype = f"starter metrics: {e}\n".encode(), 500, "text/plain"
                except Exception as e:     # one line for the scraper, no traceback on our stderr
                    body, code, ctype = (f"starter metrics: internal error: {one_line(repr(e))}\n".encode(),
                                         500, "text/plain")
            elif path == "/":
                body, code, ctype = b"starter metrics: see /metrics\n", 200, "text/plain"
            else:
                body, code, ctype = b"not found\n", 404, "text/plain"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):
            pass

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

        def process_request(self, request, client_address):
            if threading.active_count() > MAX_CLIENTS:      # the main thread + MAX_CLIENTS - 1
                self.shutdown_request(request)
                return
            super().process_request(request, client_address)

    try:
        httpd = Server((host, port), Handler)
    except OSError as e:
        raise StarterError(f"cannot listen on {host}:{port}: {e.strerror}",
                           "pick a free port (node_exporter uses 9100)") from None

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    bound = httpd.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    sys.stderr.write(f"starter metrics: serving http://{shown}:{bound}/metrics\n")
    sys.stderr.flush()
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0

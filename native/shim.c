/* shim.c — the window between clone() and execve().
 *
 * No Python runs in the cloned child: a forked interpreter can deadlock on
 * locks other threads held at clone time, and glibc's view of threads is
 * stale after a raw clone.  Every buffer the child needs is built by the
 * caller before clone; the child only makes raw syscalls and touches its own
 * stack.  Credentials are changed with raw syscalls, never glibc's setxid
 * broadcast (it would signal the parent's threads' stale TIDs).
 *
 * Theory of operation (shim_spawn):
 *
 *   starter (Python)                         child (C only)
 *   ----------------                         --------------
 *   bind trees: open_tree(src_fd) (detached copies; the caller resolved
 *               each source to an O_PATH fd without following links)
 *   pipes: sync, err (+status in init mode), all O_CLOEXEC; with
 *     --userns-root err is a SOCK_SEQPACKET pair (SO_PASSCRED)
 *   block all signals
 *   clone3(NEWPID|NEWNET|NEWNS|NEWIPC  ───► signals to SIG_DFL
 *          [|NEWUTS], PIDFD, INTO_CGROUP)    PR_SET_PDEATHSIG(SIGKILL)
 *   restore signal mask                      read(sync) ........ blocks
 *   attach v1 cgroups, wire network          :   EOF (starter died) -> _exit(125)
 *   release(): write(sync, 1 byte) ───sync──►:
 *                                            unshare(NEWCGROUP): rooted at the
 *                                              job's cgroups, v1 ones included
 *                                            / rslave, grab bind sources
 *                                            given by path, /proc, /sys, lo
 *                                            up, hostname, /tmp, the mount
 *                                              plan in order (cgroup views,
 *                                              /dev/shm, ..., binds (each
 *                                              made a slave), state dir
 *                                              hidden), each destination
 *                                              walked once without links
 *                                              and mounted onto by fd, stdio,
 *                                            setsid, reset inherited attrs
 *                                            (rlimits, oom_score_adj, nice,
 *                                            sched, affinity, umask, ...),
 *                                            setresgid, setgroups,
 *                                            cap bounding drop, setresuid,
 *                                            new session keyring,
 *                                            capset(0), NO_NEW_PRIVS (not
 *                                            dumpable from the uid change on),
 *                                            close fds,
 *   wait_started(): read(err)                [--userns-root: unshare(USER),
 *     {0, 0, "map user namespace"} ◄──err─── ask for the maps,
 *       its pid: SCM_CREDENTIALS             read(sync) ........ blocks
 *       /proc/PID/setgroups "deny",          :   EOF -> _exit(125)
 *       gid_map, uid_map "0 id 1"            :
 *       write(sync, 1 byte) ─────sync──────► setresgid, setresuid(0)],
 *                                            re-arm PDEATHSIG, chdir,
 *                                            seccomp filter (compiled by the starter)
 *     read(err) ◄─────────────────err─────── on failure: {errno, exit, step}
 *     EOF, 0 bytes  -> job runs               then _exit(125|126|127)
 *     a report      -> reap, SpawnError      execve (CLOEXEC closes err: EOF)
 *   close(sync) after EOF on err
 *
 * Init mode: the child above becomes a tiny init (tini-like) instead of
 * exec'ing.  After the setup and the privilege drop it forks the job (PID 2),
 * closes its copy of err (so the starter sees EOF when the *job* execs),
 * forwards every signal but SIGCHLD to the job, reaps everything, writes the
 * job's raw wait status on the status pipe and exits 128+N / the job's code.
 * With --userns-root only the job enters the user namespace; the init keeps
 * the job's host uid.  The job asks for the maps itself, over its copy of
 * err: the starter learns the job's pid from that message's credentials.
 *
 * shim_enter: a short-lived helper (fork) setns()es into the job's
 * namespaces (all but the cgroup one; by the fds the starter opened and
 * checked against what it recorded at clone, never by the job's PID 1),
 * clone3(CLONE_PARENT|CLONE_INTO_CGROUP)s
 * the entering process (so its parent is the starter, which gets a pidfd
 * with pidfd_open), writes the pid on a pipe and exits.  The helper resets
 * the inherited attributes before setns (the job's mount namespace is not
 * trusted) and the entering process inherits them.  It joins the job's
 * cgroup namespace itself, from inside its cgroup, then follows the same
 * path as above minus namespaces and mounts.  The starter never changes its
 * own namespaces.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shim.h"

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef OPEN_TREE_CLOEXEC
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOVE_MOUNT_T_EMPTY_PATH
#define MOVE_MOUNT_T_EMPTY_PATH 0x00000040
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#endif
#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif
#ifndef KEYCTL_JOIN_SESSION_KEYRING
#define KEYCTL_JOIN_SESSION_KEYRING 1
#endif
#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif

/* Our own copies of the uapi structs: <linux/sched.h> and <linux/mount.h>
 * clash with glibc headers on some distributions. */
struct clone_args_v2 {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal;
    uint64_t stack, stack_size, tls, set_tid, set_tid_size, cgroup;
};
struct mount_attr_v0 {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};
struct cap_header {
    uint32_t version;
    int pid;
};
struct cap_data {
    uint32_t effective, permitted, inheritable;
};

/* --userns-root: the step of the report that asks the starter for the maps
 * (exit code 0: not a failure); starter/ns.py knows it by this name. */
#define SHIM_STEP_USERNS "map user namespace"

#define EXIT_STARTER 125
#define EXIT_NOEXEC 126
#define EXIT_NOTFOUND 127

/* Everything the child needs besides the spec: fd numbers of its pipe ends. */
struct child_ctx {
    const struct shim_spec *s;
    int sync_rd;   /* release byte, or EOF when the starter is gone */
    int err_wr;    /* struct shim_report */
    int status_wr; /* init mode: job's wait status, else -1 */
    const int *trees; /* per mount: bind tree cloned before clone(), or -1; or NULL */
};

/* ---- async-signal-safe helpers (child side) ---------------------------- */

static size_t s_len(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}

static size_t s_cat(char *buf, size_t at, size_t cap, const char *s)
{
    while (s && *s && at + 1 < cap)
        buf[at++] = *s++;
    buf[at] = 0;
    return at;
}

static size_t s_uint(char *buf, size_t at, size_t cap, unsigned int u)
{
    char tmp[16];
    int n = 0;
    do {
        tmp[n++] = '0' + u % 10;
        u /= 10;
    } while (u && n < 15);
    while (n && at + 1 < cap)
        buf[at++] = tmp[--n];
    buf[at] = 0;
    return at;
}

static void s_int(char *buf, size_t cap, int v)
{
    size_t at = 0;
    if (v < 0 && at + 1 < cap)
        buf[at++] = '-';
    s_uint(buf, at, cap, v < 0 ? -(unsigned int)v : (unsigned int)v);
}

static void write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        c += w;
        n -= (size_t)w;
    }
}

/* Report "what arg" with errno `err` and exit with `code`. */
static _Noreturn void fail_err(const struct child_ctx *c, int err, int code, const char *what,
                               const char *arg)
{
    struct shim_report r;
    char *p = (char *)&r;
    for (size_t i = 0; i < sizeof r; i++)
        p[i] = 0;
    r.err = err;
    r.exit_code = code;
    size_t at = s_cat(r.step, 0, sizeof r.step, what);
    if (arg) {
        at = s_cat(r.step, at, sizeof r.step, " ");
        s_cat(r.step, at, sizeof r.step, arg);
    }
    if (c->err_wr >= 0)
        write_all(c->err_wr, &r, sizeof r);
    _exit(code);
}

static _Noreturn void fail(const struct child_ctx *c, const char *what, const char *arg)
{
    fail_err(c, errno, EXIT_STARTER, what, arg);
}

/* Raw rt_sigaction/rt_sigprocmask: glibc's wrappers refuse its internal
 * signals (32, 33), whose handlers would otherwise survive in an init. */
struct k_sigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    uint64_t mask;
};

static void reset_signals(void)
{
    struct k_sigaction sa = {.handler = SIG_DFL};
    for (int sig = 1; sig <= 64; sig++)
        if (sig != SIGKILL && sig != SIGSTOP)
            syscall(SYS_rt_sigaction, sig, &sa, NULL, sizeof sa.mask);
}

static void set_sigmask(uint64_t mask)
{
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &mask, NULL, sizeof mask);
}

static void unblock_signals(void)
{
    set_sigmask(0);
}

/* The starter holds the write end of sync until the job has exec'd; a hangup
 * before that means it died. */
static int starter_gone(const struct child_ctx *c)
{
    struct pollfd p = {.fd = c->sync_rd, .events = POLLIN};
    if (c->sync_rd < 0)
        return 0;
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLERR));
}

static void arm_pdeathsig(const struct child_ctx *c)
{
    if (!c->s->die_with_parent)
        return;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        fail(c, "PR_SET_PDEATHSIG", NULL);
    if (starter_gone(c))
        _exit(EXIT_STARTER);
}

static void wait_release(const struct child_ctx *c)
{
    char b;
    ssize_t n;
    if (c->sync_rd < 0)
        return;
    do
        n = read(c->sync_rd, &b, 1);
    while (n < 0 && errno == EINTR);
    if (n != 1)
        _exit(EXIT_STARTER); /* the starter is gone: run nothing */
}

/* ---- mounts ------------------------------------------------------------ */

/* Tests: behave as on a kernel without mount_setattr (5.2..5.11). */
static int no_mount_setattr = 0;

static long sys_mount_setattr(int dfd, const char *path, unsigned int flags,
                              struct mount_attr_v0 *attr)
{
    if (no_mount_setattr) {
        errno = ENOSYS;
        return -1;
    }
    return syscall(SYS_mount_setattr, dfd, path, flags, attr, sizeof *attr);
}

static unsigned long st_keep_flags(const struct statfs *st)
{
    unsigned long f = 0;
    if (st->f_flags & ST_NOSUID)
        f |= MS_NOSUID;
    if (st->f_flags & ST_NODEV)
        f |= MS_NODEV;
    if (st->f_flags & ST_NOEXEC)
        f |= MS_NOEXEC;
    if (st->f_flags & ST_NOATIME)
        f |= MS_NOATIME;
    if (st->f_flags & ST_NODIRATIME)
        f |= MS_NODIRATIME;
    if (st->f_flags & ST_RELATIME)
        f |= MS_RELATIME;
    return f;
}

static unsigned long keep_flags(const char *path)
{
    struct statfs st;
    return statfs(path, &st) < 0 ? 0 : st_keep_flags(&st);
}

/* Read-only for the whole subtree (mount_setattr, 5.12+); else the top mount
 * only, keeping the flags the source had (a remount may not clear them). */
static int make_readonly(const char *path)
{
    struct mount_attr_v0 attr = {.attr_set = MOUNT_ATTR_RDONLY};
    if (sys_mount_setattr(AT_FDCWD, path, AT_RECURSIVE, &attr) == 0)
        return 0;
    if (errno != ENOSYS)
        return -1;
    return mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | keep_flags(path), NULL);
}

/* The same for the mount whose root `fd` is (an fd of the new mount, never
 * its path).  The remount goes through fd_name(), see there. */
static const char *fd_name(char buf[16], int fd);
static int make_readonly_fd(int fd)
{
    struct mount_attr_v0 attr = {.attr_set = MOUNT_ATTR_RDONLY};
    struct statfs st;
    char name[16];
    if (sys_mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) == 0)
        return 0;
    if (errno != ENOSYS)
        return -1;
    if (fstatfs(fd, &st) < 0)
        return -1;
    return mount(NULL, fd_name(name, fd), NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | st_keep_flags(&st),
                 NULL);
}

/* mkdir -p for a mount point inside a tmpfs this child mounted (a fresh /tmp
 * has no directories yet); never on the host's filesystems. */
static int under(const char *path, const char *dir)
{
    size_t n = s_len(dir);
    if (n == 1)
        return 0; /* "/" is never ours */
    for (size_t i = 0; i < n; i++)
        if (path[i] != dir[i])
            return 0;
    return path[n] == '/';
}

static int is_tmpfs(const struct shim_mount *m)
{
    const char *t = m->fstype, *w = "tmpfs";
    if (!t)
        return 0;
    while (*t && *t == *w)
        t++, w++;
    return *t == 0 && *w == 0;
}

/* May missing components of m->dst be made?  Only inside a tmpfs this plan
 * mounted before it (the private /tmp, an earlier tmpfs entry). */
static int ours(const struct child_ctx *c, const struct shim_mount *m)
{
    const struct shim_spec *s = c->s;
    if (s->private_tmp && under(m->dst, "/tmp"))
        return 1;
    for (int i = 0; i < s->nmounts; i++) {
        const struct shim_mount *o = &s->mounts[i];
        if (o == m)
            break;
        if ((o->kind == SHIM_MOUNT_TMPFS || (o->kind == SHIM_MOUNT_FS && is_tmpfs(o))) &&
            under(m->dst, o->dst))
            return 1;
    }
    return 0;
}

/* ---- mount destinations --------------------------------------------------
 *
 * A destination is resolved once, in the job's namespace after the mounts
 * before it: from "/" one component at a time with O_PATH|O_NOFOLLOW, so no
 * link is followed, the last component included.  The job's user may own a
 * directory on the way (a host directory, a bind source of its own): a link
 * planted there would carry the mount anywhere (over /usr/bin), and one
 * swapped in between two lookups of the same path would split them (runc's
 * CVE-2021-30465).  So the mount goes onto the fd the walk ended on, and what
 * is done to the new mount after (slave, read-only) is done through an fd of
 * that mount, never by the path again.  A plain walk, not openat2's
 * RESOLVE_NO_SYMLINKS: the refusal names the link, and missing components
 * are made on the way. */

/* mount(2) takes paths only.  The ones this child gives it are fd numbers
 * looked up in its own /proc/self/fd, opened before the first mount of the
 * plan and made the cwd for the plan (fd_dir): a plan entry over /proc or
 * /proc/1 cannot redirect them. */
static const char *fd_name(char buf[16], int fd)
{
    s_int(buf, 16, fd);
    return buf;
}

/* "mount destination DST: PREFIX is a symlink (not followed)": the whole
 * message (ns.py shows it as is), PREFIX being the first `upto` bytes of
 * DST. */
static _Noreturn void fail_link(const struct child_ctx *c, const char *dst, size_t upto)
{
    char msg[SHIM_STEP_MAX], prefix[SHIM_STEP_MAX];
    size_t i;
    for (i = 0; i < upto && i + 1 < sizeof prefix; i++)
        prefix[i] = dst[i];
    prefix[i] = 0;
    size_t at = s_cat(msg, 0, sizeof msg, "mount destination ");
    at = s_cat(msg, at, sizeof msg, dst);
    at = s_cat(msg, at, sizeof msg, ": ");
    at = s_cat(msg, at, sizeof msg, prefix);
    s_cat(msg, at, sizeof msg, " is a symlink (not followed)");
    fail_err(c, ELOOP, EXIT_STARTER, msg, NULL);
}

struct dest {
    int fd;     /* the destination: O_PATH, or O_RDONLY for a file made here */
    int parent; /* its directory (O_PATH), -1 where the destination is "/" */
    char name[256]; /* its last component, "" for "/" */
};

static void close_dest(struct dest *d)
{
    if (d->fd >= 0)
        close(d->fd);
    if (d->parent >= 0)
        close(d->parent);
    d->fd = d->parent = -1;
}

/* Walk m->dst (see above) into *d.  A missing component is made where
 * ours() allows it (mkdirat, or a file for a bind of a file, by the held
 * parent fd); a link anywhere fails the child.  -1 with errno ENOENT where a
 * component is missing and may not be made: the caller says what that
 * means.  Other failures fail the child as `what` DST ("mkdir" DST for a
 * directory that could not be made). */
static int walk_dest(const struct child_ctx *c, const struct shim_mount *m, const char *what,
                     int file, int create, struct dest *d)
{
    const char *dst = m->dst, *p = dst;
    d->parent = -1;
    d->name[0] = 0;
    d->fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (d->fd < 0)
        fail(c, what, dst);
    for (;;) {
        while (*p == '/')
            p++;
        if (!*p)
            return 0;
        const char *e = p;
        while (*e && *e != '/')
            e++;
        size_t len = (size_t)(e - p);
        const char *rest = e;
        while (*rest == '/')
            rest++;
        int last = *rest == 0;
        if (len == 1 && p[0] == '.') {
            p = e;
            continue;
        }
        if (len >= sizeof d->name)
            fail_err(c, ENAMETOOLONG, EXIT_STARTER, what, dst);
        if (len == 2 && p[0] == '.' && p[1] == '.')
            fail_err(c, EINVAL, EXIT_STARTER, what, dst); /* the starter refuses '..' */
        if (d->parent >= 0)
            close(d->parent);
        d->parent = d->fd;
        d->fd = -1;
        for (size_t i = 0; i < len; i++)
            d->name[i] = p[i];
        d->name[len] = 0;
        p = e;
        int fd = openat(d->parent, d->name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT && create) {
            if (last && file) {
                /* O_EXCL: never through a link; a link there is refused below */
                fd = openat(d->parent, d->name, O_RDONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
                if (fd < 0 && errno != EEXIST)
                    fail(c, "mkdir", dst);
            } else if (mkdirat(d->parent, d->name, 0755) < 0 && errno != EEXIST) {
                fail(c, "mkdir", dst);
            }
            if (fd < 0)
                fd = openat(d->parent, d->name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        }
        if (fd < 0) {
            if (errno == ENOENT) {
                close_dest(d);
                errno = ENOENT;
                return -1;
            }
            fail(c, what, dst);
        }
        d->fd = fd;
        struct stat st;
        if (fstat(fd, &st) < 0)
            fail(c, what, dst);
        if (S_ISLNK(st.st_mode))
            fail_link(c, dst, (size_t)(e - dst));
        if (!last && !S_ISDIR(st.st_mode))
            fail_err(c, ENOTDIR, EXIT_STARTER, what, dst);
    }
}

/* fsopen/fsconfig/fsmount (5.2+): a tmpfs made detached, nosuid and nodev,
 * with `data` split into options as mount(2) would split it (a comma before
 * a digit continues mpol's node list).  -1 with errno ENOSYS on older
 * kernels: mount(2) then. */
#ifndef SYS_fsopen
#define SYS_fsopen 430
#define SYS_fsconfig 431
#define SYS_fsmount 432
#endif
#define FSOPEN_CLOEXEC_ 1
#define FSCONFIG_SET_FLAG_ 0
#define FSCONFIG_SET_STRING_ 1
#define FSCONFIG_CMD_CREATE_ 6
#define FSMOUNT_CLOEXEC_ 1
#define MOUNT_ATTR_NOSUID_ 0x2
#define MOUNT_ATTR_NODEV_ 0x4

static int no_fsopen = 0; /* tests: with no_open_tree, as before 5.2 */

static int new_tmpfs(const char *data)
{
    char opts[4096];
    if (no_fsopen) {
        errno = ENOSYS;
        return -1;
    }
    int fs = (int)syscall(SYS_fsopen, "tmpfs", FSOPEN_CLOEXEC_);
    if (fs < 0)
        return -1;
    size_t n = data ? s_len(data) : 0;
    if (n >= sizeof opts) {
        close(fs);
        errno = E2BIG;
        return -1;
    }
    for (size_t i = 0; i <= n; i++)
        opts[i] = data ? data[i] : 0;
    /* "tmpfs" as the source in mountinfo, as mount(2) gives it */
    if (syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING_, "source", "tmpfs", 0) < 0)
        goto fail;
    for (char *o = opts; o && *o;) {
        char *next = o;
        for (;;) {
            while (*next && *next != ',')
                next++;
            if (!*next) {
                next = NULL;
                break;
            }
            if (next[1] < '0' || next[1] > '9') {
                *next++ = 0;
                break;
            }
            next++;
        }
        char *value = o;
        while (*value && *value != '=')
            value++;
        if (*value)
            *value++ = 0;
        else
            value = NULL;
        if (*o && syscall(SYS_fsconfig, fs, value ? FSCONFIG_SET_STRING_ : FSCONFIG_SET_FLAG_, o, value, 0) < 0)
            goto fail;
        o = next;
    }
    if (syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE_, NULL, NULL, 0) < 0)
        goto fail;
    int mnt = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC_, MOUNT_ATTR_NOSUID_ | MOUNT_ATTR_NODEV_);
    if (mnt < 0)
        goto fail;
    close(fs);
    return mnt;
fail:;
    int e = errno;
    close(fs);
    errno = e;
    return -1;
}

/* Attach the detached mount `tree` onto the walked destination. */
static int attach(int tree, const struct dest *d)
{
    return (int)syscall(SYS_move_mount, tree, "", d->fd, "",
                        MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH);
}

/* Bind sources are taken before anything is mounted (open_tree, 5.2+), so a
 * source is the starter's view of that path even when the private /tmp or an
 * earlier mount covers it in the job's view.  A read-only bind is made
 * read-only while still detached, for its whole subtree, keeping the flags
 * (nosuid, nodev, ...) the source had. */
static int grab_source(const struct child_ctx *c, const struct shim_mount *m)
{
    if (m->kind != SHIM_MOUNT_BIND && m->kind != SHIM_MOUNT_RO_BIND)
        return -1;
    int fd = (int)syscall(SYS_open_tree, AT_FDCWD, m->src,
                          OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
    if (fd < 0) {
        if (errno == ENOSYS)
            return -1; /* old kernel: mount(2) from the path later */
        fail(c, "bind source", m->src);
    }
    if (m->kind == SHIM_MOUNT_RO_BIND) {
        struct mount_attr_v0 attr = {.attr_set = MOUNT_ATTR_RDONLY};
        if (sys_mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) < 0) {
            if (errno != ENOSYS)
                fail(c, "read-only", m->src);
            close(fd); /* 5.2..5.11: no mount_setattr; remount after mount(2) */
            return -1;
        }
    }
    return fd;
}

/* No open_tree (before 5.2): open the source by path in our own namespace,
 * before anything covers it (the private /tmp), and check it is the inode the
 * starter resolved without links (else a link was swapped in).  It is then
 * mounted from our /proc/self/fd/N (fd_name): the starter's fd itself would
 * not do, as mount(2) binds only mounts of the caller's namespace. */
static int pin_source(const struct child_ctx *c, const struct shim_mount *m)
{
    struct stat want, got;
    int fd = open(m->src, O_PATH | O_CLOEXEC);
    if (fd < 0)
        fail(c, "bind source", m->src);
    if (fstat(m->src_fd, &want) < 0 || fstat(fd, &got) < 0)
        fail(c, "stat bind source", m->src);
    if (want.st_dev != got.st_dev || want.st_ino != got.st_ino)
        fail_err(c, ELOOP, EXIT_STARTER, "bind source changed while resolving", m->src);
    return fd;
}

/* After a mount(2) bind onto d (no open_tree): an fd of the new mount, by
 * the last component in the held parent, checked to be the root of the
 * bind (the inode of `src`), so no other path is ever made read-only. */
static int new_bind_fd(const struct child_ctx *c, const struct shim_mount *m, const struct dest *d,
                       int src)
{
    struct stat want, got;
    int fd = d->parent >= 0 ? openat(d->parent, d->name, O_PATH | O_NOFOLLOW | O_CLOEXEC)
                            : open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        fail(c, "remount read-only", m->dst);
    if ((src >= 0 ? fstat(src, &want) : stat(m->src, &want)) < 0 || fstat(fd, &got) < 0)
        fail(c, "remount read-only", m->dst);
    if (want.st_dev != got.st_dev || want.st_ino != got.st_ino)
        fail_err(c, ELOOP, EXIT_STARTER, "mount destination changed while mounting", m->dst);
    return fd;
}

/* SHIM_MOUNT_LINK: the link m->dst -> m->src, made in a tmpfs this plan
 * mounted (the job's /dev: /dev/fd, /dev/ptmx, ...), never on the host's
 * file systems.  Its directory is walked as any destination is (no link
 * followed), and the link made by that directory's fd. */
static void make_link(const struct child_ctx *c, const struct shim_mount *m)
{
    char dir[4096];
    size_t n = s_len(m->dst), cut = 0;
    if (!ours(c, m) || !m->src || n >= sizeof dir)
        fail_err(c, EPERM, EXIT_STARTER, "symlink outside a tmpfs of the plan", m->dst);
    for (size_t i = 0; i < n; i++)
        if (m->dst[i] == '/')
            cut = i;
    for (size_t i = 0; i < cut; i++)
        dir[i] = m->dst[i];
    dir[cut ? cut : 1] = 0;
    if (!cut)
        dir[0] = '/';
    struct shim_mount parent = *m;
    parent.dst = dir;
    struct dest d;
    if (walk_dest(c, &parent, "symlink", 0, 1, &d) < 0)
        fail(c, "symlink", m->dst);
    if (symlinkat(m->src, d.fd, m->dst + cut + 1) < 0)
        fail(c, "symlink", m->dst);
    close_dest(&d);
}

/* SHIM_MOUNT_NODE: a device node at m->dst, made while the child is still
 * root in the initial user namespace (the job itself never has CAP_MKNOD),
 * in a tmpfs this plan mounted (the job's /dev) only.  The starter copied
 * the host node's type, permissions and number; umask does not apply. */
static void make_node(const struct child_ctx *c, const struct shim_mount *m)
{
    char dir[4096];
    size_t n = s_len(m->dst), cut = 0;
    if (!ours(c, m) || n >= sizeof dir || !(S_ISCHR(m->mode) || S_ISBLK(m->mode)))
        fail_err(c, EPERM, EXIT_STARTER, "device node outside a tmpfs of the plan", m->dst);
    for (size_t i = 0; i < n; i++)
        if (m->dst[i] == '/')
            cut = i;
    for (size_t i = 0; i < cut; i++)
        dir[i] = m->dst[i];
    dir[cut ? cut : 1] = 0;
    if (!cut)
        dir[0] = '/';
    struct shim_mount parent = *m;
    parent.dst = dir;
    struct dest d;
    if (walk_dest(c, &parent, "mknod", 0, 1, &d) < 0)
        fail(c, "mknod", m->dst);
    /* By the directory's fd (an O_PATH dirfd does), with the mode as given:
     * no umask (the job's own is set later, reset_inherited). */
    mode_t old = umask(0);
    int r = mknodat(d.fd, m->dst + cut + 1, m->mode, (dev_t)m->rdev);
    umask(old);
    if (r < 0)
        fail(c, "mknod", m->dst);
    close_dest(&d);
}

static void do_mount(const struct child_ctx *c, const struct shim_mount *m, int tree, int pinned)
{
    const char *what = m->kind == SHIM_MOUNT_BIND      ? "bind"
                       : m->kind == SHIM_MOUNT_RO_BIND ? "ro-bind"
                       : m->kind == SHIM_MOUNT_TMPFS   ? "tmpfs"
                                                       : "mount";
    if (m->kind == SHIM_MOUNT_LINK) {
        make_link(c, m);
        return;
    }
    if (m->kind == SHIM_MOUNT_NODE) {
        make_node(c, m);
        return;
    }
    int bind = m->kind == SHIM_MOUNT_BIND || m->kind == SHIM_MOUNT_RO_BIND;
    int optional = m->kind == SHIM_MOUNT_FS && m->optional;
    int create = !optional && ours(c, m);
    int file = 0;
    char name[16], from[16];
    struct stat st;
    struct dest d;
    if (create && bind &&
        (tree >= 0     ? fstat(tree, &st)
         : pinned >= 0 ? fstat(pinned, &st)
         : m->src_fd >= 0 ? fstat(m->src_fd, &st) : stat(m->src, &st)) == 0 &&
        !S_ISDIR(st.st_mode))
        file = 1; /* a bind of a file gets a file to cover */
    if (walk_dest(c, m, what, file, create, &d) < 0) {
        if (optional)
            return; /* e.g. a hidden path under the private /tmp: nothing to hide */
        fail(c, what, m->dst);
    }
    if (tree >= 0) {
        /* A tree cloned in the starter's namespace is a peer of its source
         * (shared, on systemd hosts): nothing may propagate back.  A slave
         * while still detached (5.12+), else once attached, through the
         * tree's own fd, which is the new mount. */
        struct mount_attr_v0 attr = {.propagation = MS_SLAVE};
        int slave = sys_mount_setattr(tree, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) == 0;
        if (!slave && errno != ENOSYS)
            fail(c, "make slave", m->dst);
        if (attach(tree, &d) < 0)
            fail(c, what, m->dst);
        if (!slave && mount(NULL, fd_name(name, tree), NULL, MS_REC | MS_SLAVE, NULL) < 0)
            fail(c, "make slave", m->dst);
        close(tree);
        close_dest(&d);
        return;
    }
    switch (m->kind) {
    case SHIM_MOUNT_BIND:
    case SHIM_MOUNT_RO_BIND:
        if (mount(pinned >= 0 ? fd_name(from, pinned) : m->src, fd_name(name, d.fd), NULL,
                  MS_BIND | MS_REC, NULL) < 0)
            fail(c, what, m->dst);
        if (m->kind == SHIM_MOUNT_RO_BIND) {
            int top = new_bind_fd(c, m, &d, pinned);
            if (make_readonly_fd(top) < 0)
                fail(c, "remount read-only", m->dst);
            close(top);
        }
        break;
    case SHIM_MOUNT_TMPFS: {
        int mnt = new_tmpfs(m->data);
        if (mnt >= 0) {
            if (attach(mnt, &d) < 0)
                fail(c, what, m->dst);
            close(mnt);
        } else if (errno != ENOSYS ||
                   mount("tmpfs", fd_name(name, d.fd), "tmpfs", MS_NOSUID | MS_NODEV, m->data) < 0) {
            fail(c, what, m->dst);
        }
        break;
    }
    case SHIM_MOUNT_FS: /* the plan's own mounts: /dev/shm, cgroup views, hiding */
        if (mount(m->src ? m->src : m->fstype, fd_name(name, d.fd), m->fstype, m->flags, m->data) < 0)
            fail(c, what, m->dst);
        break;
    default:
        fail_err(c, EINVAL, EXIT_STARTER, "mount kind", m->dst);
    }
    close_dest(&d);
}

/* A fresh sysfs shows the job's own network namespace.  Its /sys/fs/cgroup
 * is an empty directory: the job's own cgroup tree is mounted there by the
 * mount plan, inside the job's cgroup namespace (starter/mounts.py). */
static void mount_sys(const struct child_ctx *c, int harden)
{
    unsigned long fl = MS_NOSUID | MS_NODEV | MS_NOEXEC | (harden ? MS_RDONLY : 0);
    if (mount("sysfs", "/sys", "sysfs", fl, NULL) < 0)
        fail(c, "mount", "/sys");
}

/* A uid-0 job without capabilities still passes owner permission checks on
 * root-owned files: /proc/sys (host sysctls), /proc/sysrq-trigger.  Make
 * those read-only, like docker's readonly paths. */
static void harden_proc(const struct child_ctx *c)
{
    static const char *const paths[] = {"/proc/sys", "/proc/sysrq-trigger", "/proc/irq",
                                        "/proc/bus", "/proc/fs", NULL};
    for (int i = 0; paths[i]; i++) {
        if (mount(paths[i], paths[i], NULL, MS_BIND | MS_REC, NULL) < 0) {
            if (errno == ENOENT)
                continue;
            fail(c, "bind", paths[i]);
        }
        if (mount(NULL, paths[i], NULL,
                  MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            fail(c, "remount read-only", paths[i]);
    }
}

static void loopback_up(const struct child_ctx *c)
{
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        fail(c, "socket for", "lo");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_name[0] = 'l';
    ifr.ifr_name[1] = 'o';
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        fail(c, "SIOCGIFFLAGS", "lo");
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        fail(c, "loopback up", "lo");
    close(s);
}

static void setup_namespaces(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    int ns = s->nsflags;
    int harden = s->drop_privileges && s->uid == 0;
    int trees[SHIM_MAX_MOUNTS], pinned[SHIM_MAX_MOUNTS];

    if (ns & SHIM_NEWNS) {
        /* Before any mount, or the mounts below propagate to the host. */
        if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0)
            fail(c, "make / a slave mount", NULL);
        for (int i = 0; i < s->nmounts && i < SHIM_MAX_MOUNTS; i++) {
            const struct shim_mount *m = &s->mounts[i];
            int bind = m->kind == SHIM_MOUNT_BIND || m->kind == SHIM_MOUNT_RO_BIND;
            pinned[i] = -1;
            if (c->trees && c->trees[i] >= 0)
                trees[i] = c->trees[i];
            else if (bind && m->src_fd >= 0) {
                trees[i] = -1;
                pinned[i] = pin_source(c, m);
            } else
                trees[i] = grab_source(c, m);
        }
        if (ns & SHIM_NEWPID) {
            if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
                fail(c, "mount", "/proc");
            if (harden)
                harden_proc(c);
        }
        if (ns & SHIM_NEWNET) {
            mount_sys(c, harden);
        } else if (harden) {
            if (mount("/sys", "/sys", NULL, MS_BIND | MS_REC, NULL) < 0 || make_readonly("/sys") < 0)
                fail(c, "remount read-only", "/sys");
        }
    }
    if (ns & SHIM_NEWNET)
        loopback_up(c);
    if (s->hostname && sethostname(s->hostname, s_len(s->hostname)) < 0)
        fail(c, "sethostname", s->hostname);
    if ((ns & SHIM_NEWNS) && s->private_tmp &&
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777") < 0)
        fail(c, "mount", "/tmp");
    if (s->nmounts <= 0)
        return;
    /* See fd_name(): mount(2) gets fd numbers in our own /proc/self/fd,
     * opened now, before any mount of the plan, and made the cwd for it. */
    int fd_dir = open("/proc/self/fd", O_PATH | O_DIRECTORY | O_CLOEXEC);
    int cwd = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd_dir < 0 || fchdir(fd_dir) < 0)
        fail(c, "open", "/proc/self/fd");
    for (int i = 0; i < s->nmounts && i < SHIM_MAX_MOUNTS; i++)
        do_mount(c, &s->mounts[i], trees[i], pinned[i]);
    if (cwd >= 0 ? fchdir(cwd) < 0 : chdir("/") < 0)
        fail(c, "chdir", "back from /proc/self/fd");
    close(fd_dir);
    if (cwd >= 0)
        close(cwd);
}

/* ---- credentials -------------------------------------------------------- */

static void drop_privileges(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    if (syscall(SYS_setresgid, s->gid, s->gid, s->gid) < 0)
        fail(c, "setresgid", NULL);
    if (syscall(SYS_setgroups, s->ngroups, s->groups) < 0)
        fail(c, "setgroups", NULL);
    /* Needs CAP_SETPCAP: before the uid changes. */
    for (int cap = 0; cap <= s->cap_last_cap; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
            fail(c, "PR_CAPBSET_DROP", NULL);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        fail(c, "PR_CAP_AMBIENT_CLEAR_ALL", NULL);
    if (syscall(SYS_setresuid, s->uid, s->uid, s->uid) < 0)
        fail(c, "setresuid", NULL);
    /* The uid change made this process non-dumpable unless fs.suid_dumpable
     * is 1: either way it stays so until execve (which decides for the job),
     * so no process of the job's uid can ptrace the rest of the setup. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
        fail(c, "PR_SET_DUMPABLE", "0");
    /* A fresh, empty session keyring owned by the job's user: the starter's
     * (or the batch daemon's) session keyring is not the job's to possess,
     * and without one the kernel falls back to the per-uid user-session
     * keyring that every job of this user would share. */
    if (syscall(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, NULL) < 0 && errno != ENOSYS)
        fail(c, "keyctl", "join session keyring");
    /* uid 0 keeps its sets across setresuid; empty them explicitly.  With an
     * empty bounding set, exec as root gains nothing either. */
    struct cap_header h = {.version = 0x20080522, .pid = 0};
    struct cap_data d[2];
    memset(d, 0, sizeof d);
    if (syscall(SYS_capset, &h, d) < 0)
        fail(c, "capset", NULL);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        fail(c, "PR_SET_NO_NEW_PRIVS", NULL);
}

static void write_proc_self(const struct child_ctx *c, const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        fail(c, "open", path);
    size_t n = s_len(text);
    if (write(fd, text, n) != (ssize_t)n)
        fail(c, "write", path);
    close(fd);
}

/* --userns-root, after the drop to the job's uid/gid: a new user namespace
 * in which 0 maps to that uid/gid and nothing else is mapped, so root inside
 * owns exactly what the job's host uid owns.  The job keeps the full
 * capability set the kernel gives the creator of a user namespace, but only
 * *in* it: the job's PID, net, mount namespaces and every host object belong
 * to the host's user namespace, where it has none.  NO_NEW_PRIVS stays.
 *
 * The maps are written by the starter, as newuidmap and runc do, not by this
 * process: writing its own /proc/self/uid_map would need it dumpable, and a
 * dumpable process of the job's uid can be ptraced by any process of that
 * uid, here before the job's seccomp filter and holding the job's fds.  So
 * it asks over err (a report with exit code 0, SHIM_STEP_USERNS; the kernel
 * adds its pid as the starter sees it, which an init's job cannot know) and
 * waits for a byte on sync; EOF there: the starter is gone. */
static void enter_userns_root(const struct child_ctx *c)
{
    struct shim_report r;
    char *p = (char *)&r;
    for (size_t i = 0; i < sizeof r; i++)
        p[i] = 0;
    s_cat(r.step, 0, sizeof r.step, SHIM_STEP_USERNS);
    if (unshare(CLONE_NEWUSER) < 0)
        fail(c, "unshare", "user namespace");
    write_all(c->err_wr, &r, sizeof r);
    wait_release(c);
    if (syscall(SYS_setresgid, 0, 0, 0) < 0)
        fail(c, "setresgid", "0 in the user namespace");
    if (syscall(SYS_setresuid, 0, 0, 0) < 0)
        fail(c, "setresuid", "0 in the user namespace");
}

/* ---- inherited attributes ------------------------------------------------ */

/* What a process keeps across clone() and execve(), set to what a fresh
 * service would get, so that none of the node daemon's settings (an
 * oom_score_adj of -1000, a nice value, a realtime policy, pinned CPUs, its
 * resource limits) reach a job.  Runs as root before the privilege drop:
 * lowering nice and raising hard limits need it.  Kept on purpose (they only
 * restrict and cannot be lifted): seccomp filters, NO_NEW_PRIVS, Landlock,
 * memory-deny-write-execute, forced speculation mitigations, locked
 * securebits; also the LSM label, the audit login uid and coredump_filter.
 * Dumpable, the alternate signal stack and timers are reset by execve or
 * not inherited by clone; PDEATHSIG is set on purpose (see child_main). */
#ifndef PR_SET_IO_FLUSHER
#define PR_SET_IO_FLUSHER 57
#endif
#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#define PR_GET_MEMORY_MERGE 68
#endif
#define SECBITS_LOCKED 0xaa /* the four *_LOCKED securebits */
#define TIMER_SLACK_NS 50000 /* the kernel's default; 0 would mean "the parent's" */

static const int rlimit_res[SHIM_NRLIMITS] = {
    RLIMIT_CPU,    RLIMIT_FSIZE,   RLIMIT_DATA,       RLIMIT_STACK,    RLIMIT_CORE,   RLIMIT_RSS,
    RLIMIT_NPROC,  RLIMIT_NOFILE,  RLIMIT_MEMLOCK,    RLIMIT_AS,       RLIMIT_LOCKS,  RLIMIT_SIGPENDING,
    RLIMIT_MSGQUEUE, RLIMIT_NICE,  RLIMIT_RTPRIO,     RLIMIT_RTTIME};
static const char *const rlimit_name[SHIM_NRLIMITS] = {
    "CPU",   "FSIZE",  "DATA",    "STACK", "CORE",  "RSS",        "NPROC",    "NOFILE",
    "MEMLOCK", "AS",   "LOCKS",   "SIGPENDING", "MSGQUEUE", "NICE", "RTPRIO", "RTTIME"};

/* The caller's soft RLIMIT_NOFILE: close_from()'s fallback must reach fds
 * opened before the job's (maybe lower) limit was set. */
static unsigned long inherited_nofile;

/* Clear a process flag the caller may have set.  EINVAL: a kernel without
 * it has nothing to clear. */
static void prctl_clear(const struct child_ctx *c, int get, int set, const char *what)
{
    int on = prctl(get, 0, 0, 0, 0);
    if (on < 0 && errno == EINVAL)
        return;
    if (on < 0 || (on > 0 && prctl(set, 0, 0, 0, 0) < 0))
        fail(c, what, "0");
}

/* A starter without CAP_SYS_RESOURCE (in a container) cannot raise a hard
 * limit: a default then stays at the caller's hard limit, which is only
 * stricter; a limit the admin asked for fails the job. */
static int set_rlimit(const struct shim_rlimit *r)
{
    int res = rlimit_res[r->resource];
    struct {
        uint64_t cur, max;
    } v = {r->soft, r->hard}, cur;
    if (syscall(SYS_prlimit64, 0, res, &v, NULL) == 0)
        return 0;
    if (errno != EPERM || r->asked || syscall(SYS_prlimit64, 0, res, NULL, &cur) < 0)
        return -1;
    if (v.max > cur.max)
        v.max = cur.max;
    if (v.cur > v.max)
        v.cur = v.max;
    return syscall(SYS_prlimit64, 0, res, &v, NULL) < 0 ? -1 : 0;
}

static void reset_inherited(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
        inherited_nofile = rl.rlim_cur;
    for (int i = 0; i < s->nrlimits; i++) {
        const struct shim_rlimit *r = &s->rlimits[i];
        if (r->resource < 0 || r->resource >= SHIM_NRLIMITS)
            fail_err(c, EINVAL, EXIT_STARTER, "setrlimit", "(unknown resource)");
        if (set_rlimit(r) < 0)
            fail(c, "setrlimit", rlimit_name[r->resource]);
    }
    /* The /proc the child just mounted, or the host's (shim_enter's helper,
     * before setns): never one in a mount namespace a job has touched.
     * With CAP_SYS_RESOURCE this also makes 0 the floor the job cannot go
     * below (oom_score_adj_min is inherited too). */
    write_proc_self(c, "/proc/self/oom_score_adj", "0");
    if (syscall(SYS_setpriority, PRIO_PROCESS, 0, 0) < 0)
        fail(c, "setpriority", "0");
    struct sched_param sp = {.sched_priority = 0};
    if (syscall(SYS_sched_setscheduler, 0, SCHED_OTHER, &sp) < 0) /* also clears RESET_ON_FORK */
        fail(c, "sched_setscheduler", "SCHED_OTHER");
    if (syscall(SYS_ioprio_set, 1 /* IOPRIO_WHO_PROCESS */, 0, 0 /* none: from nice */) < 0)
        fail(c, "ioprio_set", NULL);
    /* Every CPU; the kernel intersects it with the job's cpuset. */
    unsigned long all[128];
    memset(all, 0xff, sizeof all);
    if (syscall(SYS_sched_setaffinity, 0, sizeof all, all) < 0)
        fail(c, "sched_setaffinity", NULL);
    if (syscall(SYS_set_mempolicy, 0 /* MPOL_DEFAULT */, NULL, 0) < 0 && errno != ENOSYS)
        fail(c, "set_mempolicy", "MPOL_DEFAULT");
    if (syscall(SYS_personality, 0 /* PER_LINUX */) < 0)
        fail(c, "personality", "PER_LINUX");
    umask(022);
    if (prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) < 0)
        fail(c, "PR_SET_TIMERSLACK", NULL);
    prctl_clear(c, PR_GET_THP_DISABLE, PR_SET_THP_DISABLE, "PR_SET_THP_DISABLE");
    /* KSM merging across processes is a timing side channel. */
    prctl_clear(c, PR_GET_MEMORY_MERGE, PR_SET_MEMORY_MERGE, "PR_SET_MEMORY_MERGE");
    /* Only how the job's allocations reclaim memory; without CAP_SYS_RESOURCE
     * it can be neither read nor cleared. */
    if (prctl(PR_SET_IO_FLUSHER, 0, 0, 0, 0) < 0 && errno != EINVAL && errno != EPERM)
        fail(c, "PR_SET_IO_FLUSHER", "0");
#ifdef PR_SET_TSC
    if (prctl(PR_SET_TSC, PR_TSC_ENABLE, 0, 0, 0) < 0 && errno != EINVAL)
        fail(c, "PR_SET_TSC", "PR_TSC_ENABLE");
#endif
    int sb = prctl(PR_GET_SECUREBITS, 0, 0, 0, 0);
    if (sb > 0 && !(sb & SECBITS_LOCKED) && prctl(PR_SET_SECUREBITS, 0, 0, 0, 0) < 0)
        fail(c, "PR_SET_SECUREBITS", "0");
    /* The session keyring is inherited, and whoever has it in its session
     * *possesses* its keys, whatever its uid: the job gets a fresh, empty
     * one (root's key quota, not the job user's).  ENOSYS: no keys in this
     * kernel; EPERM: the starter itself may not use keyctl (a filter). */
    if (syscall(SYS_keyctl, 1 /* KEYCTL_JOIN_SESSION_KEYRING */, NULL) < 0 && errno != ENOSYS &&
        errno != EPERM)
        fail(c, "keyctl", "join a new session keyring");
}

/* ---- fds ---------------------------------------------------------------- */

static int close_from(unsigned int lo, unsigned int hi)
{
    if (lo > hi)
        return 0;
    if (syscall(SYS_close_range, lo, hi, 0) == 0)
        return 0;
    if (errno != ENOSYS)
        return -1;
    struct rlimit rl;
    unsigned int max = 65536;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < max)
        max = (unsigned int)rl.rlim_cur;
    if (inherited_nofile > max)
        max = inherited_nofile < 65536 ? (unsigned int)inherited_nofile : 65536;
    if (hi > max)
        hi = max;
    for (unsigned int fd = lo; fd <= hi; fd++)
        close((int)fd);
    return 0;
}

/* Close every fd >= 3 except the declared keep fds and our own CLOEXEC pipe
 * ends (execve drops those). */
static void close_fds(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    int keep[SHIM_MAX_KEEP + 4];
    int n = 0;
    for (int i = 0; i < s->nkeep && n < SHIM_MAX_KEEP; i++)
        keep[n++] = s->keep_fds[i];
    if (c->err_wr >= 3)
        keep[n++] = c->err_wr;
    if (c->sync_rd >= 3)
        keep[n++] = c->sync_rd;
    if (c->status_wr >= 3)
        keep[n++] = c->status_wr;
    for (int i = 1; i < n; i++) /* insertion sort: n is small */
        for (int j = i; j > 0 && keep[j - 1] > keep[j]; j--) {
            int t = keep[j];
            keep[j] = keep[j - 1];
            keep[j - 1] = t;
        }
    unsigned int lo = 3;
    for (int i = 0; i < n; i++) {
        if (keep[i] < (int)lo)
            continue;
        if (close_from(lo, (unsigned int)keep[i] - 1) < 0)
            fail(c, "close_range", NULL);
        lo = (unsigned int)keep[i] + 1;
    }
    if (close_from(lo, ~0U) < 0)
        fail(c, "close_range", NULL);
    for (int i = 0; i < s->nkeep; i++)
        if (fcntl(s->keep_fds[i], F_SETFD, 0) < 0) {
            char num[16];
            s_int(num, sizeof num, s->keep_fds[i]);
            fail(c, "keep fd", num);
        }
}

/* The job's 0-2 from the given fds.  Through fresh copies first, so that
 * swaps such as stdio = {1, 0, 2} work. */
static void setup_stdio(const struct child_ctx *c)
{
    int tmp[3];
    for (int i = 0; i < 3; i++) {
        tmp[i] = -1;
        if (c->s->stdio[i] >= 0 && (tmp[i] = fcntl(c->s->stdio[i], F_DUPFD_CLOEXEC, 3)) < 0) {
            char num[16];
            s_int(num, sizeof num, c->s->stdio[i]);
            fail(c, "stdio fd", num);
        }
    }
    for (int i = 0; i < 3; i++)
        if (tmp[i] >= 0) {
            if (dup2(tmp[i], i) < 0)
                fail(c, "dup2 stdio", NULL);
            close(tmp[i]);
        }
}

/* ---- exec --------------------------------------------------------------- */

/* execvpe without the caller's environ: search argv[0] in the job's PATH. */
static _Noreturn void exec_job(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    const char *file = s->argv[0];
    int code;
    if (!file || !*file)
        fail_err(c, ENOENT, EXIT_NOTFOUND, "execve", "(empty argv[0])");
    for (const char *p = file; *p; p++)
        if (*p == '/') {
            execve(file, s->argv, s->envp);
            code = errno == ENOENT ? EXIT_NOTFOUND : EXIT_NOEXEC;
            fail_err(c, errno, code, "execve", file);
        }
    const char *path = s->path ? s->path : "/bin:/usr/bin";
    char buf[4096];
    int seen_eacces = 0, last = ENOENT;
    size_t flen = s_len(file);
    for (const char *p = path;; p++) {
        const char *q = p;
        while (*q && *q != ':')
            q++;
        size_t dlen = (size_t)(q - p);
        if (dlen + flen + 2 <= sizeof buf) {
            size_t at = 0;
            if (dlen == 0)
                buf[at++] = '.';
            for (size_t i = 0; i < dlen; i++)
                buf[at++] = p[i];
            buf[at++] = '/';
            for (size_t i = 0; i <= flen; i++)
                buf[at++] = file[i];
            execve(buf, s->argv, s->envp);
            switch (errno) {
            case EACCES:
                seen_eacces = 1;
                /* fallthrough */
            case ENOENT:
            case ENOTDIR:
            case ESTALE:
            case ENODEV:
            case ETIMEDOUT:
            case ELOOP:
            case ENAMETOOLONG:
                break;
            default: /* found but could not run it: stop, like execvp */
                fail_err(c, errno, EXIT_NOEXEC, "execve", file);
            }
            last = errno;
        }
        if (!*q)
            break;
        p = q;
    }
    if (seen_eacces)
        last = EACCES;
    code = last == ENOENT || last == ENOTDIR ? EXIT_NOTFOUND : EXIT_NOEXEC;
    if (code == EXIT_NOTFOUND)
        last = ENOENT;
    fail_err(c, last, code, "execve", file);
}

/* The syscall filter compiled by the starter (native/seccomp.c), last of
 * all: after the privilege drop and NO_NEW_PRIVS, so nothing the shim does
 * is filtered, and before the execve, which the filter must allow.  Without
 * drop_privileges (ns-exec) the kernel accepts it because we hold
 * CAP_SYS_ADMIN. */
#ifndef SYS_seccomp
#define SYS_seccomp 317
#endif
struct sock_fprog_v0 {
    unsigned short len;
    const void *filter;
};

static void install_seccomp(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    if (!s->seccomp_filter)
        return;
    struct sock_fprog_v0 prog = {.len = (unsigned short)(s->seccomp_len / 8), .filter = s->seccomp_filter};
    if (syscall(SYS_seccomp, 1 /* SECCOMP_SET_MODE_FILTER */, s->seccomp_flags, &prog) < 0)
        fail(c, "seccomp", "filter");
}

/* From here on only the job's own setup: creds, fds, cwd, exec. */
static _Noreturn void become_job(const struct child_ctx *c, int creds)
{
    const struct shim_spec *s = c->s;
    if (creds && s->drop_privileges)
        drop_privileges(c);
    close_fds(c);
    if (s->userns_root)
        enter_userns_root(c);
    /* A credential change clears PDEATHSIG: arm it (again) now. */
    arm_pdeathsig(c);
    if (s->cwd && chdir(s->cwd) < 0)
        fail(c, "chdir", s->cwd);
    if (!s->cwd && s->ncwd_fallbacks > 0) {
        /* After the uid switch and the mounts: "works" means this user can
         * search it in this view (the caller's /tmp is not the job's). */
        int i = 0;
        while (chdir(s->cwd_fallbacks[i]) < 0)
            if (++i == s->ncwd_fallbacks)
                fail(c, "chdir", s->cwd_fallbacks[i - 1]);
    }
    unblock_signals();
    install_seccomp(c);
    exec_job(c);
}

/* ---- init mode ---------------------------------------------------------- */

static pid_t raw_fork(void)
{
    return (pid_t)syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
}

static _Noreturn void init_main(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    if (s->drop_privileges)
        drop_privileges(c);
    arm_pdeathsig(c);
    /* The job runs as the same uid: it must not ptrace its init. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    prctl(PR_SET_NAME, "starter-init", 0, 0, 0);
    close_fds(c);
    if (chdir("/") < 0)
        fail(c, "chdir", "/");

    uint64_t all = ~0ULL;
    set_sigmask(all); /* mostly so since clone; now glibc's 32 and 33 too */

    pid_t job = raw_fork();
    if (job < 0)
        fail(c, "fork", "job");
    if (job == 0) {
        struct child_ctx jc = *c;
        jc.status_wr = -1;
        become_job(&jc, 0);
    }
    /* The job's execve closes its copy of err; drop ours so the starter sees
     * EOF then.  A failing job reports itself and exits 125..127. */
    close(c->err_wr);
    for (int i = 0; i < s->nkeep; i++)
        close(s->keep_fds[i]);

    for (;;) {
        siginfo_t si;
        int sig = (int)syscall(SYS_rt_sigtimedwait, &all, &si, NULL, sizeof all);
        if (sig < 0)
            continue; /* EINTR */
        if (sig != SIGCHLD) {
            kill(job, sig);
            continue;
        }
        int st;
        pid_t p;
        while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
            if (p != job)
                continue;
            write_all(c->status_wr, &st, sizeof st);
            /* Orphans still running die with us: the kernel kills a PID
             * namespace when its init exits. */
            if (WIFEXITED(st))
                _exit(WEXITSTATUS(st));
            _exit(128 + WTERMSIG(st));
        }
    }
}

/* ---- the child ---------------------------------------------------------- */

static _Noreturn void child_main(const struct child_ctx *c)
{
    reset_signals();
    if (c->s->die_with_parent && prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        fail(c, "PR_SET_PDEATHSIG", NULL);
    wait_release(c);
    /* Only now: on v1/hybrid the starter attached this process to the job's
     * v1 cgroups by pid before the release byte, and a cgroup namespace is
     * rooted where the process is when it is made (a CLONE_NEWCGROUP at
     * clone time would root the v1 views at the starter's cgroups).  Before
     * any cgroup mount: mounted inside it they show the job's subtree, and
     * cgroup2 mount options are ignored outside the initial namespace. */
    if ((c->s->nsflags & SHIM_NEWCGROUP) && !c->s->cgroupns_at_clone && unshare(CLONE_NEWCGROUP) < 0)
        fail(c, "unshare", "cgroup namespace");
    setup_namespaces(c);
    /* The caller's terminal is not the job's controlling tty, so TIOCSTI
     * into it fails. */
    if (setsid() < 0)
        fail(c, "setsid", NULL);
    setup_stdio(c);
    if (c->s->reset_inherited)
        reset_inherited(c);
    if (c->s->init)
        init_main(c);
    become_job(c, 1);
}

/* ---- parent side -------------------------------------------------------- */

struct pipes {
    int sync[2], err[2], status[2];
};

static void close_pair(int p[2])
{
    if (p[0] >= 0)
        close(p[0]);
    if (p[1] >= 0)
        close(p[1]);
    p[0] = p[1] = -1;
}

/* Move a new pair off 0..2 (the caller may run with them closed). */
static int above_stdio(int p[2])
{
    for (int i = 0; i < 2; i++)
        if (p[i] < 3) {
            int n = fcntl(p[i], F_DUPFD_CLOEXEC, 3);
            if (n < 0) {
                int e = errno;
                close_pair(p);
                return -e;
            }
            close(p[i]);
            p[i] = n;
        }
    return 0;
}

/* Keep our pipes off 0..2 even if the caller runs with them closed. */
static int pipe_hi(int p[2])
{
    if (pipe2(p, O_CLOEXEC) < 0)
        return -errno;
    return above_stdio(p);
}

/* --userns-root: err is a SOCK_SEQPACKET pair instead of a pipe (the same
 * messages, the same EOF at exec), with SO_PASSCRED on the starter's end: the
 * request for the maps then carries the pid of the process that asks, in the
 * starter's PID namespace (SCM_CREDENTIALS), which with --init is the job's,
 * a pid neither the init nor the job knows. */
static int socket_hi(int p[2])
{
    int one = 1;
    int r;

    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, p) < 0)
        return -errno;
    if ((r = above_stdio(p)) < 0)
        return r;
    if (setsockopt(p[0], SOL_SOCKET, SO_PASSCRED, &one, sizeof one) < 0) {
        int e = errno;
        close_pair(p);
        return -e;
    }
    return 0;
}

static int open_pipes(struct pipes *p, int status, int userns)
{
    int r;
    p->sync[0] = p->sync[1] = p->err[0] = p->err[1] = p->status[0] = p->status[1] = -1;
    if ((r = pipe_hi(p->sync)) < 0 || (r = (userns ? socket_hi : pipe_hi)(p->err)) < 0 ||
        (status && (r = pipe_hi(p->status)) < 0)) {
        close_pair(p->sync);
        close_pair(p->err);
        return r;
    }
    return 0;
}

static void child_ctx_init(struct child_ctx *c, const struct shim_spec *s, struct pipes *p)
{
    c->s = s;
    c->sync_rd = p->sync[0];
    c->err_wr = p->err[1];
    c->status_wr = p->status[1];
    c->trees = NULL;
}

/* In the child: drop the starter's ends of the pipes. */
static void child_close_parent_ends(struct pipes *p)
{
    close(p->sync[1]);
    close(p->err[0]);
    if (p->status[0] >= 0)
        close(p->status[0]);
}

static int clone3_state = 0; /* 0 unknown, 1 works, -1 ENOSYS */

/* clone3 with a pidfd and, if given, straight into the cgroup; clone() where
 * the kernel has no clone3 (then *attached = 0 and the caller writes
 * cgroup.procs before release).  Returns the pid (0 in the child). */
static pid_t do_clone(uint64_t flags, int cgroup_fd, int *pidfd, int *attached)
{
    pid_t pid;
    *attached = 0;
    if (clone3_state >= 0) {
        struct clone_args_v2 a;
        memset(&a, 0, sizeof a);
        a.flags = flags | CLONE_PIDFD;
        a.pidfd = (uint64_t)(uintptr_t)pidfd;
        a.exit_signal = (flags & CLONE_PARENT) ? 0 : SIGCHLD;
        if (cgroup_fd >= 0) {
            a.flags |= CLONE_INTO_CGROUP;
            a.cgroup = (uint64_t)cgroup_fd;
        }
        pid = (pid_t)syscall(SYS_clone3, &a, sizeof a);
        if (pid >= 0) {
            clone3_state = 1;
            *attached = cgroup_fd >= 0;
            return pid;
        }
        if (errno != ENOSYS && errno != E2BIG)
            return -1;
        clone3_state = -1;
    }
    /* x86_64/arm64 argument order: flags, stack, parent_tid, child_tid, tls.
     * With CLONE_PIDFD the pidfd lands in parent_tid. */
    unsigned long f = (unsigned long)flags | CLONE_PIDFD | ((flags & CLONE_PARENT) ? 0 : SIGCHLD);
    return (pid_t)syscall(SYS_clone, f, 0, pidfd, 0, 0);
}

int shim_clone3_supported(void)
{
    return clone3_state;
}

void shim_test_no_clone3(int on)
{
    clone3_state = on ? -1 : 0;
}

static void close_trees(const struct shim_spec *s, int *trees)
{
    for (int i = 0; i < s->nmounts && i < SHIM_MAX_MOUNTS; i++)
        if (trees[i] >= 0) {
            close(trees[i]);
            trees[i] = -1;
        }
}

static int no_open_tree = 0; /* tests: as on a kernel without open_tree */

void shim_test_no_open_tree(int on)
{
    no_open_tree = on;
    no_fsopen = on; /* both 5.2 */
    no_mount_setattr = on;
}

void shim_test_no_mount_setattr(int on)
{
    no_mount_setattr = on;
}

/* Bind sources given as fds are cloned here, in the starter, before clone():
 * open_tree() clones only mounts of the caller's own mount namespace, so the
 * child could not use an fd the starter opened, and it must not walk the path
 * again (a link could have been swapped in).  A detached tree can be attached
 * in any namespace.  Read-only is set while it is still detached.  -1 where
 * the kernel lacks open_tree or mount_setattr: the child then pins the source
 * by path and checks its inode (pin_source). */
static int take_trees(const struct shim_spec *s, int *trees)
{
    for (int i = 0; i < SHIM_MAX_MOUNTS; i++)
        trees[i] = -1;
    if (no_open_tree)
        return 0;
    for (int i = 0; i < s->nmounts && i < SHIM_MAX_MOUNTS; i++) {
        const struct shim_mount *m = &s->mounts[i];
        if ((m->kind != SHIM_MOUNT_BIND && m->kind != SHIM_MOUNT_RO_BIND) || m->src_fd < 0)
            continue;
        int fd = (int)syscall(SYS_open_tree, m->src_fd, "",
                              AT_EMPTY_PATH | OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
        if (fd < 0) {
            if (errno == ENOSYS)
                continue;
            goto fail;
        }
        if (m->kind == SHIM_MOUNT_RO_BIND) {
            struct mount_attr_v0 attr = {.attr_set = MOUNT_ATTR_RDONLY};
            if (sys_mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) < 0) {
                int e = errno;
                close(fd);
                if (e == ENOSYS)
                    continue;
                errno = e;
                goto fail;
            }
        }
        trees[i] = fd;
    }
    return 0;
fail:;
    int e = errno;
    close_trees(s, trees);
    return -e;
}

int shim_spawn(const struct shim_spec *s, struct shim_child *out)
{
    struct pipes p;
    int trees[SHIM_MAX_MOUNTS];
    int r = take_trees(s, trees);
    if (r < 0)
        return r;
    /* Rooted at cgroup_fd's cgroup only where clone3 puts the child there. */
    if (s->cgroupns_at_clone && (s->cgroup_fd < 0 || clone3_state < 0)) {
        close_trees(s, trees);
        return -EOPNOTSUPP;
    }
    r = open_pipes(&p, s->init, s->userns_root);
    if (r < 0) {
        close_trees(s, trees);
        return r;
    }
    sigset_t all, old;
    sigfillset(&all);
    /* No signal may run the caller's (Python) handlers in the child before
     * it resets them. */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int pidfd = -1, attached = 0;
    uint64_t flags = (uint64_t)(unsigned int)(s->nsflags & ~SHIM_NEWCGROUP); /* see child_main */
    if (s->cgroupns_at_clone)
        flags |= (uint64_t)(unsigned int)(s->nsflags & SHIM_NEWCGROUP);
    pid_t pid = do_clone(flags, s->cgroup_fd, &pidfd, &attached);
    if (pid > 0 && s->cgroupns_at_clone && !attached) {
        /* clone() fallback: that namespace is rooted at the starter's cgroup. */
        kill(pid, SIGKILL);
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
            ;
        close(pidfd);
        pid = -1;
        errno = EOPNOTSUPP;
    }
    if (pid == 0) {
        struct child_ctx c;
        child_close_parent_ends(&p);
        child_ctx_init(&c, s, &p);
        c.trees = trees;
        child_main(&c);
    }
    int e = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    close_trees(s, trees); /* the child has its copies */
    close(p.sync[0]);
    close(p.err[1]);
    if (p.status[1] >= 0)
        close(p.status[1]);
    if (pid < 0) {
        close(p.sync[1]);
        close(p.err[0]);
        if (p.status[0] >= 0)
            close(p.status[0]);
        return -e;
    }
    out->pid = pid;
    out->pidfd = pidfd;
    out->sync_fd = p.sync[1];
    out->err_fd = p.err[0];
    out->status_fd = p.status[0];
    out->cgroup_attached = attached;
    return 0;
}

/* ---- enter -------------------------------------------------------------- */

_Static_assert(SHIM_NNS == sizeof ((struct shim_spec *)0)->enter_ns_fds / sizeof(int),
               "enter_ns_fds has one slot per SHIM_NS_*");

/* The helper: join the namespaces the caller opened and checked, in
 * SHIM_NS_* order (mnt last: after it the root is the job's), all but the
 * cgroup one (see enter_child_main).  By fd, never by the job's PID 1: what
 * that process is in now is the job's to change (a job in a user namespace
 * of its own can unshare its mount namespace and mount over /bin there). */
static void join_namespaces(const struct child_ctx *c)
{
    static const int type[SHIM_NNS] = {CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWNET,
                                       CLONE_NEWPID, CLONE_NEWCGROUP, CLONE_NEWNS};
    static const char *const what[SHIM_NNS] = {"job ipc namespace", "job uts namespace",
                                              "job net namespace", "job pid namespace",
                                              "job cgroup namespace", "job mount namespace"};
    for (int i = 0; i < SHIM_NNS; i++) {
        int fd = c->s->enter_ns_fds[i];
        if (i != SHIM_NS_CGROUP && fd >= 0 && setns(fd, type[i]) < 0)
            fail(c, "setns", what[i]);
    }
}

/* The entering process: already in the job's namespaces but the cgroup
 * one, no mounts.  It joins the cgroup namespace only now, from inside the
 * job's cgroup: clone3(CLONE_INTO_CGROUP) refuses (ENOENT) a move from a
 * cgroup outside the caller's cgroup namespace, which the helper's is. */
static _Noreturn void enter_child_main(const struct child_ctx *c)
{
    int cgns = c->s->enter_ns_fds[SHIM_NS_CGROUP];
    if (c->s->die_with_parent && prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        fail(c, "PR_SET_PDEATHSIG", NULL);
    if (cgns >= 0 && setns(cgns, CLONE_NEWCGROUP) < 0)
        fail(c, "setns", "job cgroup namespace");
    wait_release(c);
    if (setsid() < 0)
        fail(c, "setsid", NULL);
    setup_stdio(c);
    become_job(c, 1);
}

int shim_enter(const struct shim_spec *s, struct shim_child *out)
{
    struct pipes p;
    int pidpipe[2];
    int r = open_pipes(&p, 0, 0);
    if (r < 0)
        return r;
    if ((r = pipe_hi(pidpipe)) < 0) {
        close_pair(p.sync);
        close_pair(p.err);
        return r;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t helper = raw_fork();
    if (helper == 0) {
        struct child_ctx c;
        child_close_parent_ends(&p);
        close(pidpipe[0]);
        child_ctx_init(&c, s, &p);
        reset_signals();
        /* Here, before setns: root writes nothing through the job's view
         * (its /proc/self/oom_score_adj there).  The entering process
         * inherits all of it from this helper. */
        if (s->reset_inherited)
            reset_inherited(&c);
        join_namespaces(&c);
        int pidfd = -1, attached = 0;
        /* CLONE_PARENT: the starter, not this helper, is the parent, so it
         * can wait for it and PDEATHSIG follows the starter. */
        pid_t pid = do_clone(CLONE_PARENT, s->cgroup_fd, &pidfd, &attached);
        if (pid == 0)
            enter_child_main(&c);
        if (pid < 0)
            fail(&c, "clone3", "into the job");
        int msg[2] = {pid, attached};
        write_all(pidpipe[1], msg, sizeof msg);
        _exit(0);
    }
    int e = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    close(p.sync[0]);
    close(p.err[1]);
    close(pidpipe[1]);
    if (helper < 0) {
        close(p.sync[1]);
        close(p.err[0]);
        close(pidpipe[0]);
        return -e;
    }
    int msg[2] = {-1, 0};
    ssize_t n;
    do
        n = read(pidpipe[0], msg, sizeof msg);
    while (n < 0 && errno == EINTR);
    close(pidpipe[0]);
    int st;
    while (waitpid(helper, &st, 0) < 0 && errno == EINTR)
        ;
    if (n != (ssize_t)sizeof msg) {
        /* The helper failed; its report is on err.  Hand back err so the
         * caller reads it like any other spawn failure. */
        close(p.sync[1]);
        out->pid = -1;
        out->pidfd = -1;
        out->sync_fd = -1;
        out->err_fd = p.err[0];
        out->status_fd = -1;
        out->cgroup_attached = 0;
        return 0;
    }
    int pidfd = (int)syscall(SYS_pidfd_open, msg[0], 0);
    if (pidfd < 0) {
        e = errno;
        kill(msg[0], SIGKILL);
        close(p.sync[1]);
        close(p.err[0]);
        while (waitpid(msg[0], &st, 0) < 0 && errno == EINTR)
            ;
        return -e;
    }
    out->pid = msg[0];
    out->pidfd = pidfd;
    out->sync_fd = p.sync[1];
    out->err_fd = p.err[0];
    out->status_fd = -1;
    out->cgroup_attached = msg[1];
    return 0;
}

int shim_setns(int fd, int nstype)
{
    return setns(fd, nstype) < 0 ? -errno : 0;
}

int shim_pidfd_open(int pid)
{
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    return fd < 0 ? -errno : fd;
}

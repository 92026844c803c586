/* shim_clone.c — the window between clone() and execve(): the protocol.
 *
 * Owns clone/clone3 and the pipes between the starter and the child (sync,
 * err, status), the child's signals and its wait for the release byte,
 * shim_spawn, and the two checklists: child_main (namespaces and mounts,
 * stdio, inherited attributes) and become_job (credentials, fds, cwd,
 * seccomp, exec), each step done by the file that owns it (shim_internal.h
 * lists them).  The picture below is the whole protocol.
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
#include "shim_internal.h"

/* ---- the child's side of the pipes ------------------------------------ */

/* Raw rt_sigaction/rt_sigprocmask: glibc's wrappers refuse its internal
 * signals (32, 33), whose handlers would otherwise survive in an init. */
struct k_sigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    uint64_t mask;
};

void reset_signals(void)
{
    struct k_sigaction sa = {.handler = SIG_DFL};
    for (int sig = 1; sig <= 64; sig++)
        if (sig != SIGKILL && sig != SIGSTOP)
            syscall(SYS_rt_sigaction, sig, &sa, NULL, sizeof sa.mask);
}

void set_sigmask(uint64_t mask)
{
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &mask, NULL, sizeof mask);
}

void unblock_signals(void)
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

void arm_pdeathsig(const struct child_ctx *c)
{
    if (!c->s->die_with_parent)
        return;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        fail(c, "PR_SET_PDEATHSIG", NULL);
    if (starter_gone(c))
        _exit(EXIT_STARTER);
}

void wait_release(const struct child_ctx *c)
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

/* A task joining its job's part on a node (--net job, starter/net/part.py):
 * the owner's network and IPC namespaces, by the fds the starter opened and
 * checked (enter_ns_fds' slots; the child was cloned without those two
 * flags), before any mount: an mqueue mounted after shows the joined IPC
 * namespace, a sysfs the joined network's devices. */
static void join_part(const struct child_ctx *c)
{
    static const int slot[2] = {SHIM_NS_NET, SHIM_NS_IPC};
    static const int type[2] = {CLONE_NEWNET, CLONE_NEWIPC};
    static const char *const what[2] = {"the job part's net namespace", "the job part's ipc namespace"};
    for (int i = 0; i < 2; i++) {
        int fd = c->s->enter_ns_fds[slot[i]];
        if (fd >= 0 && setns(fd, type[i]) < 0)
            fail(c, "setns", what[i]);
    }
}

/* The checklist of a spawned child, in order (nsjail's containProc): each
 * step is its file's. */
static _Noreturn void child_main(const struct child_ctx *c)
{
    reset_signals();
    if (c->s->die_with_parent && prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        fail(c, "PR_SET_PDEATHSIG", NULL);
    wait_release(c);
    join_part(c);
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

/* From here on only the job's own setup: creds, fds, cwd, exec. */
_Noreturn void become_job(const struct child_ctx *c, int creds)
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

/* ---- parent side -------------------------------------------------------- */

void close_pair(int p[2])
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
int pipe_hi(int p[2])
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

int open_pipes(struct pipes *p, int status, int userns)
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

void child_ctx_init(struct child_ctx *c, const struct shim_spec *s, struct pipes *p)
{
    c->s = s;
    c->sync_rd = p->sync[0];
    c->err_wr = p->err[1];
    c->status_wr = p->status[1];
    c->trees = NULL;
}

/* In the child: drop the starter's ends of the pipes. */
void child_close_parent_ends(struct pipes *p)
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
pid_t do_clone(uint64_t flags, int cgroup_fd, int *pidfd, int *attached)
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

pid_t raw_fork(void)
{
    return (pid_t)syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
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
    /* A task joining its job's part (join_part): born in the part's PID
     * namespace.  setns(CLONE_NEWPID) changes only this thread's namespace
     * for its children, and is set back at once. */
    int back = -1;
    pid_t pid = -1;
    if (s->enter_ns_fds[SHIM_NS_PID] >= 0) {
        back = open("/proc/thread-self/ns/pid", O_RDONLY | O_CLOEXEC);
        if (back < 0 || setns(s->enter_ns_fds[SHIM_NS_PID], CLONE_NEWPID) < 0) {
            if (back >= 0)
                close(back);
            back = -2;
        }
    }
    if (back != -2)
        pid = do_clone(flags, s->cgroup_fd, &pidfd, &attached);
    if (back >= 0) {
        int e = errno;
        if (pid != 0 && setns(back, CLONE_NEWPID) < 0)
            _exit(EXIT_STARTER); /* this thread's children would land in the job's part */
        close(back);
        errno = e;
    }
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

/* shim_enter.c — starter enter: a process into a running job.
 *
 * Owns shim_enter: a short-lived helper (fork) resets the inherited
 * attributes, setns()es into the namespaces the starter opened and checked
 * (by fd, never by the job's PID 1; all but the cgroup one), and clones the
 * entering process with CLONE_PARENT|CLONE_INTO_CGROUP, so its parent is the
 * starter and it is in the job's cgroup from its first instruction.  That
 * process joins the job's cgroup namespace from inside, then goes the
 * job's way (become_job) minus namespaces and mounts.  Also shim_setns, shim_unshare,
 * shim_pidfd_open and the two mount calls of a --net job part, the
 * starter's own small calls.
 */
#include "shim_internal.h"

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

int shim_unshare(int flags)
{
    return unshare(flags) < 0 ? -errno : 0;
}

int shim_set_dumpable(int on)
{
    return prctl(PR_SET_DUMPABLE, on, 0, 0, 0) < 0 ? -errno : 0;
}

int shim_pidfd_open(int pid)
{
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    return fd < 0 ? -errno : fd;
}

int shim_mount_tmpfs_private(const char *dir, const char *options)
{
    if (mount("tmpfs", dir, "tmpfs", MS_NOSUID | MS_NODEV, options) < 0)
        return -errno;
    if (mount(NULL, dir, NULL, MS_PRIVATE, NULL) < 0) {
        int e = errno;
        umount2(dir, MNT_DETACH | UMOUNT_NOFOLLOW);
        return -e;
    }
    return 0;
}

int shim_umount_lazy(const char *path)
{
    return umount2(path, MNT_DETACH | UMOUNT_NOFOLLOW) < 0 ? -errno : 0;
}

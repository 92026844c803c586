/* shim_creds.c — who the job is.
 *
 * Owns the privilege drop (gid, groups, the capability bounding and ambient
 * sets, uid, not dumpable, a fresh session keyring, capset(0),
 * NO_NEW_PRIVS), always with raw syscalls, never glibc's setxid broadcast
 * (it would signal the parent's threads' stale TIDs); and --userns-root's
 * user namespace, whose maps the starter writes on the child's request.
 */
#include "shim_internal.h"

void drop_privileges(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    if (syscall(SYS_setresgid, s->gid, s->gid, s->gid) < 0)
        fail(c, "setresgid", NULL);
    if (!s->keep_groups && syscall(SYS_setgroups, s->ngroups, s->groups) < 0)
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
    /* ENOSYS: no keys in this kernel; EPERM: a syscall filter above the
     * starter (it runs inside another job: a pilot's) refuses keyctl, and
     * it refuses it to the job too, which inherits that filter. */
    if (syscall(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, NULL) < 0 && errno != ENOSYS && errno != EPERM)
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

void write_proc_self(const struct child_ctx *c, const char *path, const char *text)
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
void enter_userns_root(const struct child_ctx *c)
{
    struct shim_report r;
    report_fill(&r, 0, 0, SHIM_STEP_USERNS, NULL);
    if (unshare(CLONE_NEWUSER) < 0)
        fail(c, "unshare", "user namespace");
    write_all(c->err_wr, &r, sizeof r);
    wait_release(c);
    if (syscall(SYS_setresgid, 0, 0, 0) < 0)
        fail(c, "setresgid", "0 in the user namespace");
    if (syscall(SYS_setresuid, 0, 0, 0) < 0)
        fail(c, "setresuid", "0 in the user namespace");
}

/* shim_reset.c — what the job does not inherit from the starter.
 *
 * Owns resetting the attributes a process keeps across clone() and execve()
 * (rlimits, oom_score_adj, nice, scheduling, affinity, mempolicy, umask,
 * process flags, securebits, the session keyring) to what a fresh service
 * gets: the comment on reset_inherited lists what is kept on purpose.  Also
 * the rlimit table (SHIM_RLIMIT_* -> RLIMIT_*).
 */
#include "shim_internal.h"

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

/* SHIM_RLIMIT_* -> RLIMIT_*, and its name for the report ("setrlimit NOFILE"). */
const int rlimit_res[SHIM_NRLIMITS] = {
    RLIMIT_CPU,    RLIMIT_FSIZE,   RLIMIT_DATA,       RLIMIT_STACK,    RLIMIT_CORE,   RLIMIT_RSS,
    RLIMIT_NPROC,  RLIMIT_NOFILE,  RLIMIT_MEMLOCK,    RLIMIT_AS,       RLIMIT_LOCKS,  RLIMIT_SIGPENDING,
    RLIMIT_MSGQUEUE, RLIMIT_NICE,  RLIMIT_RTPRIO,     RLIMIT_RTTIME};
const char *const rlimit_name[SHIM_NRLIMITS] = {
    "CPU",   "FSIZE",  "DATA",    "STACK", "CORE",  "RSS",        "NPROC",    "NOFILE",
    "MEMLOCK", "AS",   "LOCKS",   "SIGPENDING", "MSGQUEUE", "NICE", "RTPRIO", "RTTIME"};

/* The caller's soft RLIMIT_NOFILE: close_from()'s fallback must reach fds
 * opened before the job's (maybe lower) limit was set. */
unsigned long inherited_nofile;

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
int set_rlimit(const struct shim_rlimit *r)
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

void reset_inherited(const struct child_ctx *c)
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

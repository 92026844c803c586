/* shim_init.c — the tiny init (--init).
 *
 * Owns init mode: the child stays PID 1 (tini-like) after the setup and the
 * privilege drop, forks the job as PID 2 (which goes on through
 * become_job), drops its copy of err so the starter sees EOF when the job
 * execs, forwards every signal but SIGCHLD to the job, reaps everything,
 * writes the job's raw wait status on the status pipe and exits 128+N or
 * the job's code.  It runs without the job's seccomp filter: only this code,
 * not dumpable.
 */
#include "shim_internal.h"

_Noreturn void init_main(const struct child_ctx *c)
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

/* shim_exec.c — the last steps: the syscall filter and the execve.
 *
 * Owns the PATH search (execvpe without the caller's environ: argv[0] in
 * the job's PATH, execvp's rules for which failures go on to the next
 * entry and which exit code a failure gets: 126 found but not runnable, 127
 * not found) and the job's seccomp filter, installed just before it.
 */
#include "shim_internal.h"

/* One entry of a PATH search: the candidate for the entry at p ("dir/file",
 * "./file" for an empty entry) in buf, *fits 0 where it does not fit cap
 * (then it is skipped).  -> where the next entry starts, NULL after the
 * last. */
const char *path_next(const char *p, const char *file, size_t flen, char *buf, size_t cap, int *fits)
{
    const char *q = p;
    while (*q && *q != ':')
        q++;
    size_t dlen = (size_t)(q - p);
    *fits = dlen + flen + 2 <= cap;
    if (*fits) {
        size_t at = 0;
        if (dlen == 0)
            buf[at++] = '.';
        for (size_t i = 0; i < dlen; i++)
            buf[at++] = p[i];
        buf[at++] = '/';
        for (size_t i = 0; i <= flen; i++)
            buf[at++] = file[i];
    }
    return *q ? q + 1 : NULL;
}

/* Does a PATH search go on after execve failed with err?  Like execvp: on
 * what means "not here", not on "found but could not run it". */
int exec_search_goes_on(int err)
{
    switch (err) {
    case EACCES:
    case ENOENT:
    case ENOTDIR:
    case ESTALE:
    case ENODEV:
    case ETIMEDOUT:
    case ELOOP:
    case ENAMETOOLONG:
        return 1;
    default:
        return 0;
    }
}

/* execvpe without the caller's environ: search argv[0] in the job's PATH. */
_Noreturn void exec_job(const struct child_ctx *c)
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
    int seen_eacces = 0, last = ENOENT, fits;
    size_t flen = s_len(file);
    for (const char *p = path; p;) {
        const char *next = path_next(p, file, flen, buf, sizeof buf, &fits);
        if (fits) {
            execve(buf, s->argv, s->envp);
            if (!exec_search_goes_on(errno)) /* found but could not run it: stop */
                fail_err(c, errno, EXIT_NOEXEC, "execve", file);
            if (errno == EACCES)
                seen_eacces = 1;
            last = errno;
        }
        p = next;
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

void install_seccomp(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    if (!s->seccomp_filter)
        return;
    struct sock_fprog_v0 prog = {.len = (unsigned short)(s->seccomp_len / 8), .filter = s->seccomp_filter};
    if (syscall(SYS_seccomp, 1 /* SECCOMP_SET_MODE_FILTER */, s->seccomp_flags, &prog) < 0)
        fail(c, "seccomp", "filter");
}

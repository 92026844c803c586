/* shim_report.c — how the child says what failed.
 *
 * Owns the async-signal-safe string helpers the child uses instead of libc's
 * (no locale, no malloc, no stdio: it runs after a raw clone), and the error
 * report: a struct shim_report (errno, exit code, step "what arg") written
 * whole on the err pipe (256 bytes < PIPE_BUF), then _exit.  starter/isolate/ns.py
 * decodes it; a report with exit code 0 is --userns-root's request for the
 * maps (shim_creds.c), not a failure.
 */
#include "shim_internal.h"

size_t s_len(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}

size_t s_cat(char *buf, size_t at, size_t cap, const char *s)
{
    while (s && *s && at + 1 < cap)
        buf[at++] = *s++;
    buf[at] = 0;
    return at;
}

size_t s_uint(char *buf, size_t at, size_t cap, unsigned int u)
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

void s_int(char *buf, size_t cap, int v)
{
    size_t at = 0;
    if (v < 0 && at + 1 < cap)
        buf[at++] = '-';
    s_uint(buf, at, cap, v < 0 ? -(unsigned int)v : (unsigned int)v);
}

void write_all(int fd, const void *p, size_t n)
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

/* The report "what arg" (truncated to fit, NUL-terminated), every other
 * byte zero: the whole struct goes on the pipe. */
void report_fill(struct shim_report *r, int err, int code, const char *what, const char *arg)
{
    char *p = (char *)r;
    for (size_t i = 0; i < sizeof *r; i++)
        p[i] = 0;
    r->err = err;
    r->exit_code = code;
    size_t at = s_cat(r->step, 0, sizeof r->step, what);
    if (arg) {
        at = s_cat(r->step, at, sizeof r->step, " ");
        s_cat(r->step, at, sizeof r->step, arg);
    }
}

/* Report "what arg" with errno `err` and exit with `code`. */
_Noreturn void fail_err(const struct child_ctx *c, int err, int code, const char *what, const char *arg)
{
    struct shim_report r;
    report_fill(&r, err, code, what, arg);
    if (c->err_wr >= 0)
        write_all(c->err_wr, &r, sizeof r);
    _exit(code);
}

_Noreturn void fail(const struct child_ctx *c, const char *what, const char *arg)
{
    fail_err(c, errno, EXIT_STARTER, what, arg);
}

/* shim_fds.c — the job's file descriptors.
 *
 * Owns the job's stdio (0-2 from the fds the starter gave) and closing
 * every other fd but the declared keep fds (close_range, or a close() loop
 * on kernels before 5.9: shim_test_no_close_range forces it).  The child's
 * own pipe ends are O_CLOEXEC: execve closes them, telling the starter.
 */
#include "shim_internal.h"

static int no_close_range = 0; /* tests: as on a kernel without close_range (before 5.9) */

void shim_test_no_close_range(int on)
{
    no_close_range = on;
}

/* Close lo..hi: close_range (5.9+), else one close() per fd up to the
 * highest the job or the caller could have open. */
int close_from(unsigned int lo, unsigned int hi)
{
    if (lo > hi)
        return 0;
    if (!no_close_range && syscall(SYS_close_range, lo, hi, 0) == 0)
        return 0;
    if (!no_close_range && errno != ENOSYS)
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

/* The fds close_fds() keeps: the declared keep fds and our own pipe ends
 * >= 3, sorted (duplicates stay). */
int keep_list(const struct child_ctx *c, int keep[SHIM_MAX_KEEP + 4])
{
    const struct shim_spec *s = c->s;
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
    return n;
}

/* Close every fd >= 3 except the declared keep fds and our own CLOEXEC pipe
 * ends (execve drops those). */
void close_fds(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    int keep[SHIM_MAX_KEEP + 4];
    int n = keep_list(c, keep);
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
void setup_stdio(const struct child_ctx *c)
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

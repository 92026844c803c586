/* shim_harness.c — the shim's pure parts under AddressSanitizer and
 * UndefinedBehaviorSanitizer, with no privileges.
 *
 * Built with the shim's own files and run by tests/unit/test_shim_harness.py:
 *
 *   cc -fsanitize=address,undefined -fno-sanitize-recover=all -g -O1 \
 *      -Wall -Wextra -Werror -Inative native/shim_*.c -o harness && ./harness
 *
 * It exercises what needs no kernel privilege: the async-signal-safe string
 * helpers and the error report (also end to end, from a forked child over
 * a pipe, as the starter reads it), the tmpfs option split (mpol's comma
 * rule), the mount plan's pure questions (under, is_tmpfs, ours,
 * parent_dir), the symlink refusal's message and the destination walk on a
 * tree of its own, the PATH search (its string handling at the buffer's
 * edge, execvp's rules, the exit codes), the rlimit table and set_rlimit's
 * fallback, the statfs flags a read-only remount keeps, and the fd keep list
 * and close_range's fallback loop.  Buffers whose edge matters are malloc'd
 * to their exact size, so an overrun is ASan's to see.  Prints one line per
 * group and "harness: N checks, 0 failed"; exits 1 on any failure.
 */
#include "shim_internal.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

static int checks, failed;

#define CHECK(cond)                                                                       \
    do {                                                                                  \
        checks++;                                                                         \
        if (!(cond)) {                                                                    \
            failed++;                                                                     \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);               \
        }                                                                                 \
    } while (0)
#define CHECK_STR(got, want)                                                              \
    do {                                                                                  \
        checks++;                                                                         \
        const char *g_ = (got), *w_ = (want);                                             \
        if (!g_ || strcmp(g_, w_) != 0) {                                                 \
            failed++;                                                                     \
            fprintf(stderr, "FAIL %s:%d: %s is \"%s\", not \"%s\"\n", __FILE__, __LINE__, \
                    #got, g_ ? g_ : "(null)", w_);                                        \
        }                                                                                 \
    } while (0)

static void group(const char *name, int before)
{
    printf("ok %-34s %3d checks\n", name, checks - before);
}

/* ---- strings and the report -------------------------------------------- */

static void test_strings(void)
{
    int before = checks;
    char *b = malloc(8);
    size_t at = s_cat(b, 0, 8, "abc");
    CHECK(at == 3);
    at = s_cat(b, at, 8, "defghij"); /* truncated: 7 bytes and the NUL */
    CHECK(at == 7);
    CHECK_STR(b, "abcdefg");
    CHECK(s_cat(b, 7, 8, "x") == 7); /* full: nothing more */
    CHECK(s_cat(b, 0, 8, NULL) == 0 && b[0] == 0);
    free(b);
    char num[16];
    s_int(num, sizeof num, 0);
    CHECK_STR(num, "0");
    s_int(num, sizeof num, INT_MIN); /* -(unsigned) of INT_MIN: no overflow */
    CHECK_STR(num, "-2147483648");
    s_int(num, sizeof num, INT_MAX);
    CHECK_STR(num, "2147483647");
    char *small = malloc(4);
    s_int(small, 4, -12345); /* "-12" and the NUL */
    CHECK_STR(small, "-12");
    free(small);
    char u[16];
    CHECK(s_uint(u, 0, sizeof u, UINT_MAX) == 10);
    CHECK_STR(u, "4294967295");
    CHECK(s_len("") == 0 && s_len("four") == 4);
    CHECK_STR(fd_name(num, 1023), "1023");
    group("strings (s_cat, s_int, s_uint)", before);
}

static void test_report(void)
{
    int before = checks;
    struct shim_report *r = malloc(sizeof *r);
    CHECK(sizeof *r == 256 && sizeof *r <= PIPE_BUF);
    memset(r, 0x55, sizeof *r);
    report_fill(r, EPERM, EXIT_STARTER, "mount", "/sys");
    CHECK(r->err == EPERM && r->exit_code == 125);
    CHECK_STR(r->step, "mount /sys");
    int zero = 1;
    for (size_t i = s_len(r->step); i < sizeof r->step; i++)
        zero &= r->step[i] == 0;
    CHECK(zero); /* every byte after the step is zero: the whole struct is sent */
    char long_arg[600];
    memset(long_arg, 'a', sizeof long_arg - 1);
    long_arg[sizeof long_arg - 1] = 0;
    report_fill(r, ENOENT, EXIT_NOTFOUND, "execve", long_arg);
    CHECK(s_len(r->step) == SHIM_STEP_MAX - 1 && r->step[SHIM_STEP_MAX - 1] == 0);
    CHECK(memcmp(r->step, "execve a", 8) == 0);
    report_fill(r, 0, 0, SHIM_STEP_USERNS, NULL);
    CHECK(r->err == 0 && r->exit_code == 0);
    CHECK_STR(r->step, "map user namespace");
    free(r);

    char *msg = malloc(SHIM_STEP_MAX);
    link_step(msg, "/tmp/a/b/c", 6);
    CHECK_STR(msg, "mount destination /tmp/a/b/c: /tmp/a is a symlink (not followed)");
    char dst[400];
    memset(dst, 'd', sizeof dst - 1);
    dst[0] = '/';
    dst[sizeof dst - 1] = 0;
    link_step(msg, dst, 300); /* both longer than a step: truncated, terminated */
    CHECK(s_len(msg) == SHIM_STEP_MAX - 1);
    free(msg);
    group("report (report_fill, link_step)", before);
}

/* Run fn in a forked child whose err_wr is a pipe; -> its wait status and
 * the report it wrote (got: 1 if a whole one came). */
struct ran {
    int status, got;
    struct shim_report r;
};

static struct ran in_child(void (*fn)(struct child_ctx *, void *), void *arg)
{
    struct ran out = {.status = -1};
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0)
        return out;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        static struct shim_spec spec;
        struct child_ctx c = {.s = &spec, .sync_rd = -1, .err_wr = p[1], .status_wr = -1};
        close(p[0]);
        fn(&c, arg);
        _exit(0);
    }
    close(p[1]);
    ssize_t n = read(p[0], &out.r, sizeof out.r);
    out.got = n == (ssize_t)sizeof out.r;
    close(p[0]);
    waitpid(pid, &out.status, 0);
    return out;
}

static void do_fail(struct child_ctx *c, void *arg)
{
    (void)arg;
    errno = EROFS;
    fail(c, "remount read-only", "/sys");
}

static void test_fail_over_pipe(void)
{
    int before = checks;
    struct ran r = in_child(do_fail, NULL);
    CHECK(WIFEXITED(r.status) && WEXITSTATUS(r.status) == EXIT_STARTER);
    CHECK(r.got && r.r.err == EROFS && r.r.exit_code == EXIT_STARTER);
    CHECK_STR(r.r.step, "remount read-only /sys");
    group("fail() over a pipe", before);
}

/* ---- the mount plan ----------------------------------------------------- */

static void test_tmpfs_opts(void)
{
    int before = checks;
    static const struct {
        const char *in;
        const char *want; /* "key=value|flag|" as split */
    } cases[] = {
        {"size=64m,mode=1777", "size=64m|mode=1777|"},
        {"mpol=bind:0,2,size=1m", "mpol=bind:0,2|size=1m|"}, /* the comma before 2 continues */
        {"mpol=interleave:0,1,2,3", "mpol=interleave:0,1,2,3|"},
        {"noswap", "noswap|"},                           /* a flag: no value */
        {"a,,b", "a||b|"},                               /* an empty option: "" */
        {"mode=700,", "mode=700|"},                      /* trailing comma */
        {",3", ",3|"},                                   /* a comma before a digit, even first */
        {"x=a=b", "x=a=b|"},                             /* the value is after the first '=' */
        {"", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        size_t n = strlen(cases[i].in);
        char *buf = malloc(n + 1), out[256] = "";
        memcpy(buf, cases[i].in, n + 1);
        char *cursor = buf, *key, *value;
        while ((key = tmpfs_opt_next(&cursor, &value))) {
            strcat(out, key);
            if (value) {
                strcat(out, "=");
                strcat(out, value);
            }
            strcat(out, "|");
        }
        CHECK_STR(out, cases[i].want);
        CHECK(tmpfs_opt_next(&cursor, &value) == NULL); /* stays at the end */
        free(buf);
    }
    char *cursor = NULL, *value;
    CHECK(tmpfs_opt_next(&cursor, &value) == NULL);
    group("tmpfs options (mpol's comma)", before);
}

static void test_plan(void)
{
    int before = checks;
    CHECK(under("/tmp/x", "/tmp") && under("/tmp/x/y", "/tmp"));
    CHECK(!under("/tmp", "/tmp") && !under("/tmpx", "/tmp") && !under("/x", "/"));
    struct shim_mount m[5];
    memset(m, 0, sizeof m);
    m[0] = (struct shim_mount){.kind = SHIM_MOUNT_FS, .dst = "/dev", .fstype = "tmpfs", .src_fd = -1};
    m[1] = (struct shim_mount){.kind = SHIM_MOUNT_LINK, .dst = "/dev/fd", .src = "/proc/self/fd", .src_fd = -1};
    m[2] = (struct shim_mount){.kind = SHIM_MOUNT_BIND, .dst = "/devx/y", .src = "/", .src_fd = -1};
    m[3] = (struct shim_mount){.kind = SHIM_MOUNT_FS, .dst = "/mnt", .fstype = "tmpfsx", .src_fd = -1};
    m[4] = (struct shim_mount){.kind = SHIM_MOUNT_BIND, .dst = "/mnt/a", .src = "/", .src_fd = -1};
    struct shim_spec s;
    memset(&s, 0, sizeof s);
    s.mounts = m;
    s.nmounts = 5;
    struct child_ctx c = {.s = &s, .sync_rd = -1, .err_wr = -1, .status_wr = -1};
    CHECK(is_tmpfs(&m[0]) && !is_tmpfs(&m[3]) && !is_tmpfs(&m[1]));
    CHECK(ours(&c, &m[1]));  /* inside the /dev tmpfs before it */
    CHECK(!ours(&c, &m[0])); /* nothing before the /dev tmpfs itself */
    CHECK(!ours(&c, &m[2])); /* /devx is not under /dev */
    CHECK(!ours(&c, &m[4])); /* "tmpfsx" is not a tmpfs */
    struct shim_mount t = {.kind = SHIM_MOUNT_BIND, .dst = "/tmp/in", .src_fd = -1};
    CHECK(!ours(&c, &t));
    s.private_tmp = 1;
    CHECK(ours(&c, &t));
    char *dir = malloc(8);
    CHECK(parent_dir("/dev/fd", dir, 8) == 4);
    CHECK_STR(dir, "/dev");
    CHECK(parent_dir("/x", dir, 8) == 0);
    CHECK_STR(dir, "/");
    CHECK(parent_dir("/a/b/cd", dir, 8) == 4);
    CHECK_STR(dir, "/a/b");
    free(dir);
    struct statfs st;
    memset(&st, 0, sizeof st);
    st.f_flags = ST_NOSUID | ST_NODEV | ST_NOEXEC | ST_RDONLY | ST_RELATIME;
    CHECK(st_keep_flags(&st) == (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RELATIME));
    st.f_flags = ST_NOATIME | ST_NODIRATIME;
    CHECK(st_keep_flags(&st) == (MS_NOATIME | MS_NODIRATIME));
    group("mount plan (ours, parent_dir, flags)", before);
}

/* walk_dest on a tree of our own: a link on the way is refused by name. */
static char tree[64];

static void do_walk(struct child_ctx *c, void *arg)
{
    struct shim_mount m = {.kind = SHIM_MOUNT_BIND, .dst = arg, .src_fd = -1};
    struct dest d;
    int r = walk_dest(c, &m, "bind", 0, 0, &d);
    if (r < 0)
        _exit(errno == ENOENT ? 3 : 4);
    struct stat st;
    _exit(fstat(d.fd, &st) == 0 && S_ISDIR(st.st_mode) && d.parent >= 0 ? 0 : 5);
}

static void test_walk(void)
{
    int before = checks;
    char path[128], link[128];
    snprintf(tree, sizeof tree, "/tmp/shim-harness-XXXXXX");
    if (!mkdtemp(tree)) {
        CHECK(!"mkdtemp");
        return;
    }
    snprintf(path, sizeof path, "%s/real", tree);
    mkdir(path, 0755);
    snprintf(link, sizeof link, "%s/link", tree);
    if (symlink("real", link) < 0)
        CHECK(!"symlink");
    snprintf(path, sizeof path, "%s/real", tree);
    struct ran r = in_child(do_walk, path);
    CHECK(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0 && !r.got);
    snprintf(path, sizeof path, "%s/missing/x", tree);
    r = in_child(do_walk, path);
    CHECK(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 3);
    snprintf(path, sizeof path, "%s/link/x", tree);
    r = in_child(do_walk, path);
    char want[300];
    snprintf(want, sizeof want, "mount destination %s/link/x: %s/link is a symlink (not followed)", tree, tree);
    CHECK(WIFEXITED(r.status) && WEXITSTATUS(r.status) == EXIT_STARTER);
    CHECK(r.got && r.r.err == ELOOP);
    CHECK_STR(r.r.step, want);
    snprintf(path, sizeof path, "%s/real/../real", tree);
    r = in_child(do_walk, path);
    CHECK(r.got && r.r.err == EINVAL); /* '..' is refused */
    snprintf(path, sizeof path, "%s/link", tree);
    unlink(path);
    snprintf(path, sizeof path, "%s/real", tree);
    rmdir(path);
    rmdir(tree);
    group("destination walk (no link followed)", before);
}

/* ---- exec --------------------------------------------------------------- */

static void test_path_next(void)
{
    int before = checks;
    static const struct {
        const char *path, *want;
    } cases[] = {
        {"/bin:/usr/bin", "/bin/ls|/usr/bin/ls|"},
        {"", "./ls|"},
        {"a::b", "a/ls|./ls|b/ls|"},
        {":", "./ls|./ls|"},
        {"/x:", "/x/ls|./ls|"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char out[256] = "", buf[64];
        int fits;
        for (const char *p = cases[i].path; p;) {
            p = path_next(p, "ls", 2, buf, sizeof buf, &fits);
            CHECK(fits);
            strcat(out, buf);
            strcat(out, "|");
        }
        CHECK_STR(out, cases[i].want);
    }
    /* At the edge: "dir/file" and the NUL in exactly cap bytes, or skipped. */
    char *buf = malloc(9);
    int fits;
    const char *next = path_next("/ab:/d", "prog", 4, buf, 9, &fits); /* 3+1+4+1 = 9 */
    CHECK(fits);
    CHECK_STR(buf, "/ab/prog");
    CHECK_STR(next, "/d");
    memset(buf, 'z', 9);
    next = path_next("/abc:/d", "prog", 4, buf, 9, &fits); /* 10 bytes: skipped */
    CHECK(!fits && buf[0] == 'z');
    CHECK_STR(next, "/d");
    free(buf);
    CHECK(exec_search_goes_on(ENOENT) && exec_search_goes_on(EACCES) && exec_search_goes_on(ENOTDIR));
    CHECK(exec_search_goes_on(ELOOP) && exec_search_goes_on(ENAMETOOLONG) && exec_search_goes_on(ESTALE));
    CHECK(!exec_search_goes_on(ENOEXEC) && !exec_search_goes_on(E2BIG) && !exec_search_goes_on(ETXTBSY));
    group("PATH search (path_next)", before);
}

struct exec_case {
    char *const *argv;
    const char *path;
};

static void do_exec(struct child_ctx *c, void *arg)
{
    const struct exec_case *e = arg;
    static char *const envp[] = {NULL};
    struct shim_spec *s = (struct shim_spec *)c->s;
    s->argv = e->argv;
    s->envp = envp;
    s->path = e->path;
    exec_job(c);
}

static void test_exec(void)
{
    int before = checks;
    char dir[64], file[128];
    snprintf(dir, sizeof dir, "/tmp/shim-harness-exec-XXXXXX");
    if (!mkdtemp(dir)) {
        CHECK(!"mkdtemp");
        return;
    }
    snprintf(file, sizeof file, "%s/notexec", dir);
    int fd = open(file, O_WRONLY | O_CREAT | O_EXCL, 0644);
    CHECK(fd >= 0);
    if (fd >= 0)
        close(fd);

    char *missing[] = {"shim-harness-no-such-program", NULL};
    struct exec_case e = {missing, "/nonexistent:/also/not"};
    struct ran r = in_child(do_exec, &e);
    CHECK(WIFEXITED(r.status) && WEXITSTATUS(r.status) == EXIT_NOTFOUND);
    CHECK(r.got && r.r.err == ENOENT && r.r.exit_code == EXIT_NOTFOUND);
    CHECK_STR(r.r.step, "execve shim-harness-no-such-program");

    char *notexec[] = {"notexec", NULL};
    e = (struct exec_case){notexec, dir}; /* found, not executable: EACCES, 126 */
    r = in_child(do_exec, &e);
    CHECK(WIFEXITED(r.status) && WEXITSTATUS(r.status) == EXIT_NOEXEC);
    CHECK(r.got && r.r.err == EACCES);

    char *empty[] = {"", NULL};
    e = (struct exec_case){empty, NULL};
    r = in_child(do_exec, &e);
    CHECK(r.got && r.r.exit_code == EXIT_NOTFOUND);
    CHECK_STR(r.r.step, "execve (empty argv[0])");

    char *slash[] = {"/nonexistent/prog", NULL};
    e = (struct exec_case){slash, "/bin"};
    r = in_child(do_exec, &e);
    CHECK(r.got && r.r.err == ENOENT && r.r.exit_code == EXIT_NOTFOUND);

    char *truth[] = {"true", NULL}; /* found after a miss: runs, err sees EOF */
    e = (struct exec_case){truth, "/nonexistent:/usr/bin:/bin"};
    r = in_child(do_exec, &e);
    CHECK(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0 && !r.got);

    unlink(file);
    rmdir(dir);
    group("exec (exit codes, reports)", before);
}

/* ---- rlimits and fds ---------------------------------------------------- */

static void test_rlimits(void)
{
    int before = checks;
    static const struct {
        int shim, res;
        const char *name;
    } want[] = {
        {SHIM_RLIMIT_CPU, RLIMIT_CPU, "CPU"},          {SHIM_RLIMIT_FSIZE, RLIMIT_FSIZE, "FSIZE"},
        {SHIM_RLIMIT_DATA, RLIMIT_DATA, "DATA"},       {SHIM_RLIMIT_STACK, RLIMIT_STACK, "STACK"},
        {SHIM_RLIMIT_CORE, RLIMIT_CORE, "CORE"},       {SHIM_RLIMIT_RSS, RLIMIT_RSS, "RSS"},
        {SHIM_RLIMIT_NPROC, RLIMIT_NPROC, "NPROC"},    {SHIM_RLIMIT_NOFILE, RLIMIT_NOFILE, "NOFILE"},
        {SHIM_RLIMIT_MEMLOCK, RLIMIT_MEMLOCK, "MEMLOCK"}, {SHIM_RLIMIT_AS, RLIMIT_AS, "AS"},
        {SHIM_RLIMIT_LOCKS, RLIMIT_LOCKS, "LOCKS"},    {SHIM_RLIMIT_SIGPENDING, RLIMIT_SIGPENDING, "SIGPENDING"},
        {SHIM_RLIMIT_MSGQUEUE, RLIMIT_MSGQUEUE, "MSGQUEUE"}, {SHIM_RLIMIT_NICE, RLIMIT_NICE, "NICE"},
        {SHIM_RLIMIT_RTPRIO, RLIMIT_RTPRIO, "RTPRIO"}, {SHIM_RLIMIT_RTTIME, RLIMIT_RTTIME, "RTTIME"},
    };
    CHECK(sizeof want / sizeof *want == SHIM_NRLIMITS);
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        CHECK(rlimit_res[want[i].shim] == want[i].res);
        CHECK_STR(rlimit_name[want[i].shim], want[i].name);
    }
    /* set_rlimit in a child (the harness keeps its own limits). */
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit before_nofile, rl;
        int bad = 0;
        getrlimit(RLIMIT_NOFILE, &before_nofile);
        struct shim_rlimit core = {SHIM_RLIMIT_CORE, 1, 0, 0};
        bad |= set_rlimit(&core) != 0;
        bad |= getrlimit(RLIMIT_CORE, &rl) != 0 || rl.rlim_cur != 0 || rl.rlim_max != 0;
        /* Above fs.nr_open even root may not go (EPERM): a default is capped
         * at the hard limit, an asked-for limit fails. */
        struct shim_rlimit nofile = {SHIM_RLIMIT_NOFILE, 0, ~0ULL, ~0ULL};
        bad |= (set_rlimit(&nofile) != 0) << 1;
        bad |= (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur != before_nofile.rlim_max ||
                rl.rlim_max != before_nofile.rlim_max) << 2;
        nofile.asked = 1;
        bad |= (set_rlimit(&nofile) != -1 || errno != EPERM) << 3;
        _exit(bad);
    }
    int st;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st))
        fprintf(stderr, "set_rlimit: child status %#x\n", st);
    group("rlimits (table, set_rlimit)", before);
}

static void test_fds(void)
{
    int before = checks;
    struct shim_spec s;
    memset(&s, 0, sizeof s);
    int keep[] = {10, 5, 7, 1};
    s.keep_fds = keep;
    s.nkeep = 4;
    struct child_ctx c = {.s = &s, .sync_rd = 3, .err_wr = 4, .status_wr = -1};
    int *out = malloc(sizeof(int) * (SHIM_MAX_KEEP + 4));
    int n = keep_list(&c, out);
    CHECK(n == 6);
    CHECK(out[0] == 1 && out[1] == 3 && out[2] == 4 && out[3] == 5 && out[4] == 7 && out[5] == 10);
    int *many = malloc(sizeof(int) * 300);
    for (int i = 0; i < 300; i++)
        many[i] = 1000 - i;
    s.keep_fds = many;
    s.nkeep = 300;
    c.status_wr = 9;
    n = keep_list(&c, out); /* at most SHIM_MAX_KEEP declared, then our three */
    CHECK(n == SHIM_MAX_KEEP + 3);
    int sorted = 1;
    for (int i = 1; i < n; i++)
        sorted &= out[i - 1] <= out[i];
    CHECK(sorted && out[0] == 3 && out[n - 1] == 1000);
    free(many);
    free(out);

    /* close_from: with close_range and with the close() loop (before 5.9). */
    for (int fallback = 0; fallback < 2; fallback++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            int a = open("/dev/null", O_RDONLY), b = open("/dev/null", O_RDONLY);
            int hi = fcntl(b, F_DUPFD, 200);
            shim_test_no_close_range(fallback);
            inherited_nofile = 0;
            int bad = close_from((unsigned int)b, ~0U) != 0;
            bad |= (fcntl(b, F_GETFD) != -1 || fcntl(hi, F_GETFD) != -1) << 1; /* closed */
            bad |= (fcntl(a, F_GETFD) == -1) << 2;                              /* kept */
            bad |= (close_from(5, 4) != 0) << 3;                                /* empty */
            _exit(bad);
        }
        int st;
        waitpid(pid, &st, 0);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    group("fds (keep_list, close_from)", before);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_strings();
    test_report();
    test_fail_over_pipe();
    test_tmpfs_opts();
    test_plan();
    test_walk();
    test_path_next();
    test_exec();
    test_rlimits();
    test_fds();
    printf("harness: %d checks, %d failed\n", checks, failed);
    return failed ? 1 : 0;
}

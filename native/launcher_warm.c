/*
 * The v1 warm-up mover: the first cgroup migration's grace period, started
 * before the interpreter.
 *
 * On layouts with v1 hierarchies, the job's first migration waits for an RCU
 * grace period (rcu_sync_enter on cgroup_threadgroup_rwsem: 10-16 ms on the
 * 2-CPU test host), unless another migration ran in the last ~20 ms.  Here a
 * grandchild makes a no-op move (itself into the v1 cgroup it is already in)
 * at the first instant, so the wait overlaps the interpreter's own start, and
 * repeats it every 4 ms until the starter has made the job's migrations: the
 * starter closes the write end of a pipe (its fd in $STARTER_WARM_FD), the
 * grandchild sees EOF and exits; it exits after 1 s in any case.  Measured
 * with starts 60 ms apart (a node's normal case): one move here took the
 * median `starter run --net none -- /bin/true` from 35.9 to 30.6 ms, its
 * cgroup phase from 10.1 to 3.1 ms; the moves repeated here rather than by a
 * Python thread (which the starter still starts where this launcher did not
 * run) saved another 0.4-0.6 ms: that thread took the GIL from the main
 * thread every few milliseconds.
 *
 * Only for `starter run` as root; anything failing here is silently skipped
 * (the starter then warms up itself).  The grandchild is reparented and
 * reaped by the batch system's reaper; the starter never sees it.  For a
 * caller that is not root the relay starts the mover beside the starter
 * and reaps it (caller_run()).
 *
 */
#include "launcher.h"

/* The tasks file of our own cgroup in a v1 hierarchy of a resource
 * controller, opened for writing; -1 if there is none (pure cgroup v2). */
static int v1_tasks(void)
{
	char buf[4096], path[4352];
	ssize_t n;
	int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return -1;
	n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = 0;
	for (char *save, *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char *ctl = strchr(line, ':'), *cg;

		if (!ctl || !(cg = strchr(++ctl, ':')) || cg == ctl || !strncmp(ctl, "name=", 5))
			continue;       /* cgroup2's "0::/..." or a named hierarchy */
		*cg++ = 0;
		if (cg[0] != '/' || strstr(cg, "/..") ||
		    snprintf(path, sizeof path, "/sys/fs/cgroup/%s%s/tasks", ctl, strcmp(cg, "/") ? cg : "")
		    >= (int)sizeof path)
			continue;
		fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
		if (fd >= 0)
			return fd;
	}
	return -1;
}

#define WARM_EVERY_MS 4
#define WARM_MAX_MS 1000

static void close_fds(unsigned int lo, unsigned int hi)
{
	if (lo > hi || syscall(SYS_close_range, lo, hi, 0) == 0)
		return;
	for (unsigned int fd = lo; fd <= hi && fd < 1024; fd++)     /* before Linux 5.9 */
		close((int)fd);
}

/* In the grandchild: close every fd but a and b (a < b), so that it holds
 * none of the batch system's (its stdout, say) while it lives. */
static void close_all_but(int a, int b)
{
	if (a > 0)
		close_fds(0, (unsigned int)a - 1);
	close_fds((unsigned int)a + 1, (unsigned int)b - 1);
	close_fds((unsigned int)b + 1, ~0U);
}

/* The grandchild: no-op moves of itself until EOF on done (or the limit). */
void keep_warm(int tasks, int done)
{
	char pid[24];
	int len = snprintf(pid, sizeof pid, "%d", (int)getpid());
	struct pollfd pfd = { .fd = done, .events = POLLIN };

	close_all_but(tasks < done ? tasks : done, tasks < done ? done : tasks);
	for (int waited = 0; waited < WARM_MAX_MS; waited += WARM_EVERY_MS) {
		/* the first one waits for the grace period */
		if (write(tasks, pid, len) < 0)
			break;
		if (poll(&pfd, 1, WARM_EVERY_MS) != 0)
			break;          /* EOF: the starter is done (or gone) */
	}
	_exit(0);
}

/* The v1 tasks file and the pipe the starter closes once its migrations are
 * done (done[1], its $STARTER_WARM_FD); -1 where there is nothing to warm
 * (pure cgroup v2) or no fd to spare. */
int warm_fds(int done[2])
{
	int fd;

	unsetenv("STARTER_WARM_FD");    /* only ever ours */
	fd = v1_tasks();
	if (fd < 0)
		return -1;
	if (pipe2(done, O_CLOEXEC) < 0) {
		close(fd);
		return -1;
	}
	if (done[0] < 3 || done[1] < 3) {       /* the caller closed stdio: stay out of its way */
		close(done[0]);
		close(done[1]);
		close(fd);
		return -1;
	}
	return fd;
}

/* `starter run` as root: the mover is a grandchild (reparented to the batch
 * system's reaper: the starter never sees it), then exec. */
void warm_up(void)
{
	int fd, pipefd[2], status = -1;
	pid_t p;
	char num[16];

	fd = warm_fds(pipefd);
	if (fd < 0)
		return;
	p = fork();
	if (p == 0) {
		pid_t g = fork();

		if (g == 0) {
			close(pipefd[1]);
			keep_warm(fd, pipefd[0]);
		}
		_exit(g > 0 ? 0 : 1);
	}
	close(fd);
	close(pipefd[0]);
	while (p > 0 && waitpid(p, &status, 0) < 0 && errno == EINTR)
		;
	/* The write end goes through the exec into the starter, which closes it
	 * once the job's migrations are done. */
	if (p < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0 || fcntl(pipefd[1], F_SETFD, 0) < 0 ||
	    snprintf(num, sizeof num, "%d", pipefd[1]) < 0 || setenv("STARTER_WARM_FD", num, 1) < 0)
		close(pipefd[1]);
}

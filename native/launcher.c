/*
 * The `starter` command: start the first cgroup migration's RCU grace period,
 * then exec the interpreter.
 *
 * On layouts with v1 hierarchies, the job's first migration waits for an RCU
 * grace period (rcu_sync_enter on cgroup_threadgroup_rwsem: 10-16 ms on the
 * 2-CPU test host), unless another migration ran in the last ~20 ms.  The
 * Python side starts a warm-up thread for this (starter/cgroups/__init__.py),
 * but only once the interpreter is up, ~8 ms in.  Here a grandchild makes the
 * same no-op move (itself into the v1 cgroup it is already in) at the first
 * instant, so the wait overlaps the interpreter's own start.  Measured with
 * starts 60 ms apart (a node's normal case): median 35.9 -> 30.6 ms per
 * `starter run --net none -- /bin/true`, its cgroup phase 10.1 -> 3.1 ms.
 *
 * Only for `starter run` as root; anything failing here is silently skipped
 * (the Python warm-up still runs).  The grandchild is reparented and reaped
 * by the batch system's reaper; the starter never sees it.
 *
 * Built by scripts/setup with launcher-paths.h, which defines STARTER_PYTHON
 * (the venv's interpreter) and STARTER_CODE (what runs: sys.path, then
 * starter.cli.entry()).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "launcher-paths.h"

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

static void warm_up(void)
{
	int fd = v1_tasks();
	pid_t p;

	if (fd < 0)
		return;
	p = fork();
	if (p == 0) {
		if (fork() == 0) {
			char pid[24];
			int len = snprintf(pid, sizeof pid, "%d", (int)getpid());

			/* a no-op move of this process: waits for the grace period */
			if (write(fd, pid, len) < 0) {
				/* nothing to do: the Python warm-up still runs */
			}
		}
		_exit(0);
	}
	close(fd);
	if (p > 0)
		while (waitpid(p, NULL, 0) < 0 && errno == EINTR)
			;
}

int main(int argc, char **argv)
{
	char *args[argc + 5];
	int n = 0;

	if (argc > 1 && !strcmp(argv[1], "run") && geteuid() == 0)
		warm_up();
	args[n++] = STARTER_PYTHON;
	args[n++] = "-IS";
	args[n++] = "-c";
	args[n++] = STARTER_CODE;
	for (int i = 1; i < argc; i++)      /* argc may be 0 (an execve with no argv) */
		args[n++] = argv[i];
	args[n] = NULL;
	execv(STARTER_PYTHON, args);
	fprintf(stderr, "starter: cannot run %s: %s (run scripts/setup again)\n", STARTER_PYTHON, strerror(errno));
	return 125;
}

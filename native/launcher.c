/*
 * The `starter` command: start the first cgroup migration's RCU grace period,
 * then exec the interpreter.
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
 * Installed set-user-ID root (scripts/setup), this is also the entry point
 * of callers that are not root (a Slurm batch script, HTCondor's job
 * wrapper): see caller_run() below and docs/design.md, "Callers that are
 * not root".  Every other command, run by a user, drops the borrowed
 * privilege before anything else and runs as that user.
 *
 * Built by scripts/setup with launcher-paths.h, which defines STARTER_PYTHON
 * (the venv's interpreter) and STARTER_CODE (what runs: sys.path, then
 * starter.cli.main.entry()).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <limits.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

#include "launcher-paths.h"

extern char **environ;

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
static void keep_warm(int tasks, int done)
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
static int warm_fds(int done[2])
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
static void warm_up(void)
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

/* ------------------------------------------------------------------
 * A caller that is not root: `starter run` through the set-user-ID bit.
 *
 *   caller (uid U)        relay (uid U, this pid)          root starter (uid 0)
 *   --------------        -----------------------          --------------------
 *   exec starter run ...  fork ────────────────────────►   setsid, uid/gid/groups 0,
 *                         drop to U (real, effective,      rlimits, umask, signals reset,
 *                         saved): no privilege left        environment emptied, then
 *   signals ────────────► every catchable signal ──sock──► exec python: `starter run`
 *                         (sigwaitinfo), one byte each     with $STARTER_CALLER (who),
 *                                                          $STARTER_CALLER_FD (sock) and
 *                         ◄───────── exit status ───────── $STARTER_CALLER_RELAY (its pid)
 *   exit code ◄────────── exits with it
 *   (SIGKILL)             dies: sock hangs up ───────────► the starter kills the job
 *
 * The relay keeps the caller's pid, session, process group and cgroup, so
 * the batch system's signals and its kill of the step reach it; the root
 * starter sits in the same cgroup (the job's cgroups nest under it) but in a
 * session of its own, and with real uid 0 the caller cannot signal, stop or
 * trace it: signals reach it only through the relay, as bytes the starter
 * maps to its actions (TERM vacates, ...).  The caller's environment,
 * rlimits, umask, signal dispositions and mask do not reach the root
 * process; its fds do (stdio, fd:N), and every path the caller names is
 * opened by the starter with the caller's rights (starter/callers/caller.py).  What
 * the caller may ask for is the node policy's business (starter/callers/policy.py).
 */

/* Signals a relay never forwards: SIGKILL/SIGSTOP cannot be caught, SIGCHLD
 * is the starter's own end. */
static int forwarded(int sig)
{
	return sig != SIGKILL && sig != SIGSTOP && sig != SIGCHLD;
}

static void die(const char *what)
{
	fprintf(stderr, "starter: %s: %s (exit 125)\n", what, strerror(errno));
	_exit(125);
}

/* The limits the root half runs under.  Raising a hard limit needs
 * CAP_SYS_RESOURCE, which some nodes' root lacks (containers, hardened
 * nodes): there a limit the caller lowered stays.  Most of those can only
 * fail the caller's own start (125: a tiny RLIMIT_NOFILE) or cap its own
 * job (the shim never raises a job's limit above the starter's hard one).
 * A few would let the caller reach past its own job: a file size limit cuts
 * what root writes for everyone (the state directory, the filter cache), a
 * CPU, data, address-space or stack limit can kill the root starter in the
 * middle of a job (which then runs on unsupervised until gc), and a process
 * limit below what the end-of-job escape check needs leaves the job's entry
 * for gc.  `need` is the least hard limit the root half runs under: below
 * it, the start is refused naming the limit. */
static const struct root_limit {
	int res;
	const char *name, *flag;
	rlim_t soft, hard, need;
} root_limits[] = {
	{ RLIMIT_CPU, "CPU time", "-t", RLIM_INFINITY, RLIM_INFINITY, RLIM_INFINITY },
	{ RLIMIT_FSIZE, "file size", "-f", RLIM_INFINITY, RLIM_INFINITY, RLIM_INFINITY },
	{ RLIMIT_DATA, "data size", "-d", RLIM_INFINITY, RLIM_INFINITY, RLIM_INFINITY },
	{ RLIMIT_AS, "address space", "-v", RLIM_INFINITY, RLIM_INFINITY, RLIM_INFINITY },
	{ RLIMIT_STACK, "stack size", "-s", 8 << 20, RLIM_INFINITY, 8 << 20 },
	{ RLIMIT_NPROC, "processes", "-u", RLIM_INFINITY, RLIM_INFINITY, 64 },
	{ RLIMIT_CORE, "core file size", "-c", 0, 0, 0 },  /* a root process never dumps the caller's data */
	{ RLIMIT_NOFILE, "open files", "-n", 1024, 524288, 0 },
	{ RLIMIT_RSS, "resident set", "-m", RLIM_INFINITY, RLIM_INFINITY, 0 },
	{ RLIMIT_LOCKS, "file locks", "-x", RLIM_INFINITY, RLIM_INFINITY, 0 },
	{ RLIMIT_MSGQUEUE, "message queues", "-q", RLIM_INFINITY, RLIM_INFINITY, 0 },
	{ RLIMIT_RTTIME, "real-time CPU time", "-R", RLIM_INFINITY, RLIM_INFINITY, 0 },
	/* RLIMIT_NICE, RLIMIT_RTPRIO, RLIMIT_SIGPENDING and RLIMIT_MEMLOCK are
	 * kept as the caller set them: they only restrict the starter. */
};

/* Set the root half's limits; where a hard limit cannot be raised, the soft
 * one goes as high as it allows, and a hard limit below `need` refuses the
 * start, in one line. */
static void set_root_limits(void)
{
	for (size_t i = 0; i < sizeof root_limits / sizeof root_limits[0]; i++) {
		const struct root_limit *l = &root_limits[i];
		struct rlimit rl = { l->soft, l->hard }, cur;

		if (setrlimit(l->res, &rl) == 0)
			continue;
		if (getrlimit(l->res, &cur) < 0)
			die("cannot read the caller's resource limits");
		rl = (struct rlimit){ l->soft < cur.rlim_max ? l->soft : cur.rlim_max, cur.rlim_max };
		(void)setrlimit(l->res, &rl);
		if (cur.rlim_max < l->need) {
			char need[32];

			if (l->need == RLIM_INFINITY)
				snprintf(need, sizeof need, "unlimited");
			else
				snprintf(need, sizeof need, "%llu", (unsigned long long)l->need);
			fprintf(stderr, "starter: the caller's hard limit on %s (ulimit -H %s) is %llu, the root "
				"starter needs %s, and root cannot raise it on this node (no CAP_SYS_RESOURCE): "
				"raise it before `starter run` (exit 125)\n", l->name, l->flag,
				(unsigned long long)cur.rlim_max, need);
			_exit(125);
		}
	}
}

/* The root half: becomes the starter. */
static void root_half(int sock, char **argv, int argc, uid_t uid, gid_t gid,
		      gid_t *groups, int ngroups, pid_t relay_pid, int warm)
{
	size_t size = 64 + 12 * (size_t)ngroups;
	char *who = malloc(size), *e_who = malloc(size + 16), e_fd[40], e_relay[48], e_warm[48];
	char *args[argc + 5], *env[7];
	int trace = getenv("STARTER_TRACE") && *getenv("STARTER_TRACE");
	size_t len;
	int n = 0, ne = 0;
	sigset_t none;

	if (!who || !e_who)
		die("out of memory");
	if (setsid() < 0 || setgroups(0, NULL) < 0 || setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
		die("cannot become root for the caller's job");
	set_root_limits();
	umask(022);
	/* Every disposition is already the default (caller_run(), before the
	 * fork: a SIG_IGN would survive the exec); the mask is emptied here. */
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	len = (size_t)snprintf(who, size, "%u:%u:", (unsigned)uid, (unsigned)gid);
	for (int i = 0; i < ngroups && len < size - 12; i++)
		len += (size_t)snprintf(who + len, size - len, "%s%u", i ? "," : "", (unsigned)groups[i]);
	if (fcntl(sock, F_SETFD, 0) < 0)
		die("cannot pass the caller's socket");
	/* The whole environment is ours: nothing of the caller's reaches root. */
	if (clearenv() != 0)
		die("cannot empty the environment");
	env[ne++] = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
	snprintf(e_who, size + 16, "STARTER_CALLER=%s", who);
	env[ne++] = e_who;
	snprintf(e_fd, sizeof e_fd, "STARTER_CALLER_FD=%d", sock);
	env[ne++] = e_fd;
	snprintf(e_relay, sizeof e_relay, "STARTER_CALLER_RELAY=%ld", (long)relay_pid);
	env[ne++] = e_relay;
	if (trace)
		env[ne++] = "STARTER_TRACE=1";
	if (warm >= 0 && fcntl(warm, F_SETFD, 0) == 0) {    /* the relay's mover waits for its end */
		snprintf(e_warm, sizeof e_warm, "STARTER_WARM_FD=%d", warm);
		env[ne++] = e_warm;
	}
	env[ne] = NULL;
	args[n++] = STARTER_PYTHON;
	args[n++] = "-ISB";     /* no byte code written under limits a caller chose */
	args[n++] = "-c";
	args[n++] = STARTER_CODE;
	for (int i = 1; i < argc; i++)
		args[n++] = argv[i];
	args[n] = NULL;
	execve(STARTER_PYTHON, args, env);
	die("cannot run " STARTER_PYTHON);
}

/* The caller's half: forward signals, wait, exit with the starter's code.
 * It exits only once the starter and the mover are reaped: when the batch
 * system sees its child end, nothing the launcher started is left in the
 * caller's cgroup (a zombie reparented elsewhere can keep a cgroup from
 * being removed). */
static int relay(pid_t starter, pid_t warm, int sock, uid_t uid, gid_t gid)
{
	int status, reaped = 0;
	sigset_t all;
	siginfo_t si;

	/* Nothing of root's stays with the process the caller can signal. */
	if (setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0) {
		kill(starter, SIGKILL);     /* our own child, still ours to end */
		die("cannot drop privileges");
	}
	sigfillset(&all);
	for (;;) {
		int sig = sigwaitinfo(&all, &si);

		if (sig < 0)
			continue;                   /* EINTR */
		if (sig == SIGCHLD) {
			/* The mover ends at the latest with the starter (EOF on
			 * its pipe); SIGCHLDs coalesce: both are asked each time. */
			if (warm > 0 && waitpid(warm, NULL, WNOHANG) == warm)
				warm = 0;
			if (!reaped && waitpid(starter, &status, WNOHANG) == starter)
				reaped = 1;
			if (reaped && warm <= 0)
				break;
			continue;
		}
		if (forwarded(sig) && !reaped) {
			unsigned char b = (unsigned char)sig;

			/* Never blocks: a starter too busy to read would lose a
			 * repeat of a signal it already has. */
			(void)send(sock, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
		}
	}
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	fprintf(stderr, "starter: the root starter died of signal %d (exit 125)\n", WTERMSIG(status));
	return 125;
}

/* Every directory on `path`'s way (following links with stat(), so a
 * link's target counts) must be root's and writable by no one else. */
static void check_dirs(const char *path)
{
	char buf[PATH_MAX];
	struct stat st;

	if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
		_exit(125);
	for (char *slash = buf; (slash = strchr(slash + 1, '/')) != NULL; ) {
		*slash = 0;
		if (stat(buf, &st) < 0 || !S_ISDIR(st.st_mode) || st.st_uid != 0 || (st.st_mode & 022)) {
			fprintf(stderr, "starter: %s is not a directory of root's that only root may write: "
				"this installation cannot serve users (exit 125)\n", buf);
			_exit(125);
		}
		*slash = '/';
	}
}

/* Root runs the interpreter and the code below this launcher's directory:
 * every directory on the way must be root's and writable by no one else,
 * else whoever could write one would choose what root runs.  Both the path
 * as given and as resolved (a venv may be a link to /opt/venv: the link
 * itself sits in a checked directory, its target's way is checked too). */
static void check_install(void)
{
	char real[PATH_MAX], dir[] = STARTER_PYTHON;
	char *slash = strrchr(dir, '/');

	check_dirs(STARTER_PYTHON);
	if (slash)
		*slash = 0;
	if (!realpath(dir, real)) {
		fprintf(stderr, "starter: cannot resolve %s: %s (exit 125)\n", dir, strerror(errno));
		_exit(125);
	}
	strncat(real, "/x", sizeof real - strlen(real) - 1);
	check_dirs(real);
}

/* `starter run` for a caller that is not root (the picture above). */
static int caller_run(int argc, char **argv)
{
	uid_t uid = getuid();
	gid_t gid = getgid(), *groups;
	int ngroups = getgroups(0, NULL), sv[2], done[2], tasks;
	sigset_t all;
	pid_t p, relay_pid, warm = 0;

	check_install();
	/* The starter's own variables are root's to set: said, not silently
	 * dropped, so a user who sets one learns it does nothing here.  But
	 * STARTER_TRACE, which only prints the start's phases on stderr. */
	for (char **e = environ; *e; e++)
		if (!strncmp(*e, "STARTER_", 8) && strncmp(*e, "STARTER_TRACE=", 14)) {
			int len = (int)strcspn(*e, "=");

			fprintf(stderr, "starter: %.*s is set: the starter's variables are for root callers only; "
				"unset it (exit 125)\n", len > 64 ? 64 : len, *e);
			_exit(125);
		}
	groups = malloc(sizeof(gid_t) * (size_t)(ngroups > 0 ? ngroups : 1));
	if (ngroups < 0 || !groups || (ngroups = getgroups(ngroups, groups)) < 0)
		die("cannot read the caller's groups");
	/* stdio the caller closed is /dev/null, never a file root opens later */
	for (int fd = 0; fd < 3; fd++)
		if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) != fd)
			die("cannot open /dev/null for a closed stdio descriptor");
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
		die("cannot make the caller's socket");
	sigfillset(&all);
	sigprocmask(SIG_BLOCK, &all, NULL);     /* none is lost before the relay waits */
	/* An ignored signal is dropped even while blocked: the caller may have
	 * exec'd us with SIGTERM ignored (nohup, a wrapper), and the relay must
	 * still see it. */
	for (int sig = 1; sig < NSIG; sig++)
		if (sig != SIGKILL && sig != SIGSTOP)
			signal(sig, SIG_DFL);
	tasks = warm_fds(done);
	relay_pid = getpid();           /* the relay: this process, after the fork */
	p = fork();
	if (p < 0)
		die("cannot fork");
	if (p == 0) {
		close(sv[1]);
		root_half(sv[0], argv, argc, uid, gid, groups, ngroups, relay_pid, tasks >= 0 ? done[1] : -1);
	}
	close(sv[0]);
	/* The first migration's grace period (see the top), started here, beside
	 * the starter's own start rather than before it: the mover is the
	 * relay's child, root through and through (the caller cannot signal
	 * it), and the relay reaps it. */
	if (tasks >= 0) {
		close(done[1]);
		warm = fork();
		if (warm == 0) {
			if (setgroups(0, NULL) < 0 || setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
				_exit(1);
			keep_warm(tasks, done[0]);
		}
		close(tasks);
		close(done[0]);
	}
	return relay(p, warm, sv[1], uid, gid);
}

int main(int argc, char **argv)
{
	char *args[argc + 5];
	int n = 0;

	if (getuid() != 0 && geteuid() == 0) {      /* set-user-ID root, run by a user */
		if (argc > 1 && !strcmp(argv[1], "run"))
			return caller_run(argc, argv);
		/* Any other command runs as the user, as if not set-user-ID. */
		if (setresgid(getgid(), getgid(), getgid()) < 0 ||
		    setresuid(getuid(), getuid(), getuid()) < 0)
			die("cannot drop privileges");
	}
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

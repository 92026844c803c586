/*
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
#include "launcher.h"

/* Signals a relay never forwards: SIGKILL/SIGSTOP cannot be caught, SIGCHLD
 * is the starter's own end. */
static int forwarded(int sig)
{
	return sig != SIGKILL && sig != SIGSTOP && sig != SIGCHLD;
}

void die(const char *what)
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
int caller_run(int argc, char **argv)
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
	/* The first migration's grace period (launcher_warm.c), started here, beside
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

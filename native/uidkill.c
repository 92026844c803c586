/*
 * Is any process of a uid alive, and the kill of every process of a uid
 * (starter/job/strays.py), without reading /proc and without naming a pid.
 *
 * A helper becomes uid U (real, effective, saved; no groups, so no
 * capabilities) and lowers its RLIMIT_NPROC to 2.  The kernel counts the
 * tasks of each real uid (the limit's ucounts, host-wide, nested user
 * namespaces included): the helper is one, so a clone() of a second fails
 * with EAGAIN exactly when a third task of U exists.  That answers "any
 * other process of U?" in two system calls.  (kill(-1, 0) cannot: the
 * kernel answers 0 whenever any other process exists, permission or not.)
 * A zombie counts until it is reaped: a caller that must tell them apart
 * reads /proc after a "yes".  A caller that knows `known` live tasks of U
 * (a caller's relay: starter/callers/caller.py) asks "any beyond those?" with the
 * limit at 2 + known; it must see that they were alive through the probe
 * (escapes.find checks the relay is still its parent after it).
 *
 * The kill is kill(-1, SIGKILL) from the same helper: it reaches exactly
 * the processes whose real or saved uid is U, however many and whatever
 * their pids (a pid reused meanwhile is never hit).
 *
 * Before a transient uid is leased (starter/callers/uids.py) the signal is given
 * negated: "is a task of real uid U alive?", and if none is, -sig is sent
 * once to what is left: processes that hold U only as their saved (and
 * effective) uid, which the count does not see: another user ran a
 * set-user-ID file of U.  One kill(-1) round: it also reaches a child that
 * one of them forks meanwhile (the kernel queues a signal sent to many
 * processes for forks in progress, 5.0+).
 *
 * The helper is a clone(CLONE_VM|CLONE_VFORK) child on a small stack (and
 * its probe another): the starter (Python, ~20 MB) is not copied, as
 * os.fork() would.  Raw system calls only: glibc's setresuid() would
 * broadcast the change to the threads of the process whose memory it shares.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"

#define KILL_ROUNDS 3

struct uidkill {
	unsigned int uid;
	int sig;
	unsigned int known;     /* live tasks of uid the caller accounts for */
};

static char helper_stack[16384] __attribute__((aligned(16)));
static char probe_stack[4096] __attribute__((aligned(16)));

static int probe_child(void *arg)
{
	(void)arg; /* clone()'s callback type; the probe needs nothing */
	syscall(SYS_exit, 0);
	return 0;
}

/* In the helper: 1 if another task of its uid exists, 0 if not, -1 on error. */
static int others(void)
{
	int status;
	pid_t pid = clone(probe_child, probe_stack + sizeof probe_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, NULL);

	if (pid < 0)
		return errno == EAGAIN ? 1 : -1;
	while (waitpid(pid, &status, 0) < 0)
		if (errno != EINTR)
			return -1;
	return 0;
}

/* Exit codes: 0 none, 1 some (and, with a signal, sent it), 2 error.  A
 * negative signal: 1 some (nothing sent), 0 none (and -sig sent to the
 * holders of U as saved uid, if any). */
static int helper(void *arg)
{
	const struct uidkill *k = arg;
	struct rlimit two = { 2 + (rlim_t)k->known, 2 + (rlim_t)k->known };
	struct timespec ms = { 0, 1000000 };
	int found;

	if (syscall(SYS_setgroups, 0, NULL) < 0 || syscall(SYS_setresgid, k->uid, k->uid, k->uid) < 0 ||
	    syscall(SYS_setresuid, k->uid, k->uid, k->uid) < 0 ||
	    syscall(SYS_prlimit64, 0, RLIMIT_NPROC, &two, NULL) < 0)
		syscall(SYS_exit, 2);
	found = others();
	if (found < 0)
		syscall(SYS_exit, 2);
	if (found && k->sig > 0)
		for (int i = 0; i < KILL_ROUNDS; i++) {        /* a fork racing the first round */
			syscall(SYS_kill, -1, k->sig);
			syscall(SYS_nanosleep, &ms, NULL);
		}
	if (!found && k->sig < 0)
		syscall(SYS_kill, -1, -k->sig);         /* ESRCH or EPERM when there is none */
	syscall(SYS_exit, found);
	return 0;
}

int shim_uid_kill(unsigned int uid, int sig, unsigned int known)
{
	struct uidkill k = { uid, sig, known };
	int status;
	pid_t pid;

	if (uid == 0 || (sig && known) || sig < -64 || sig > 64)
		return -EINVAL;         /* root's count is not limited: no answer; a kill reaches all */
	pid = clone(helper, helper_stack + sizeof helper_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &k);
	if (pid < 0)
		return -errno;
	while (waitpid(pid, &status, 0) < 0)
		if (errno != EINTR)
			return -errno;
	if (!WIFEXITED(status) || WEXITSTATUS(status) > 1)
		return -EPERM;
	return WEXITSTATUS(status);
}

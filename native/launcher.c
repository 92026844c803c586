/*
 * The `starter` command: exec the interpreter with the starter's entry point,
 * after two things that must happen before Python starts:
 *
 *   launcher_warm.c   `starter run` on a host with v1 hierarchies: a mover
 *                     starts the first cgroup migration's RCU grace period
 *                     now, so that it overlaps the interpreter's start
 *   launcher_relay.c  set-user-ID root and run by a user (a Slurm batch
 *                     script, HTCondor's job wrapper): `starter run` splits
 *                     into the caller's relay and the root starter; every
 *                     check the C side makes on the caller is there
 *
 * Every other command, run by a user, drops the borrowed privilege before
 * anything else and runs as that user (main() below).
 *
 * Built by scripts/setup with launcher-paths.h, which defines STARTER_PYTHON
 * (the venv's interpreter) and STARTER_CODE (what runs: sys.path, then
 * starter.cli.main.entry()).
 */
#include "launcher.h"

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

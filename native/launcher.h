/* What the launcher's three files share (launcher.c: main; launcher_warm.c:
 * the v1 warm-up mover; launcher_relay.c: a caller that is not root). */
#ifndef STARTER_LAUNCHER_H
#define STARTER_LAUNCHER_H

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


#ifndef SYS_close_range
#define SYS_close_range 436
#endif

#include "launcher-paths.h"

extern char **environ;

/* launcher_warm.c */
int warm_fds(int done[2]);
void keep_warm(int tasks, int done) __attribute__((noreturn));
void warm_up(void);

/* launcher_relay.c */
void die(const char *what) __attribute__((noreturn));
int caller_run(int argc, char **argv);

#endif

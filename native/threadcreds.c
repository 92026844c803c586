/*
 * The calling thread's effective ids and groups, switched for a moment
 * (starter/storage/paths.py, as_user: a caller's rights around the opens of the
 * paths it named).
 *
 * Raw system calls, on purpose: the kernel keeps credentials per thread, and
 * glibc's seteuid()/setegid()/setgroups() make every thread of the process
 * take the change (a signal to each and a wait for all).  The starter runs
 * threads beside the one that opens (setup's watchdog, a caller's relay
 * reader), so each glibc switch cost ~0.19 ms here, several per start; the
 * other threads have no business with the caller's rights anyway.  Only the
 * effective ids change: the real and saved uid stay 0, so the switch back
 * cannot fail and the caller cannot signal or trace us meanwhile.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shim.h"

int shim_thread_creds(int uid, int gid, const unsigned int *groups, int ngroups)
{
    if (uid == 0) {         /* back to root: the uid first, which brings back the capabilities */
        if (syscall(SYS_setresuid, -1, 0, -1) < 0 || syscall(SYS_setresgid, -1, gid, -1) < 0 ||
            syscall(SYS_setgroups, ngroups, groups) < 0)
            return -errno;
        return 0;
    }
    if (syscall(SYS_setgroups, ngroups, groups) < 0 || syscall(SYS_setresgid, -1, gid, -1) < 0 ||
        syscall(SYS_setresuid, -1, uid, -1) < 0)
        return -errno;
    return 0;
}

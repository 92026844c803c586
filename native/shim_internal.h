/* shim_internal.h — what the shim's C files share (native/shim.h stays the
 * cffi interface; nothing here is seen by Python).
 *
 * The shim is split by concern, each file saying at its top what it owns:
 *
 *   shim_clone.c    the protocol (its picture), clone/clone3, the sync, err
 *                   and status pipes, signals, shim_spawn, and child_main /
 *                   become_job: the checklists that hand each step to a file
 *   shim_report.c   async-signal-safe strings and the error report (fail)
 *   shim_mount.c    the mount plan, in order: /proc, /sys, lo, /tmp, tmpfs,
 *                   the plan's own mounts, links and device nodes
 *   shim_mountfd.c  mounting by fd: destinations walked without links, bind
 *                   sources as detached trees (or pinned by path), read-only
 *                   and slave by fd, and the older kernels' fallbacks
 *   shim_creds.c    uid/gid/groups, capabilities, the user namespace's maps
 *   shim_reset.c    inherited attributes reset (rlimits, nice, sched, ...)
 *   shim_fds.c      closing fds, the job's stdio
 *   shim_exec.c     the PATH search, the seccomp filter, the execve
 *   shim_init.c     the tiny init (--init)
 *   shim_enter.c    shim_enter: join a running job
 *
 * Everything declared here is hidden: the module exports only shim.h.
 */
#ifndef STARTER_SHIM_INTERNAL_H
#define STARTER_SHIM_INTERNAL_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shim.h"

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef OPEN_TREE_CLOEXEC
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOVE_MOUNT_T_EMPTY_PATH
#define MOVE_MOUNT_T_EMPTY_PATH 0x00000040
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#endif
#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif
#ifndef KEYCTL_JOIN_SESSION_KEYRING
#define KEYCTL_JOIN_SESSION_KEYRING 1
#endif

/* Our own copies of the uapi structs: <linux/sched.h> and <linux/mount.h>
 * clash with glibc headers on some distributions. */
struct clone_args_v2 {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal;
    uint64_t stack, stack_size, tls, set_tid, set_tid_size, cgroup;
};
struct mount_attr_v0 {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};
struct cap_header {
    uint32_t version;
    int pid;
};
struct cap_data {
    uint32_t effective, permitted, inheritable;
};

/* --userns-root: the step of the report that asks the starter for the maps
 * (exit code 0: not a failure); starter/isolate/ns.py knows it by this name. */
#define SHIM_STEP_USERNS "map user namespace"

#define EXIT_STARTER 125
#define EXIT_NOEXEC 126
#define EXIT_NOTFOUND 127

/* Everything the child needs besides the spec: fd numbers of its pipe ends. */
struct child_ctx {
    const struct shim_spec *s;
    int sync_rd;   /* release byte, or EOF when the starter is gone */
    int err_wr;    /* struct shim_report */
    int status_wr; /* init mode: job's wait status, else -1 */
    const int *trees; /* per mount: bind tree cloned before clone(), or -1; or NULL */
};

#pragma GCC visibility push(hidden)

/* ---- shim_report.c: async-signal-safe helpers, the report --------------- */

size_t s_len(const char *s);
/* Append s at buf[at] (NUL-terminated, truncated to cap); -> the new end. */
size_t s_cat(char *buf, size_t at, size_t cap, const char *s);
size_t s_uint(char *buf, size_t at, size_t cap, unsigned int u);
void s_int(char *buf, size_t cap, int v);
void write_all(int fd, const void *p, size_t n);
/* The report of a failed step: "what arg", errno, exit code; zero-filled. */
void report_fill(struct shim_report *r, int err, int code, const char *what, const char *arg);
/* Report "what arg" with errno `err` on err_wr and _exit(code). */
_Noreturn void fail_err(const struct child_ctx *c, int err, int code, const char *what,
                        const char *arg);
/* The same with errno and exit 125. */
_Noreturn void fail(const struct child_ctx *c, const char *what, const char *arg);
/* shim_image.c: the child's root becomes the image's (shim_spec.root_fd) */
void enter_image_root(const struct child_ctx *c);

/* ---- shim_clone.c: signals, the sync pipe, the pipes, clone ------------- */

void reset_signals(void);
void set_sigmask(uint64_t mask);
void unblock_signals(void);
void wait_release(const struct child_ctx *c);
void arm_pdeathsig(const struct child_ctx *c);
_Noreturn void become_job(const struct child_ctx *c, int creds);

struct pipes {
    int sync[2], err[2], status[2];
};
void close_pair(int p[2]);
int pipe_hi(int p[2]);
int open_pipes(struct pipes *p, int status, int userns);
void child_ctx_init(struct child_ctx *c, const struct shim_spec *s, struct pipes *p);
void child_close_parent_ends(struct pipes *p);
pid_t do_clone(uint64_t flags, int cgroup_fd, int *pidfd, int *attached);
pid_t raw_fork(void);

/* ---- shim_mount.c: the mount plan --------------------------------------- */

void setup_namespaces(const struct child_ctx *c);
int under(const char *path, const char *dir);
int is_tmpfs(const struct shim_mount *m);
int ours(const struct child_ctx *c, const struct shim_mount *m);
/* The next of the tmpfs options split in place at *cursor (see there). */
char *tmpfs_opt_next(char **cursor, char **value);
/* The directory of an absolute path (s_len(path) < cap) into dir. */
size_t parent_dir(const char *path, char *dir, size_t cap);
extern int no_fsopen;

/* ---- shim_mountfd.c: mounting by fd ------------------------------------- */

struct dest {
    int fd;     /* the destination: O_PATH, or O_RDONLY for a file made here */
    int parent; /* its directory (O_PATH), -1 where the destination is "/" */
    char name[256]; /* its last component, "" for "/" */
};

long sys_mount_setattr(int dfd, const char *path, unsigned int flags, struct mount_attr_v0 *attr);
unsigned long st_keep_flags(const struct statfs *st);
int make_readonly(const char *path);
int make_readonly_fd(int fd);
/* shim_mountfd.c: what a bind gets on top of its source's flags (nosuid
 * for a transient uid's writable binds), and applying it to a new mount by
 * its fd. */
unsigned long long bind_attrs(const struct shim_mount *m);
int restrict_mount_fd(int fd, unsigned long long attrs);
const char *fd_name(char buf[16], int fd);
void link_step(char msg[SHIM_STEP_MAX], const char *dst, size_t upto);
void close_dest(struct dest *d);
int walk_dest(const struct child_ctx *c, const struct shim_mount *m, const char *what, int file,
              int create, struct dest *d);
int attach(int tree, const struct dest *d);
int grab_source(const struct child_ctx *c, const struct shim_mount *m);
int pin_source(const struct child_ctx *c, const struct shim_mount *m);
int new_bind_fd(const struct child_ctx *c, const struct shim_mount *m, const struct dest *d, int src);
void close_trees(const struct shim_spec *s, int *trees);
int take_trees(const struct shim_spec *s, int *trees);

/* ---- shim_creds.c ------------------------------------------------------- */

void drop_privileges(const struct child_ctx *c);
void write_proc_self(const struct child_ctx *c, const char *path, const char *text);
void enter_userns_root(const struct child_ctx *c);

/* ---- shim_reset.c ------------------------------------------------------- */

extern const int rlimit_res[SHIM_NRLIMITS];
extern const char *const rlimit_name[SHIM_NRLIMITS];
extern unsigned long inherited_nofile;
int set_rlimit(const struct shim_rlimit *r);
void reset_inherited(const struct child_ctx *c);

/* ---- shim_fds.c --------------------------------------------------------- */

int close_from(unsigned int lo, unsigned int hi);
/* The fds >= 3 close_fds() keeps, sorted: -> how many (at most SHIM_MAX_KEEP + 3). */
int keep_list(const struct child_ctx *c, int keep[SHIM_MAX_KEEP + 4]);
void close_fds(const struct child_ctx *c);
void setup_stdio(const struct child_ctx *c);

/* ---- shim_exec.c -------------------------------------------------------- */

const char *path_next(const char *p, const char *file, size_t flen, char *buf, size_t cap, int *fits);
int exec_search_goes_on(int err);
void install_seccomp(const struct child_ctx *c);
_Noreturn void exec_job(const struct child_ctx *c);

/* ---- shim_init.c -------------------------------------------------------- */

_Noreturn void init_main(const struct child_ctx *c);

#pragma GCC visibility pop

#endif

/* The starter's native shim: everything between clone() and execve().
 *
 * The block between the cffi markers is read by native/build_shim.py as the
 * cffi cdef, so it must stay plain C declarations (no includes, no macros
 * other than integer #defines, no typedefs from system headers).
 */
#ifndef STARTER_SHIM_H
#define STARTER_SHIM_H

/* cffi-begin */
#define SHIM_STEP_MAX 248
#define SHIM_MAX_KEEP 256
#define SHIM_MAX_MOUNTS 256

#define SHIM_MOUNT_BIND 1
#define SHIM_MOUNT_RO_BIND 2
#define SHIM_MOUNT_TMPFS 3
#define SHIM_MOUNT_FS 4       /* mount(src or fstype, dst, fstype, flags, data) as given */
#define SHIM_MOUNT_LINK 5     /* symlink(src, dst): dst inside a tmpfs of the plan (the job's /dev) */
#define SHIM_MOUNT_NODE 6     /* mknod(dst, mode, rdev): dst inside a tmpfs of the plan (the job's /dev) */

/* MS_* flags for SHIM_MOUNT_FS, and SHIM_MS_NOSUID for binds (the kernel's values). */
#define SHIM_MS_RDONLY 1
#define SHIM_MS_NOSUID 2
#define SHIM_MS_NODEV 4
#define SHIM_MS_NOEXEC 8
#define SHIM_MS_REMOUNT 32
#define SHIM_MS_BIND 4096

#define SHIM_NEWNS 0x00020000
#define SHIM_NEWCGROUP 0x02000000 /* spawn: unshare()d after the release byte, not at clone */
#define SHIM_NEWUTS 0x04000000
#define SHIM_NEWIPC 0x08000000
#define SHIM_NEWPID 0x20000000
#define SHIM_NEWNET 0x40000000

/* shim_enter: the order of shim_spec.enter_ns_fds, which is the order the
 * helper joins them in (mnt last: it changes the helper's root). */
#define SHIM_NS_IPC 0
#define SHIM_NS_UTS 1
#define SHIM_NS_NET 2
#define SHIM_NS_PID 3
#define SHIM_NS_CGROUP 4
#define SHIM_NS_MNT 5
#define SHIM_NNS 6

/* What the child writes on the error pipe when a step fails: 256 bytes,
 * less than PIPE_BUF, so it arrives whole or not at all.  With --userns-root
 * also the request for the user namespace's maps: err 0, exit_code 0, step
 * "map user namespace" (shim_creds.c, enter_userns_root); the starter answers
 * with a byte on sync. */
struct shim_report {
    int err;                  /* errno of the failed step */
    int exit_code;            /* what the child _exit()s with: 125/126/127 */
    char step[SHIM_STEP_MAX]; /* "mount /sys", "execve foo", NUL-terminated */
};

struct shim_mount {
    int kind;                 /* SHIM_MOUNT_* */
    const char *src;          /* binds: source path in the starter's view */
    const char *dst;          /* absolute path in the job's view */
    const char *data;         /* tmpfs options ("size=64m,mode=1777") or NULL */
    /* binds: O_PATH fd of src, resolved by the caller without following
     * links, or -1 to take src by path.  The shim clones the tree from this
     * fd (open_tree, before clone) and never walks src again, except on
     * kernels without open_tree, where it mounts src by path and checks that
     * the mounted root is this fd's inode. */
    int src_fd;
    /* appended (ns): SHIM_MOUNT_FS only */
    const char *fstype;       /* "tmpfs", "mqueue", "cgroup", "cgroup2"; NULL for a remount */
    unsigned long flags;      /* SHIM_MS_*; binds take SHIM_MS_NOSUID too */
    int optional;             /* skip if dst does not exist in the job's view */
    /* appended: SHIM_MOUNT_NODE only, a copy of a host node's
     * type and permission bits (S_IFCHR|0666) and its device number */
    unsigned int mode;
    unsigned long long rdev;
};

/* Resource limits the shim sets: resource is a SHIM_RLIMIT_*
 * (shim_reset.c maps them to RLIMIT_*), 2**64-1 is unlimited. */
#define SHIM_RLIMIT_CPU 0
#define SHIM_RLIMIT_FSIZE 1
#define SHIM_RLIMIT_DATA 2
#define SHIM_RLIMIT_STACK 3
#define SHIM_RLIMIT_CORE 4
#define SHIM_RLIMIT_RSS 5
#define SHIM_RLIMIT_NPROC 6
#define SHIM_RLIMIT_NOFILE 7
#define SHIM_RLIMIT_MEMLOCK 8
#define SHIM_RLIMIT_AS 9
#define SHIM_RLIMIT_LOCKS 10
#define SHIM_RLIMIT_SIGPENDING 11
#define SHIM_RLIMIT_MSGQUEUE 12
#define SHIM_RLIMIT_NICE 13
#define SHIM_RLIMIT_RTPRIO 14
#define SHIM_RLIMIT_RTTIME 15
#define SHIM_NRLIMITS 16

struct shim_rlimit {
    int resource;             /* SHIM_RLIMIT_* */
    int asked;                /* 0: a default, capped at the caller's hard limit
                               * where raising it needs CAP_SYS_RESOURCE we lack */
    unsigned long long soft;
    unsigned long long hard;
};

struct shim_spec {
    char *const *argv;        /* NULL-terminated, argv[0] is searched in path */
    char *const *envp;        /* NULL-terminated, exactly the job's environment */
    const char *path;         /* PATH to search argv[0] in (from envp) or NULL */
    const char *cwd;
    unsigned int uid;
    unsigned int gid;
    const unsigned int *groups;
    int ngroups;
    int nsflags;              /* SHIM_NEW* */
    const char *hostname;     /* NULL: keep; needs SHIM_NEWUTS */
    int private_tmp;          /* fresh tmpfs on /tmp; needs SHIM_NEWNS */
    const struct shim_mount *mounts;
    int nmounts;
    int stdio[3];             /* fds to become the job's 0, 1, 2; -1: inherit */
    const int *keep_fds;      /* stay open (and lose CLOEXEC) in the job */
    int nkeep;
    int init;                 /* shim stays PID 1, the job is PID 2 */
    int cgroup_fd;            /* cgroup2 directory fd for CLONE_INTO_CGROUP, or -1 */
    int die_with_parent;      /* PR_SET_PDEATHSIG(SIGKILL) */
    int drop_privileges;      /* creds, no caps, NO_NEW_PRIVS */
    int cap_last_cap;         /* from /proc/sys/kernel/cap_last_cap */
    /* shim_enter: fds of the namespaces to join, indexed by SHIM_NS_*, -1
     * for none; each one's SHIM_NEW* flag is in nsflags.  shim_spawn: only
     * the net, ipc and pid slots, the namespaces of a --net job's part on
     * the node, joined instead of made (their flags not in nsflags): the
     * child is cloned into the pid one and setns()es into the others.  The caller opened
     * them and checked that they are the ones the starter made for the job
     * (starter/isolate/ns.py open_namespaces): what the job's PID 1 is in now is
     * never joined unchecked. */
    int enter_ns_fds[6];
    /* cli: without cwd, chdir to the first of these that works
     * as the job's user in the job's view (caller's cwd, home, "/"); none
     * working is the "chdir" failure of the last one. */
    const char *const *cwd_fallbacks;
    int ncwd_fallbacks;
    /* seccomp (native/seccomp.c): a BPF program (struct sock_filter[]) the
     * job's process installs as its very last step before execve (not the
     * init in init mode); NULL: none. */
    const void *seccomp_filter;
    int seccomp_len;          /* bytes, a multiple of 8 */
    unsigned int seccomp_flags; /* SECCOMP_FILTER_FLAG_* (LOG, SPEC_ALLOW) */
    /* The privilege boundary; appended, other fields may follow. */
    int userns_root;          /* job is 0:0 in a new user namespace mapping 0 to uid/gid */
    int reset_inherited;      /* oom_score_adj, nice, sched, affinity, umask, ... (see shim_reset.c) */
    const struct shim_rlimit *rlimits; /* set while still root; needs reset_inherited */
    int nrlimits;
    /* --delegate: make the cgroup namespace at clone time, rooted
     * at cgroup_fd's cgroup (CLONE_INTO_CGROUP|CLONE_NEWCGROUP), not by
     * unshare after release: the starter moves the child into a leaf below
     * that cgroup before release, and the job sees the cgroup, not the leaf,
     * as its root.  Only with clone3 (shim_spawn fails EOPNOTSUPP without). */
    int cgroupns_at_clone;
    /* --image (image 1 or 2): image_fd, the image's squashfs, a detached
     * mount the starter made (shim_image_mount), which the child makes its
     * root under an overlay whose upper and work directories are in a tmpfs
     * of image_tmpfs_size (tmpfs's size=; NULL: half the memory) or in the
     * directory image_upper_fd, before /proc and the plan
     * (native/shim_image.c).  image 0: the host's root (a zeroed spec has
     * none). */
    int image;                /* 0: none, 1: writes in a tmpfs, 2: in image_upper_fd */
    int image_fd;
    const char *image_tmpfs_size;
    int image_upper_fd;       /* image 2: a bind of a directory of root's in the job's scratch (shim_image_tree) */
    /* A starter without root and without subordinate ids (starter/rootless):
     * its user namespace denies setgroups, so the job keeps the starter's
     * supplementary groups (the pilot's own: the job is the pilot's uid). */
    int keep_groups;
};

struct shim_child {
    int pid;                  /* in the caller's pid namespace */
    int pidfd;
    int sync_fd;              /* write one byte to release the child */
    int err_fd;               /* struct shim_report on failure, EOF on exec */
    int status_fd;            /* init mode: the job's raw wait status (int), else -1 */
    int cgroup_attached;      /* 1 if CLONE_INTO_CGROUP placed it */
};

/* All return 0 (or a fd) on success, -errno on failure. */
int shim_spawn(const struct shim_spec *spec, struct shim_child *out);
int shim_enter(const struct shim_spec *spec, struct shim_child *out);
int shim_setns(int fd, int nstype);
/* unshare(2), for a starter without root (starter/rootless/userns.py): its own user namespace. */
int shim_unshare(int flags);
/* prctl(PR_SET_DUMPABLE): a starter without root makes itself dumpable again
 * after a helper sharing its memory changed uid (native/uidkill.c), or the
 * job it clones next could not be looked at from its own user namespace. */
int shim_set_dumpable(int on);
int shim_pidfd_open(int pid);
/* native/shim_enter.c, for starter/net/part.py: a --net job part's /dev/shm
 * on the host, a tmpfs (nosuid, nodev, `options`) at dir, made private (no
 * propagation to the host's other mount namespaces); its lazy unmount,
 * following no link at path (-EINVAL: not mounted there). */
int shim_mount_tmpfs_private(const char *dir, const char *options);
int shim_umount_lazy(const char *path);
/* native/shim_image.c, for starter/image/mount.py: the squashfs on the
 * block device `device`, read-only, nosuid, nodev, as a detached mount ->
 * its fd, or -errno.  Made by the starter: the job's child, in the job's
 * cgroup, may not open the device (its device rules). */
int shim_image_mount(const char *device);
/* ... and a detached bind (open_tree clone) of the directory dir_fd, where
 * a job with a scratch writes -> its fd, or -errno. */
int shim_image_tree(int dir_fd);

/* native/uidkill.c: is a process of `uid` alive (1) or not (0) beyond
 * `known` live ones, and with sig != 0 (known 0) kill(-1, sig) as that
 * uid; -errno on failure. */
int shim_uid_kill(unsigned int uid, int sig, unsigned int known);
/* native/threadcreds.c: this thread's effective uid/gid and groups (uid 0:
 * back to root, uid first); -errno. */
int shim_thread_creds(int uid, int gid, const unsigned int *groups, int ngroups);
int shim_clone3_supported(void);
/* Tests: force the clone() fallback (1) or go back to probing clone3 (0). */
void shim_test_no_clone3(int on);
/* Tests: bind sources given as fds are mounted by path and checked (1), as
 * on kernels without open_tree (nor fsopen, mount_setattr), or cloned with
 * open_tree again (0). */
void shim_test_no_open_tree(int on);
/* Tests: as on 5.2..5.11 (open_tree and fsopen, no mount_setattr): a
 * read-only bind is pinned and mounted by fd, a tree made a slave once
 * attached, by its own fd (1), or as this kernel is (0). */
void shim_test_no_mount_setattr(int on);
/* Tests: close the job's fds one close() at a time, as on kernels without
 * close_range (before 5.9) (1), or with close_range again (0). */
void shim_test_no_close_range(int on);

/* native/devices.c: the job's device allow list as a BPF_CGROUP_DEVICE
 * program, attached to its cgroup2 directory (v2 and hybrid hosts).  A
 * device is allowed when one rule matches its type, major, minor and every
 * access asked for; everything else is refused (EPERM). */
#define SHIM_DEV_ANY -1       /* major or minor: any */
#define SHIM_DEV_MKNOD 1      /* access bits, the kernel's BPF_DEVCG_ACC_* */
#define SHIM_DEV_READ 2
#define SHIM_DEV_WRITE 4
#define SHIM_DEV_BLOCK 1      /* type, the kernel's BPF_DEVCG_DEV_*; 0: either */
#define SHIM_DEV_CHAR 2
#define SHIM_DEV_MAX_RULES 512

struct shim_dev_rule {
    int type;                 /* SHIM_DEV_BLOCK, SHIM_DEV_CHAR or 0 */
    int major;                /* or SHIM_DEV_ANY */
    int minor;                /* or SHIM_DEV_ANY */
    int access;               /* SHIM_DEV_MKNOD|READ|WRITE */
};

/* Load the program (bpf(BPF_PROG_LOAD), no libbpf) and attach it to the
 * cgroup2 directory fd (BPF_F_ALLOW_MULTI: an ancestor's program still
 * applies too).  0 or -errno; the kernel keeps the program while the cgroup
 * lives.  log (logcap bytes, may be 0): the verifier's message on EINVAL. */
int shim_devices_attach(int cgroup_fd, const struct shim_dev_rule *rules, int nrules,
                        char *log, int logcap);
/* How many programs of the device type are attached to the cgroup (the
 * cgroup's own, BPF_PROG_QUERY), or -errno: for tests. */
int shim_devices_count(int cgroup_fd);

/* native/seccomp.c: profile -> BPF, in the parent (libseccomp). */
#define SHIM_CMP_NE 1
#define SHIM_CMP_LT 2
#define SHIM_CMP_LE 3
#define SHIM_CMP_EQ 4
#define SHIM_CMP_GE 5
#define SHIM_CMP_GT 6
#define SHIM_CMP_MASKED_EQ 7
#define SHIM_SECCOMP_MAX_BYTES 32768  /* BPF_MAXINSNS (4096) * 8 */

struct shim_seccomp_arg {
    unsigned int index;       /* 0..5 */
    int op;                   /* SHIM_CMP_* */
    unsigned long long value;
    unsigned long long value2; /* MASKED_EQ: (arg & value) == value2 */
};

struct shim_seccomp_rule {
    int nr;                   /* from shim_seccomp_resolve (native number or pseudo) */
    unsigned int action;      /* SECCOMP_RET_* value, errno in the low 16 bits */
    int nargs;                /* all must match (AND) */
    struct shim_seccomp_arg args[6];
};

/* Native number of a syscall name (negative pseudo number if only other
 * ABIs have it), -1 if libseccomp does not know the name. */
int shim_seccomp_resolve(const char *name);
void shim_seccomp_version(unsigned int out[3]);
unsigned int shim_seccomp_native_arch(void);
/* -> bytes written to buf, or -errno (*failed_rule: index of the rule the
 * library refused, else -1). */
int shim_seccomp_compile(unsigned int default_action, const struct shim_seccomp_rule *rules,
                         int nrules, int *failed_rule, unsigned char *buf, int cap);
/* cffi-end */

#endif

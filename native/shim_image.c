/* shim_image.c — a job in an image (--image): its root file system, built
 * by the child in its own mount namespace, before anything of the plan.
 *
 * The starter (starter/image/mount.py) mounts the image's squashfs, on the
 * image's loop device (read-only, shared by the image's jobs: one
 * superblock), detached (shim_image_mount): the child, already in the job's
 * cgroup, may not open a block device.  It hands that mount (shim_spec.
 * image_fd) and the size of the tmpfs for what the job writes to the child,
 * which, after the plan's bind sources were taken (trees of the host's
 * paths, open_tree'd before), makes:
 *
 *   T          a tmpfs of its own, attached over "/" (this namespace only:
 *              / is a slave) and made the cwd: lower/, upper/, work/; or,
 *              for a job with a scratch (image 2), a bind of a directory of
 *              root's in it (image_upper_fd: a tree the starter cloned,
 *              shim_image_tree, as a fd of its own namespace is no place to
 *              mount in this one), so that --disk counts what it writes
 *   lower/     the image's squashfs (image_fd attached here: overlayfs takes
 *              only layers in the mounter's namespace before Linux 6.15)
 *   overlay    lowerdir lower, upperdir upper, workdir work, detached; it
 *              keeps private clones of its layers, so T (and lower on it)
 *              is detached at once, and the overlay goes over "/"
 *
 * then pivot_root(".", ".") puts the host's root on top of the overlay, and
 * detaches it at once: nothing of the host's
 * file systems is left in the job's view but what the plan binds, no chroot
 * is there to escape, and nothing is mounted on the host.  The overlay keeps
 * its layers; they all go with the job's namespace.  Mount points the image
 * lacks (/proc, /sys, /tmp, /dev and the plan's) are made in the overlay.
 */
#include "shim_internal.h"

#ifndef SYS_fsopen
#define SYS_fsopen 430
#define SYS_fsconfig 431
#define SYS_fsmount 432
#endif
#define IMG_FSOPEN_CLOEXEC 1
#define IMG_FSCONFIG_SET_FLAG 0
#define IMG_FSCONFIG_SET_STRING 1
#define IMG_FSCONFIG_CMD_CREATE 6
#define IMG_FSMOUNT_CLOEXEC 1
#define IMG_MOUNT_ATTR_RDONLY 0x1
#define IMG_MOUNT_ATTR_NOSUID 0x2
#define IMG_MOUNT_ATTR_NODEV 0x4

/* A detached mount of `type`, with the options keys[i]=values[i] (a NULL
 * value: a flag) -> its fd; -errno, *step the call that failed. */
static int detached(const char *type, const char *const *keys, const char *const *values, int n,
                    unsigned int attrs, const char **step)
{
    int fs = (int)syscall(SYS_fsopen, type, IMG_FSOPEN_CLOEXEC), e;
    *step = "fsopen";
    if (fs < 0)
        return -errno;
    for (int i = 0; i < n; i++) {
        long r = values[i] ? syscall(SYS_fsconfig, fs, IMG_FSCONFIG_SET_STRING, keys[i], values[i], 0)
                           : syscall(SYS_fsconfig, fs, IMG_FSCONFIG_SET_FLAG, keys[i], NULL, 0);
        if (r < 0) {
            *step = keys[i];
            goto out;
        }
    }
    *step = "mount";
    if (syscall(SYS_fsconfig, fs, IMG_FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
        goto out;
    *step = "fsmount";
    int mnt = (int)syscall(SYS_fsmount, fs, IMG_FSMOUNT_CLOEXEC, attrs);
    if (mnt < 0)
        goto out;
    close(fs);
    return mnt;
out:
    e = errno;
    close(fs);
    return -e;
}

int shim_image_tree(int dir_fd)
{
    int fd = (int)syscall(SYS_open_tree, dir_fd, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
    return fd < 0 ? -errno : fd;
}

int shim_image_mount(const char *device)
{
    const char *step, *k[] = {"source", "ro"}, *v[] = {device, NULL};
    return detached("squashfs", k, v, 2, IMG_MOUNT_ATTR_RDONLY | IMG_MOUNT_ATTR_NOSUID | IMG_MOUNT_ATTR_NODEV, &step);
}

/* The child: a detached mount made here (or given: mnt >= 0) attached at
 * `where` (relative to the cwd; NULL: over "/", then the cwd). */
static void mount_at(const struct child_ctx *c, int mnt, const char *type, const char *const *keys,
                     const char *const *values, int n, unsigned int attrs, const char *where, const char *what)
{
    const char *step = "move_mount";
    if (mnt < 0) {
        mnt = detached(type, keys, values, n, attrs, &step);
        if (mnt < 0)
            fail_err(c, -mnt, EXIT_STARTER, step, what);
    }
    if (syscall(SYS_move_mount, mnt, "", AT_FDCWD, where ? where : "/", MOVE_MOUNT_F_EMPTY_PATH) < 0)
        fail(c, "move_mount", what);
    if (!where && fchdir(mnt) < 0)
        fail(c, "fchdir", what);
    close(mnt);
}

/* A directory the job's view needs (/proc, /sys, /tmp, /dev): made in the
 * image's overlay if missing; anything else there (a link) fails the job. */
static void mount_point(const struct child_ctx *c, const char *name)
{
    struct stat st;
    if (mkdir(name, 0755) < 0 && errno != EEXIST)
        fail(c, "mkdir in the image", name);
    if (lstat(name, &st) < 0)
        fail(c, "stat in the image", name);
    if (!S_ISDIR(st.st_mode))
        fail_err(c, ENOTDIR, EXIT_STARTER, "the image's mount point", name);
}

void enter_image_root(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    const char *tk[] = {"source", "mode", "size", "nr_inodes"};
    const char *tv[] = {"tmpfs", "0755", s->image_tmpfs_size ? s->image_tmpfs_size : "50%", "1048576"};
    mount_at(c, s->image == 2 ? s->image_upper_fd : -1, "tmpfs", tk, tv, 4,
             IMG_MOUNT_ATTR_NOSUID | IMG_MOUNT_ATTR_NODEV, NULL, "the job's directory for its image");
    static const char *const dirs[] = {"lower", "upper", "work", NULL};
    for (int i = 0; dirs[i]; i++)
        if (mkdir(dirs[i], i == 2 ? 0700 : 0755) < 0)
            fail(c, "mkdir", dirs[i]);
    mount_at(c, s->image_fd, NULL, NULL, NULL, 0, 0, "lower", "the image's squashfs");
    const char *step, *ok[] = {"source", "lowerdir", "upperdir", "workdir"}, *ov[] = {"overlay", "lower", "upper", "work"};
    int root = detached("overlay", ok, ov, 4, IMG_MOUNT_ATTR_NOSUID | IMG_MOUNT_ATTR_NODEV, &step);
    if (root < 0)
        fail_err(c, -root, EXIT_STARTER, step, "the image's overlay");
    /* The overlay holds its layers (private clones): T, with the squashfs
     * on it, goes now, and the overlay goes over "/" in its place. */
    if (umount2(".", MNT_DETACH) < 0)
        fail(c, "detach", "the job's directory for its image");
    mount_at(c, root, NULL, NULL, NULL, 0, 0, NULL, "the image's overlay");
    if (syscall(SYS_pivot_root, ".", ".") < 0)
        fail(c, "pivot_root", "the image's root");
    /* The host's root now lies on top of the image's, at the same place:
     * detached, with everything under it. */
    if (mount(NULL, ".", NULL, MS_REC | MS_SLAVE, NULL) < 0 || umount2(".", MNT_DETACH) < 0)
        fail(c, "detach", "the host's root");
    if (chdir("/") < 0)
        fail(c, "chdir", "/");
    static const char *const points[] = {"/proc", "/sys", "/tmp", "/dev", NULL};
    for (int i = 0; points[i]; i++)
        mount_point(c, points[i]);
}

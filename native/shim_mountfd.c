/* shim_mountfd.c — mounting by fd, and the older kernels' ways.
 *
 * Owns how a mount of the plan reaches its place: each destination walked
 * once from "/" without following any link (walk_dest), the mount made onto
 * the fd the walk ended on, and what is done to the new mount after (slave,
 * read-only) done through an fd of that mount, never by path.  Bind sources
 * are cloned as detached trees in the starter before clone (take_trees,
 * open_tree) and made read-only while detached (mount_setattr).  Without
 * open_tree (before 5.2) a source is pinned by path and checked against the
 * starter's fd (pin_source); without mount_setattr (before 5.12) read-only
 * and slave are remounts through /proc/self/fd (fd_name).  The tests force
 * those paths: shim_test_no_open_tree, shim_test_no_mount_setattr.
 */
#include "shim_internal.h"

#ifndef MOUNT_ATTR_NOSUID
#define MOUNT_ATTR_NOSUID 0x00000002
#endif

/* Tests: behave as on a kernel without mount_setattr (5.2..5.11). */
static int no_mount_setattr = 0;

long sys_mount_setattr(int dfd, const char *path, unsigned int flags, struct mount_attr_v0 *attr)
{
    if (no_mount_setattr) {
        errno = ENOSYS;
        return -1;
    }
    return syscall(SYS_mount_setattr, dfd, path, flags, attr, sizeof *attr);
}

unsigned long st_keep_flags(const struct statfs *st)
{
    unsigned long f = 0;
    if (st->f_flags & ST_NOSUID)
        f |= MS_NOSUID;
    if (st->f_flags & ST_NODEV)
        f |= MS_NODEV;
    if (st->f_flags & ST_NOEXEC)
        f |= MS_NOEXEC;
    if (st->f_flags & ST_NOATIME)
        f |= MS_NOATIME;
    if (st->f_flags & ST_NODIRATIME)
        f |= MS_NODIRATIME;
    if (st->f_flags & ST_RELATIME)
        f |= MS_RELATIME;
    return f;
}

static unsigned long keep_flags(const char *path)
{
    struct statfs st;
    return statfs(path, &st) < 0 ? 0 : st_keep_flags(&st);
}

/* Read-only for the whole subtree (mount_setattr, 5.12+); else the top mount
 * only, keeping the flags the source had (a remount may not clear them). */
int make_readonly(const char *path)
{
    struct mount_attr_v0 attr = {.attr_set = MOUNT_ATTR_RDONLY};
    if (sys_mount_setattr(AT_FDCWD, path, AT_RECURSIVE, &attr) == 0)
        return 0;
    if (errno != ENOSYS)
        return -1;
    return mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | keep_flags(path), NULL);
}

/* Read-only, or nosuid, or both (MOUNT_ATTR_* bits in `attrs`) for the
 * mount whose root `fd` is (an fd of the new mount, never its path): the
 * whole subtree with mount_setattr, else the top mount by a remount that
 * keeps the flags it had.  The remount goes through fd_name(), see there. */
int restrict_mount_fd(int fd, unsigned long long attrs)
{
    struct mount_attr_v0 attr = {.attr_set = attrs};
    struct statfs st;
    char name[16];
    if (sys_mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) == 0)
        return 0;
    if (errno != ENOSYS)
        return -1;
    if (fstatfs(fd, &st) < 0)
        return -1;
    return mount(NULL, fd_name(name, fd), NULL,
                 MS_BIND | MS_REMOUNT | st_keep_flags(&st) | ((attrs & MOUNT_ATTR_RDONLY) ? MS_RDONLY : 0) |
                     ((attrs & MOUNT_ATTR_NOSUID) ? MS_NOSUID : 0),
                 NULL);
}

int make_readonly_fd(int fd)
{
    return restrict_mount_fd(fd, MOUNT_ATTR_RDONLY);
}

/* ---- mount destinations --------------------------------------------------
 *
 * A destination is resolved once, in the job's namespace after the mounts
 * before it: from "/" one component at a time with O_PATH|O_NOFOLLOW, so no
 * link is followed, the last component included.  The job's user may own a
 * directory on the way (a host directory, a bind source of its own): a link
 * planted there would carry the mount anywhere (over /usr/bin), and one
 * swapped in between two lookups of the same path would split them (runc's
 * CVE-2021-30465).  So the mount goes onto the fd the walk ended on, and what
 * is done to the new mount after (slave, read-only) is done through an fd of
 * that mount, never by the path again.  A plain walk, not openat2's
 * RESOLVE_NO_SYMLINKS: the refusal names the link, and missing components
 * are made on the way. */

/* mount(2) takes paths only.  The ones this child gives it are fd numbers
 * looked up in its own /proc/self/fd, opened before the first mount of the
 * plan and made the cwd for the plan (fd_dir): a plan entry over /proc or
 * /proc/1 cannot redirect them. */
const char *fd_name(char buf[16], int fd)
{
    s_int(buf, 16, fd);
    return buf;
}

/* "mount destination DST: PREFIX is a symlink (not followed)": the whole
 * message (ns.py shows it as is), PREFIX being the first `upto` bytes of
 * DST; truncated to fit. */
void link_step(char msg[SHIM_STEP_MAX], const char *dst, size_t upto)
{
    char prefix[SHIM_STEP_MAX];
    size_t i;
    for (i = 0; i < upto && i + 1 < sizeof prefix; i++)
        prefix[i] = dst[i];
    prefix[i] = 0;
    size_t at = s_cat(msg, 0, SHIM_STEP_MAX, "mount destination ");
    at = s_cat(msg, at, SHIM_STEP_MAX, dst);
    at = s_cat(msg, at, SHIM_STEP_MAX, ": ");
    at = s_cat(msg, at, SHIM_STEP_MAX, prefix);
    s_cat(msg, at, SHIM_STEP_MAX, " is a symlink (not followed)");
}

static _Noreturn void fail_link(const struct child_ctx *c, const char *dst, size_t upto)
{
    char msg[SHIM_STEP_MAX];
    link_step(msg, dst, upto);
    fail_err(c, ELOOP, EXIT_STARTER, msg, NULL);
}

void close_dest(struct dest *d)
{
    if (d->fd >= 0)
        close(d->fd);
    if (d->parent >= 0)
        close(d->parent);
    d->fd = d->parent = -1;
}

/* Walk m->dst (see above) into *d.  A missing component is made where
 * ours() allows it (mkdirat, or a file for a bind of a file, by the held
 * parent fd); a link anywhere fails the child.  -1 with errno ENOENT where a
 * component is missing and may not be made: the caller says what that
 * means.  Other failures fail the child as `what` DST ("mkdir" DST for a
 * directory that could not be made). */
int walk_dest(const struct child_ctx *c, const struct shim_mount *m, const char *what, int file,
              int create, struct dest *d)
{
    const char *dst = m->dst, *p = dst;
    d->parent = -1;
    d->name[0] = 0;
    d->fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (d->fd < 0)
        fail(c, what, dst);
    for (;;) {
        while (*p == '/')
            p++;
        if (!*p)
            return 0;
        const char *e = p;
        while (*e && *e != '/')
            e++;
        size_t len = (size_t)(e - p);
        const char *rest = e;
        while (*rest == '/')
            rest++;
        int last = *rest == 0;
        if (len == 1 && p[0] == '.') {
            p = e;
            continue;
        }
        if (len >= sizeof d->name)
            fail_err(c, ENAMETOOLONG, EXIT_STARTER, what, dst);
        if (len == 2 && p[0] == '.' && p[1] == '.')
            fail_err(c, EINVAL, EXIT_STARTER, what, dst); /* the starter refuses '..' */
        if (d->parent >= 0)
            close(d->parent);
        d->parent = d->fd;
        d->fd = -1;
        for (size_t i = 0; i < len; i++)
            d->name[i] = p[i];
        d->name[len] = 0;
        p = e;
        int fd = openat(d->parent, d->name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT && create) {
            if (last && file) {
                /* O_EXCL: never through a link; a link there is refused below */
                fd = openat(d->parent, d->name, O_RDONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
                if (fd < 0 && errno != EEXIST)
                    fail(c, "mkdir", dst);
            } else if (mkdirat(d->parent, d->name, 0755) < 0 && errno != EEXIST) {
                fail(c, "mkdir", dst);
            }
            if (fd < 0)
                fd = openat(d->parent, d->name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        }
        if (fd < 0) {
            if (errno == ENOENT) {
                close_dest(d);
                errno = ENOENT;
                return -1;
            }
            fail(c, what, dst);
        }
        d->fd = fd;
        struct stat st;
        if (fstat(fd, &st) < 0)
            fail(c, what, dst);
        if (S_ISLNK(st.st_mode))
            fail_link(c, dst, (size_t)(e - dst));
        if (!last && !S_ISDIR(st.st_mode))
            fail_err(c, ENOTDIR, EXIT_STARTER, what, dst);
    }
}

/* Attach the detached mount `tree` onto the walked destination. */
int attach(int tree, const struct dest *d)
{
    return (int)syscall(SYS_move_mount, tree, "", d->fd, "",
                        MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH);
}

/* What a bind gets on top of its source's flags: read-only (SHIM_MOUNT_RO_BIND),
 * nosuid (SHIM_MS_NOSUID in m->flags: a transient uid's writable binds), as
 * MOUNT_ATTR_* bits; 0: nothing. */
unsigned long long bind_attrs(const struct shim_mount *m)
{
    return (m->kind == SHIM_MOUNT_RO_BIND ? MOUNT_ATTR_RDONLY : 0) |
           ((m->flags & SHIM_MS_NOSUID) ? MOUNT_ATTR_NOSUID : 0);
}

/* Bind sources are taken before anything is mounted (open_tree, 5.2+), so a
 * source is the starter's view of that path even when the private /tmp or an
 * earlier mount covers it in the job's view.  A read-only (or nosuid) bind
 * is made so while still detached, for its whole subtree, keeping the flags
 * (nosuid, nodev, ...) the source had. */
int grab_source(const struct child_ctx *c, const struct shim_mount *m)
{
    if (m->kind != SHIM_MOUNT_BIND && m->kind != SHIM_MOUNT_RO_BIND)
        return -1;
    int fd = (int)syscall(SYS_open_tree, AT_FDCWD, m->src,
                          OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
    if (fd < 0) {
        if (errno == ENOSYS)
            return -1; /* old kernel: mount(2) from the path later */
        fail(c, "bind source", m->src);
    }
    if (bind_attrs(m)) {
        struct mount_attr_v0 attr = {.attr_set = bind_attrs(m)};
        if (sys_mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) < 0) {
            if (errno != ENOSYS)
                fail(c, m->kind == SHIM_MOUNT_RO_BIND ? "read-only" : "nosuid", m->src);
            close(fd); /* 5.2..5.11: no mount_setattr; remount after mount(2) */
            return -1;
        }
    }
    return fd;
}

/* No open_tree (before 5.2): open the source by path in our own namespace,
 * before anything covers it (the private /tmp), and check it is the inode the
 * starter resolved without links (else a link was swapped in).  It is then
 * mounted from our /proc/self/fd/N (fd_name): the starter's fd itself would
 * not do, as mount(2) binds only mounts of the caller's namespace. */
int pin_source(const struct child_ctx *c, const struct shim_mount *m)
{
    struct stat want, got;
    int fd = open(m->src, O_PATH | O_CLOEXEC);
    if (fd < 0)
        fail(c, "bind source", m->src);
    if (fstat(m->src_fd, &want) < 0 || fstat(fd, &got) < 0)
        fail(c, "stat bind source", m->src);
    if (want.st_dev != got.st_dev || want.st_ino != got.st_ino)
        fail_err(c, ELOOP, EXIT_STARTER, "bind source changed while resolving", m->src);
    return fd;
}

/* After a mount(2) bind onto d (no open_tree): an fd of the new mount, by
 * the last component in the held parent, checked to be the root of the
 * bind (the inode of `src`), so no other path is ever made read-only. */
int new_bind_fd(const struct child_ctx *c, const struct shim_mount *m, const struct dest *d, int src)
{
    struct stat want, got;
    int fd = d->parent >= 0 ? openat(d->parent, d->name, O_PATH | O_NOFOLLOW | O_CLOEXEC)
                            : open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        fail(c, "remount read-only", m->dst);
    if ((src >= 0 ? fstat(src, &want) : stat(m->src, &want)) < 0 || fstat(fd, &got) < 0)
        fail(c, "remount read-only", m->dst);
    if (want.st_dev != got.st_dev || want.st_ino != got.st_ino)
        fail_err(c, ELOOP, EXIT_STARTER, "mount destination changed while mounting", m->dst);
    return fd;
}

void close_trees(const struct shim_spec *s, int *trees)
{
    for (int i = 0; i < s->nmounts && i < SHIM_MAX_MOUNTS; i++)
        if (trees[i] >= 0) {
            close(trees[i]);
            trees[i] = -1;
        }
}

static int no_open_tree = 0; /* tests: as on a kernel without open_tree */

void shim_test_no_open_tree(int on)
{
    no_open_tree = on;
    no_fsopen = on; /* both 5.2 */
    no_mount_setattr = on;
}

void shim_test_no_mount_setattr(int on)
{
    no_mount_setattr = on;
}

/* Bind sources given as fds are cloned here, in the starter, before clone():
 * open_tree() clones only mounts of the caller's own mount namespace, so the
 * child could not use an fd the starter opened, and it must not walk the path
 * again (a link could have been swapped in).  A detached tree can be attached
 * in any namespace.  Read-only is set while it is still detached.  -1 where
 * the kernel lacks open_tree or mount_setattr: the child then pins the source
 * by path and checks its inode (pin_source). */
int take_trees(const struct shim_spec *s, int *trees)
{
    for (int i = 0; i < SHIM_MAX_MOUNTS; i++)
        trees[i] = -1;
    if (no_open_tree)
        return 0;
    for (int i = 0; i < s->nmounts && i < SHIM_MAX_MOUNTS; i++) {
        const struct shim_mount *m = &s->mounts[i];
        if ((m->kind != SHIM_MOUNT_BIND && m->kind != SHIM_MOUNT_RO_BIND) || m->src_fd < 0)
            continue;
        int fd = (int)syscall(SYS_open_tree, m->src_fd, "",
                              AT_EMPTY_PATH | OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
        if (fd < 0) {
            if (errno == ENOSYS)
                continue;
            goto fail;
        }
        if (bind_attrs(m)) {
            struct mount_attr_v0 attr = {.attr_set = bind_attrs(m)};
            if (sys_mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) < 0) {
                int e = errno;
                close(fd);
                if (e == ENOSYS)
                    continue;
                errno = e;
                goto fail;
            }
        }
        trees[i] = fd;
    }
    return 0;
fail:;
    int e = errno;
    close_trees(s, trees);
    return -e;
}

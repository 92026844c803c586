/* shim_mount.c — the mount plan, applied in the child after the release.
 *
 * Owns the order of the job's view (setup_namespaces): / made a slave, bind
 * sources grabbed, /proc (read-only parts for a uid-0 job), /sys, lo up, the
 * hostname, the private /tmp, then the plan of starter/isolate/mounts.py entry by
 * entry (do_mount): binds, tmpfs (fsopen, with the options split as mount(2)
 * splits them), the plan's own mounts (/dev/shm, cgroup views, hiding), and
 * the links and device nodes of the job's /dev, made only inside a tmpfs the
 * plan mounted (ours).  How each mount reaches its destination, by fd and
 * without following links, is shim_mountfd.c's.
 */
#include "shim_internal.h"

/* mkdir -p for a mount point inside a tmpfs this child mounted (a fresh /tmp
 * has no directories yet); never on the host's filesystems. */
int under(const char *path, const char *dir)
{
    size_t n = s_len(dir);
    if (n == 1)
        return 0; /* "/" is never ours */
    for (size_t i = 0; i < n; i++)
        if (path[i] != dir[i])
            return 0;
    return path[n] == '/';
}

int is_tmpfs(const struct shim_mount *m)
{
    const char *t = m->fstype, *w = "tmpfs";
    if (!t)
        return 0;
    while (*t && *t == *w)
        t++, w++;
    return *t == 0 && *w == 0;
}

/* May missing components of m->dst be made?  Only inside a tmpfs this plan
 * mounted before it (the private /tmp, an earlier tmpfs entry). */
int ours(const struct child_ctx *c, const struct shim_mount *m)
{
    const struct shim_spec *s = c->s;
    if (s->image)
        return 1; /* the image's overlay: the job's own upper directory */
    if (s->private_tmp && under(m->dst, "/tmp"))
        return 1;
    for (int i = 0; i < s->nmounts; i++) {
        const struct shim_mount *o = &s->mounts[i];
        if (o == m)
            break;
        if ((o->kind == SHIM_MOUNT_TMPFS || (o->kind == SHIM_MOUNT_FS && is_tmpfs(o))) &&
            under(m->dst, o->dst))
            return 1;
    }
    return 0;
}

/* fsopen/fsconfig/fsmount (5.2+): a tmpfs made detached, nosuid and nodev,
 * with `data` split into options as mount(2) would split it (a comma before
 * a digit continues mpol's node list).  -1 with errno ENOSYS on older
 * kernels: mount(2) then. */
#ifndef SYS_fsopen
#define SYS_fsopen 430
#define SYS_fsconfig 431
#define SYS_fsmount 432
#endif
#define FSOPEN_CLOEXEC_ 1
#define FSCONFIG_SET_FLAG_ 0
#define FSCONFIG_SET_STRING_ 1
#define FSCONFIG_CMD_CREATE_ 6
#define FSMOUNT_CLOEXEC_ 1
#define MOUNT_ATTR_NOSUID_ 0x2
#define MOUNT_ATTR_NODEV_ 0x4

int no_fsopen = 0; /* tests: with no_open_tree, as before 5.2 */

/* tmpfs options split as mount(2) splits them: at each comma, except a
 * comma before a digit, which continues mpol's node list
 * ("mpol=bind:0,2,size=1m" is two options).  In place: the option at
 * *cursor is NUL-terminated, its value (after the first '=') in *value, NULL
 * for a flag; "" for an empty option (skipped by the caller).  NULL at the
 * end. */
char *tmpfs_opt_next(char **cursor, char **value)
{
    char *o = *cursor;
    if (!o || !*o)
        return NULL;
    char *next = o;
    for (;;) {
        while (*next && *next != ',')
            next++;
        if (!*next) {
            next = NULL;
            break;
        }
        if (next[1] < '0' || next[1] > '9') {
            *next++ = 0;
            break;
        }
        next++;
    }
    char *v = o;
    while (*v && *v != '=')
        v++;
    if (*v)
        *v++ = 0;
    else
        v = NULL;
    *value = v;
    *cursor = next;
    return o;
}

static int new_tmpfs(const char *data)
{
    char opts[4096];
    if (no_fsopen) {
        errno = ENOSYS;
        return -1;
    }
    int fs = (int)syscall(SYS_fsopen, "tmpfs", FSOPEN_CLOEXEC_);
    if (fs < 0)
        return -1;
    size_t n = data ? s_len(data) : 0;
    if (n >= sizeof opts) {
        close(fs);
        errno = E2BIG;
        return -1;
    }
    for (size_t i = 0; i <= n; i++)
        opts[i] = data ? data[i] : 0;
    /* "tmpfs" as the source in mountinfo, as mount(2) gives it */
    if (syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING_, "source", "tmpfs", 0) < 0)
        goto fail;
    char *cursor = opts, *o, *value;
    while ((o = tmpfs_opt_next(&cursor, &value)))
        if (*o && syscall(SYS_fsconfig, fs, value ? FSCONFIG_SET_STRING_ : FSCONFIG_SET_FLAG_, o, value, 0) < 0)
            goto fail;
    if (syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE_, NULL, NULL, 0) < 0)
        goto fail;
    int mnt = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC_, MOUNT_ATTR_NOSUID_ | MOUNT_ATTR_NODEV_);
    if (mnt < 0)
        goto fail;
    close(fs);
    return mnt;
fail:;
    int e = errno;
    close(fs);
    errno = e;
    return -1;
}

/* The directory of an absolute path into dir ("/" for "/x"), for a link or
 * node made by that directory's fd; -> the index of the last '/' (the name
 * starts after it).  The caller checked s_len(path) < cap. */
size_t parent_dir(const char *path, char *dir, size_t cap)
{
    size_t n = s_len(path), cut = 0;
    for (size_t i = 0; i < n && i < cap; i++)
        if (path[i] == '/')
            cut = i;
    for (size_t i = 0; i < cut; i++)
        dir[i] = path[i];
    dir[cut ? cut : 1] = 0;
    if (!cut)
        dir[0] = '/';
    return cut;
}

#define DIR_MAX 4096

/* Walk the directory of m->dst (s_len < DIR_MAX) as any destination is, no
 * link followed, making what is missing (inside a tmpfs of the plan only:
 * the callers checked ours()) into *d; -> the last component, to be made by
 * d->fd. */
static const char *walk_parent(const struct child_ctx *c, const struct shim_mount *m, const char *what,
                               struct dest *d)
{
    char dir[DIR_MAX];
    size_t cut = parent_dir(m->dst, dir, sizeof dir);
    struct shim_mount parent = *m;
    parent.dst = dir;
    if (walk_dest(c, &parent, what, 0, 1, d) < 0)
        fail(c, what, m->dst);
    return m->dst + cut + 1;
}

/* SHIM_MOUNT_LINK: the link m->dst -> m->src, made in a tmpfs this plan
 * mounted (the job's /dev: /dev/fd, /dev/ptmx, ...), never on the host's
 * file systems.  Its directory is walked as any destination is (no link
 * followed), and the link made by that directory's fd. */
static void make_link(const struct child_ctx *c, const struct shim_mount *m)
{
    if (!ours(c, m) || !m->src || s_len(m->dst) >= DIR_MAX)
        fail_err(c, EPERM, EXIT_STARTER, "symlink outside a tmpfs of the plan", m->dst);
    struct dest d;
    const char *name = walk_parent(c, m, "symlink", &d);
    if (symlinkat(m->src, d.fd, name) < 0)
        fail(c, "symlink", m->dst);
    close_dest(&d);
}

/* SHIM_MOUNT_NODE: a device node at m->dst, made while the child is still
 * root in the initial user namespace (the job itself never has CAP_MKNOD),
 * in a tmpfs this plan mounted (the job's /dev) only.  The starter copied
 * the host node's type, permissions and number; umask does not apply. */
static void make_node(const struct child_ctx *c, const struct shim_mount *m)
{
    if (!ours(c, m) || s_len(m->dst) >= DIR_MAX || !(S_ISCHR(m->mode) || S_ISBLK(m->mode)))
        fail_err(c, EPERM, EXIT_STARTER, "device node outside a tmpfs of the plan", m->dst);
    struct dest d;
    const char *name = walk_parent(c, m, "mknod", &d);
    /* By the directory's fd (an O_PATH dirfd does), with the mode as given:
     * no umask (the job's own is set later, reset_inherited). */
    mode_t old = umask(0);
    int r = mknodat(d.fd, name, m->mode, (dev_t)m->rdev);
    umask(old);
    if (r < 0)
        fail(c, "mknod", m->dst);
    close_dest(&d);
}

static void do_mount(const struct child_ctx *c, const struct shim_mount *m, int tree, int pinned)
{
    const char *what = m->kind == SHIM_MOUNT_BIND      ? "bind"
                       : m->kind == SHIM_MOUNT_RO_BIND ? "ro-bind"
                       : m->kind == SHIM_MOUNT_TMPFS   ? "tmpfs"
                                                       : "mount";
    if (m->kind == SHIM_MOUNT_LINK) {
        make_link(c, m);
        return;
    }
    if (m->kind == SHIM_MOUNT_NODE) {
        make_node(c, m);
        return;
    }
    int bind = m->kind == SHIM_MOUNT_BIND || m->kind == SHIM_MOUNT_RO_BIND;
    int optional = m->kind == SHIM_MOUNT_FS && m->optional;
    int create = !optional && ours(c, m);
    int file = 0;
    char name[16], from[16];
    struct stat st;
    struct dest d;
    if (create && bind &&
        (tree >= 0     ? fstat(tree, &st)
         : pinned >= 0 ? fstat(pinned, &st)
         : m->src_fd >= 0 ? fstat(m->src_fd, &st) : stat(m->src, &st)) == 0 &&
        !S_ISDIR(st.st_mode))
        file = 1; /* a bind of a file gets a file to cover */
    if (walk_dest(c, m, what, file, create, &d) < 0) {
        if (optional)
            return; /* e.g. a hidden path under the private /tmp: nothing to hide */
        fail(c, what, m->dst);
    }
    if (tree >= 0) {
        /* A tree cloned in the starter's namespace is a peer of its source
         * (shared, on systemd hosts): nothing may propagate back.  A slave
         * while still detached (5.12+), else once attached, through the
         * tree's own fd, which is the new mount. */
        struct mount_attr_v0 attr = {.propagation = MS_SLAVE};
        int slave = sys_mount_setattr(tree, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr) == 0;
        if (!slave && errno != ENOSYS)
            fail(c, "make slave", m->dst);
        if (attach(tree, &d) < 0)
            fail(c, what, m->dst);
        if (!slave && mount(NULL, fd_name(name, tree), NULL, MS_REC | MS_SLAVE, NULL) < 0)
            fail(c, "make slave", m->dst);
        close(tree);
        close_dest(&d);
        return;
    }
    switch (m->kind) {
    case SHIM_MOUNT_BIND:
    case SHIM_MOUNT_RO_BIND:
        if (mount(pinned >= 0 ? fd_name(from, pinned) : m->src, fd_name(name, d.fd), NULL,
                  MS_BIND | MS_REC, NULL) < 0)
            fail(c, what, m->dst);
        if (bind_attrs(m)) {
            int top = new_bind_fd(c, m, &d, pinned);
            if (restrict_mount_fd(top, bind_attrs(m)) < 0)
                fail(c, m->kind == SHIM_MOUNT_RO_BIND ? "remount read-only" : "remount nosuid", m->dst);
            close(top);
        }
        break;
    case SHIM_MOUNT_TMPFS: {
        int mnt = new_tmpfs(m->data);
        if (mnt >= 0) {
            if (attach(mnt, &d) < 0)
                fail(c, what, m->dst);
            close(mnt);
        } else if (errno != ENOSYS ||
                   mount("tmpfs", fd_name(name, d.fd), "tmpfs", MS_NOSUID | MS_NODEV, m->data) < 0) {
            fail(c, what, m->dst);
        }
        break;
    }
    case SHIM_MOUNT_FS: /* the plan's own mounts: /dev/shm, cgroup views, hiding */
        if (mount(m->src ? m->src : m->fstype, fd_name(name, d.fd), m->fstype, m->flags, m->data) < 0)
            fail(c, what, m->dst);
        break;
    default:
        fail_err(c, EINVAL, EXIT_STARTER, "mount kind", m->dst);
    }
    close_dest(&d);
}

/* A fresh sysfs shows the job's own network namespace.  Its /sys/fs/cgroup
 * is an empty directory: the job's own cgroup tree is mounted there by the
 * mount plan, inside the job's cgroup namespace (starter/isolate/mounts.py). */
static void mount_sys(const struct child_ctx *c, int harden)
{
    unsigned long fl = MS_NOSUID | MS_NODEV | MS_NOEXEC | (harden ? MS_RDONLY : 0);
    if (mount("sysfs", "/sys", "sysfs", fl, NULL) < 0)
        fail(c, "mount", "/sys");
}

/* A uid-0 job without capabilities still passes owner permission checks on
 * root-owned files: /proc/sys (host sysctls), /proc/sysrq-trigger.  Make
 * those read-only, like docker's readonly paths. */
static void harden_proc(const struct child_ctx *c)
{
    static const char *const paths[] = {"/proc/sys", "/proc/sysrq-trigger", "/proc/irq",
                                        "/proc/bus", "/proc/fs", NULL};
    for (int i = 0; paths[i]; i++) {
        if (mount(paths[i], paths[i], NULL, MS_BIND | MS_REC, NULL) < 0) {
            if (errno == ENOENT)
                continue;
            fail(c, "bind", paths[i]);
        }
        if (mount(NULL, paths[i], NULL,
                  MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            fail(c, "remount read-only", paths[i]);
    }
}

static void loopback_up(const struct child_ctx *c)
{
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        fail(c, "socket for", "lo");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_name[0] = 'l';
    ifr.ifr_name[1] = 'o';
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        fail(c, "SIOCGIFFLAGS", "lo");
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        fail(c, "loopback up", "lo");
    close(s);
}

void setup_namespaces(const struct child_ctx *c)
{
    const struct shim_spec *s = c->s;
    int ns = s->nsflags;
    int harden = s->drop_privileges && s->uid == 0;
    int trees[SHIM_MAX_MOUNTS], pinned[SHIM_MAX_MOUNTS];
    /* A task joining its job's part (join_part): the part's PID and network
     * namespaces get a /proc and a /sys of their own here as new ones would. */
    int image = (ns & SHIM_NEWNS) && s->image;
    /* (in an image, the host's /proc and /sys are gone with the host's root) */
    int own_proc = (ns & SHIM_NEWPID) || s->enter_ns_fds[SHIM_NS_PID] >= 0 || image;
    int own_sys = (ns & SHIM_NEWNET) || s->enter_ns_fds[SHIM_NS_NET] >= 0 || image;

    if (ns & SHIM_NEWNS) {
        /* Before any mount, or the mounts below propagate to the host. */
        if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0)
            fail(c, "make / a slave mount", NULL);
        for (int i = 0; i < s->nmounts && i < SHIM_MAX_MOUNTS; i++) {
            const struct shim_mount *m = &s->mounts[i];
            int bind = m->kind == SHIM_MOUNT_BIND || m->kind == SHIM_MOUNT_RO_BIND;
            pinned[i] = -1;
            if (c->trees && c->trees[i] >= 0)
                trees[i] = c->trees[i];
            else if (bind && m->src_fd >= 0) {
                trees[i] = -1;
                pinned[i] = pin_source(c, m);
            } else
                trees[i] = grab_source(c, m);
            if (image && pinned[i] >= 0)
                fail_err(c, EOPNOTSUPP, EXIT_STARTER, "a bind into an image needs open_tree (Linux 5.2)", m->dst);
        }
        if (image)
            enter_image_root(c);
        if (own_proc) {
            if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
                fail(c, "mount", "/proc");
            if (harden)
                harden_proc(c);
        }
        if (own_sys) {
            mount_sys(c, harden);
        } else if (harden) {
            if (mount("/sys", "/sys", NULL, MS_BIND | MS_REC, NULL) < 0 || make_readonly("/sys") < 0)
                fail(c, "remount read-only", "/sys");
        }
    }
    if (ns & SHIM_NEWNET)
        loopback_up(c);
    if (s->hostname && sethostname(s->hostname, s_len(s->hostname)) < 0)
        fail(c, "sethostname", s->hostname);
    if ((ns & SHIM_NEWNS) && s->private_tmp &&
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777") < 0)
        fail(c, "mount", "/tmp");
    if (s->nmounts <= 0)
        return;
    /* See fd_name(): mount(2) gets fd numbers in our own /proc/self/fd,
     * opened now, before any mount of the plan, and made the cwd for it. */
    int fd_dir = open("/proc/self/fd", O_PATH | O_DIRECTORY | O_CLOEXEC);
    int cwd = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd_dir < 0 || fchdir(fd_dir) < 0)
        fail(c, "open", "/proc/self/fd");
    for (int i = 0; i < s->nmounts && i < SHIM_MAX_MOUNTS; i++)
        do_mount(c, &s->mounts[i], trees[i], pinned[i]);
    if (cwd >= 0 ? fchdir(cwd) < 0 : chdir("/") < 0)
        fail(c, "chdir", "back from /proc/self/fd");
    close(fd_dir);
    if (cwd >= 0)
        close(cwd);
}

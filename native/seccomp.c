/* seccomp.c — compile a parsed syscall-filter profile to a BPF program.
 *
 * Runs in the starter (parent), never in the cloned child: libseccomp
 * allocates.  The caller (starter/seccomp) has already parsed and checked
 * the profile; here it becomes struct sock_filter[] bytes, which the shim
 * installs with seccomp(SECCOMP_SET_MODE_FILTER) as its last step before
 * execve (see install_seccomp in shim.c).
 *
 * Every ABI the machine can run gets the same rules: on x86_64 also i386
 * (int 0x80) and x32, on aarch64 also 32-bit arm.  Otherwise a deny-list
 * could be bypassed by calling the same syscall through another ABI.  Any
 * other architecture value in a syscall is killed (libseccomp's bad-arch
 * action).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <seccomp.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shim.h"

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif

int shim_seccomp_resolve(const char *name)
{
    return seccomp_syscall_resolve_name(name);
}

void shim_seccomp_version(unsigned int out[3])
{
    const struct scmp_version *v = seccomp_version();
    out[0] = v ? v->major : 0;
    out[1] = v ? v->minor : 0;
    out[2] = v ? v->micro : 0;
}

unsigned int shim_seccomp_native_arch(void)
{
    return seccomp_arch_native();
}

static int add_compat_arches(scmp_filter_ctx ctx)
{
    static const uint32_t x86_64[] = {SCMP_ARCH_X86, SCMP_ARCH_X32, 0};
    static const uint32_t aarch64[] = {SCMP_ARCH_ARM, 0};
    const uint32_t *extra = NULL;
    switch (seccomp_arch_native()) {
    case SCMP_ARCH_X86_64:
        extra = x86_64;
        break;
    case SCMP_ARCH_AARCH64:
        extra = aarch64;
        break;
    default:
        return 0;
    }
    for (int i = 0; extra[i]; i++) {
        int r = seccomp_arch_add(ctx, extra[i]);
        if (r < 0 && r != -EEXIST)
            return r;
    }
    return 0;
}

static int to_op(int op, enum scmp_compare *out)
{
    switch (op) {
    case SHIM_CMP_NE: *out = SCMP_CMP_NE; return 0;
    case SHIM_CMP_LT: *out = SCMP_CMP_LT; return 0;
    case SHIM_CMP_LE: *out = SCMP_CMP_LE; return 0;
    case SHIM_CMP_EQ: *out = SCMP_CMP_EQ; return 0;
    case SHIM_CMP_GE: *out = SCMP_CMP_GE; return 0;
    case SHIM_CMP_GT: *out = SCMP_CMP_GT; return 0;
    case SHIM_CMP_MASKED_EQ: *out = SCMP_CMP_MASKED_EQ; return 0;
    }
    return -EINVAL;
}

/* Read the exported program back from a memfd (libseccomp 2.5 exports to
 * a fd only). */
static int export(scmp_filter_ctx ctx, unsigned char *buf, int cap)
{
    int fd = (int)syscall(SYS_memfd_create, "starter-seccomp", MFD_CLOEXEC);
    if (fd < 0)
        return -errno;
    int r = seccomp_export_bpf(ctx, fd);
    if (r < 0)
        goto out;
    off_t len = lseek(fd, 0, SEEK_END);
    if (len < 0) {
        r = -errno;
        goto out;
    }
    if (len > cap) {
        r = -E2BIG;
        goto out;
    }
    r = 0;
    while (r < len) {
        ssize_t n = pread(fd, buf + r, (size_t)(len - r), r);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            r = n < 0 ? -errno : -EIO;
            goto out;
        }
        r += (int)n;
    }
out:
    close(fd);
    return r;
}

int shim_seccomp_compile(unsigned int default_action, const struct shim_seccomp_rule *rules,
                         int nrules, int *failed_rule, unsigned char *buf, int cap)
{
    *failed_rule = -1;
    scmp_filter_ctx ctx = seccomp_init(default_action);
    if (!ctx)
        return -EINVAL;
    int r = add_compat_arches(ctx);
    for (int i = 0; r >= 0 && i < nrules; i++) {
        const struct shim_seccomp_rule *ru = &rules[i];
        struct scmp_arg_cmp cmp[6];
        if (ru->nargs < 0 || ru->nargs > 6) {
            r = -EINVAL;
        } else {
            for (int a = 0; r >= 0 && a < ru->nargs; a++) {
                cmp[a].arg = ru->args[a].index;
                cmp[a].datum_a = ru->args[a].value;
                cmp[a].datum_b = ru->args[a].value2;
                r = to_op(ru->args[a].op, &cmp[a].op);
            }
        }
        if (r >= 0)
            r = seccomp_rule_add_array(ctx, ru->action, ru->nr, (unsigned int)ru->nargs, cmp);
        if (r < 0)
            *failed_rule = i;
    }
    if (r >= 0)
        r = export(ctx, buf, cap);
    seccomp_release(ctx);
    return r;
}

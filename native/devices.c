/* devices.c — the job's device allow list as a cgroup BPF program.
 *
 * cgroup v2 has no devices controller: the kernel asks BPF_CGROUP_DEVICE
 * programs attached to the cgroup (and its ancestors) on every open and
 * mknod of a device node, as runc and crun use them.  The program is
 * generated here (no libbpf, no compiler), loaded with bpf(BPF_PROG_LOAD)
 * and attached with bpf(BPF_PROG_ATTACH) in the starter, before the job
 * runs.  Its shape, per rule:
 *
 *     r2 = ctx->access_type & 0xffff       type (BPF_DEVCG_DEV_*)
 *     r3 = ctx->access_type >> 16          access asked (BPF_DEVCG_ACC_*)
 *     r4 = ctx->major, r5 = ctx->minor
 *   rule i:
 *     if r2 != type goto next              (left out for "any type")
 *     r1 = r3 & ~access; if r1 != 0 goto next   (left out for rwm)
 *     if r4 != major goto next             (left out for any major)
 *     if r5 != minor goto next             (left out for any minor)
 *     r0 = 1; exit                         allowed
 *   next: ...
 *   r0 = 0; exit                           refused: EPERM
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/bpf.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shim.h"

#define INSN(c, d, s, o, i) ((struct bpf_insn){.code = (c), .dst_reg = (d), .src_reg = (s), .off = (o), .imm = (i)})
#define LDX_W(d, s, o) INSN(BPF_LDX | BPF_MEM | BPF_W, d, s, o, 0)
#define ALU32_IMM(op, d, i) INSN(BPF_ALU | BPF_K | (op), d, 0, 0, i)
#define MOV32_REG(d, s) INSN(BPF_ALU | BPF_X | BPF_MOV, d, s, 0, 0)
#define MOV64_IMM(d, i) INSN(BPF_ALU64 | BPF_K | BPF_MOV, d, 0, 0, i)
#define JNE_IMM(d, i, o) INSN(BPF_JMP | BPF_K | BPF_JNE, d, 0, o, i)
#define EXIT() INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0)

#define ACC_ALL (SHIM_DEV_MKNOD | SHIM_DEV_READ | SHIM_DEV_WRITE)
#define MAX_INSNS (6 + SHIM_DEV_MAX_RULES * 7 + 2)

static long sys_bpf(int cmd, union bpf_attr *attr)
{
    return syscall(SYS_bpf, cmd, attr, sizeof *attr);
}

/* -> number of instructions written to prog, or -EINVAL for a bad rule. */
static int build(const struct shim_dev_rule *rules, int n, struct bpf_insn *prog)
{
    int k = 0;
    prog[k++] = LDX_W(BPF_REG_2, BPF_REG_1, 0);
    prog[k++] = ALU32_IMM(BPF_AND, BPF_REG_2, 0xffff);
    prog[k++] = LDX_W(BPF_REG_3, BPF_REG_1, 0);
    prog[k++] = ALU32_IMM(BPF_RSH, BPF_REG_3, 16);
    prog[k++] = LDX_W(BPF_REG_4, BPF_REG_1, 4);
    prog[k++] = LDX_W(BPF_REG_5, BPF_REG_1, 8);
    for (int i = 0; i < n; i++) {
        const struct shim_dev_rule *r = &rules[i];
        if ((r->type != 0 && r->type != SHIM_DEV_BLOCK && r->type != SHIM_DEV_CHAR) ||
            (r->access & ~ACC_ALL) || r->access == 0 || r->major < SHIM_DEV_ANY || r->minor < SHIM_DEV_ANY)
            return -EINVAL;
        /* The block's length first: every jump goes to its end. */
        int len = 2 + (r->type ? 1 : 0) + ((r->access & ACC_ALL) != ACC_ALL ? 3 : 0) +
                  (r->major != SHIM_DEV_ANY ? 1 : 0) + (r->minor != SHIM_DEV_ANY ? 1 : 0);
        int end = k + len;
        if (r->type) {
            prog[k] = JNE_IMM(BPF_REG_2, r->type, end - k - 1);
            k++;
        }
        if ((r->access & ACC_ALL) != ACC_ALL) {
            prog[k++] = MOV32_REG(BPF_REG_1, BPF_REG_3);
            prog[k++] = ALU32_IMM(BPF_AND, BPF_REG_1, ~r->access & ACC_ALL);
            prog[k] = JNE_IMM(BPF_REG_1, 0, end - k - 1);
            k++;
        }
        if (r->major != SHIM_DEV_ANY) {
            prog[k] = JNE_IMM(BPF_REG_4, r->major, end - k - 1);
            k++;
        }
        if (r->minor != SHIM_DEV_ANY) {
            prog[k] = JNE_IMM(BPF_REG_5, r->minor, end - k - 1);
            k++;
        }
        prog[k++] = MOV64_IMM(BPF_REG_0, 1);
        prog[k++] = EXIT();
    }
    prog[k++] = MOV64_IMM(BPF_REG_0, 0);
    prog[k++] = EXIT();
    return k;
}

int shim_devices_attach(int cgroup_fd, const struct shim_dev_rule *rules, int nrules,
                        char *log, int logcap)
{
    struct bpf_insn prog[MAX_INSNS]; /* 28 KiB at most */
    if (nrules < 0 || nrules > SHIM_DEV_MAX_RULES)
        return -E2BIG;
    int n = build(rules, nrules, prog);
    if (n < 0)
        return n;
    union bpf_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.prog_type = BPF_PROG_TYPE_CGROUP_DEVICE;
    attr.insns = (unsigned long)prog;
    attr.insn_cnt = (unsigned int)n;
    attr.license = (unsigned long)"GPL";
    if (log && logcap > 0)
        log[0] = 0;
    int fd = (int)sys_bpf(BPF_PROG_LOAD, &attr);
    if (fd < 0 && errno == EINVAL && log && logcap > 0) {
        /* Again, with a log, only for the verifier's words (a log buffer
         * needs log_level > 0, and costs the load's time). */
        int e = errno;
        attr.log_buf = (unsigned long)log;
        attr.log_size = (unsigned int)logcap;
        attr.log_level = 1;
        int again = (int)sys_bpf(BPF_PROG_LOAD, &attr);
        if (again >= 0)
            close(again);
        errno = e;
    }
    if (fd < 0)
        return -errno;
    memset(&attr, 0, sizeof attr);
    attr.target_fd = (unsigned int)cgroup_fd;
    attr.attach_bpf_fd = (unsigned int)fd;
    attr.attach_type = BPF_CGROUP_DEVICE;
    attr.attach_flags = BPF_F_ALLOW_MULTI;
    int r = (int)sys_bpf(BPF_PROG_ATTACH, &attr) < 0 ? -errno : 0;
    close(fd);
    return r;
}

int shim_devices_count(int cgroup_fd)
{
    union bpf_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.query.target_fd = (unsigned int)cgroup_fd;
    attr.query.attach_type = BPF_CGROUP_DEVICE;
    attr.query.prog_ids = 0;
    attr.query.prog_cnt = 0;
    if (sys_bpf(BPF_PROG_QUERY, &attr) < 0)
        return -errno;
    return (int)attr.query.prog_cnt;
}

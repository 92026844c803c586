"""The netlink wire format the starter speaks itself (pure, a leaf).

Three users speak netlink without a library: rtnl (a job's veth, addresses
and routes), nftwire (a job's counters and set elements in one nf_tables
transaction; one named counter asked of the kernel: sent by nft) and
conntrack.forget (dump and delete a job's flows).  All build and walk
the same two structures:

    message    nlmsghdr: u32 length, u16 type, u16 flags, u32 seq, u32 pid,
               then the body; messages are padded to 4 bytes
    attribute  nlattr: u16 length, u16 type, then the payload; padded to 4
               bytes; the top two type bits are flags (nested, byte order)
"""

import struct

HEADER = 16  # sizeof(struct nlmsghdr)
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK = 0x1, 0x2, 0x4
NLM_F_DUMP, NLM_F_EXCL, NLM_F_CREATE = 0x300, 0x200, 0x400
NLA_F_NESTED = 0x8000


def message(mtype, flags, seq, body):
    """One netlink message: header + body."""
    return struct.pack("=IHHII", HEADER + len(body), mtype, flags, seq, 0) + body


def messages(data):
    """-> (type, seq, body) of each whole message in data, as read from the socket."""
    off = 0
    while off + HEADER <= len(data):
        length, mtype, _flags, seq, _pid = struct.unpack_from("=IHHII", data, off)
        if length < HEADER:
            break
        yield mtype, seq, data[off + HEADER:off + length]
        off += (length + 3) & ~3


def attr(kind, payload):
    """One attribute, padded."""
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def attrs(buf):
    """-> (type without its flag bits, payload, the attribute as sent, padded)
    of each attribute in buf."""
    off = 0
    while off + 4 <= len(buf):
        n, kind = struct.unpack_from("=HH", buf, off)
        if n < 4:
            break
        padded = (n + 3) & ~3
        yield kind & 0x3FFF, buf[off + 4:off + n], buf[off:off + n].ljust(padded, b"\0")
        off += padded


def error_code(body):
    """The (negative) errno of an NLMSG_ERROR message's body; 0 is an ack."""
    return struct.unpack_from("=i", body)[0]


def collect(sock, first, count, ack=True):
    """Read the kernel's answers to `count` requests numbered first.. on
    sock -> [(replies, error)] per request: the messages (type, body)
    answering it and the errno of its NLMSG_ERROR (negative; 0: acked).

    ack: each request asked for an ack (NLM_F_ACK), which ends its answer;
    else its first message does (a get's reply, or an error).  An error
    about a message outside the range (a batch's begin or end: the batch as
    a whole) raises OSError; other stray messages are skipped."""
    import errno

    replies = [[] for _ in range(count)]
    errors = [0] * count
    done = 0
    while done < count:
        for mtype, seq, body in messages(sock.recv(1 << 16)):
            i = seq - first
            if not 0 <= i < count:
                if mtype == NLMSG_ERROR and error_code(body):
                    err = -error_code(body)
                    raise OSError(err, f"netlink: {errno.errorcode.get(err, err)}")
                continue
            if mtype == NLMSG_ERROR:
                errors[i] = error_code(body)
                done += 1
            else:
                replies[i].append((mtype, body))
                if not ack and len(replies[i]) == 1:
                    done += 1
    return list(zip(replies, errors))

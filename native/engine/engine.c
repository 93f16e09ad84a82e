/*
 * irdmafs._engine: the data plane of the socket transports in native threads, the GIL released.
 *
 * docs/engine.md gives the design and the invariants; transport/engine.py is its Python side
 * and transport/tcp.py (the Python transport) the reference it is tested against, bit for bit.
 *
 * What it owns:
 * - the region table (rkey -> base, length, access, generation, operations in flight), shared
 *   with Python, which adds and frees regions; a region's memory is held (a Py_buffer) until
 *   its free *and* the end of every operation that was using it: no byte moves from or into a
 *   region after both, and a key is never drawn twice by one process (transport/base.py), so a
 *   stale key can never reach a region it did not name;
 * - connections handed over by Python after its handshake (a socket fd). One I/O thread per
 *   engine (epoll) serves and lands every frame:
 *     serving side: READ answered from the region (sendmsg of the header and a pointer into the
 *       region, no copy), WRITE and WRITE_IMM received straight into it, each after its key,
 *       access and bounds are checked; a CALL's document and a WRITE_IMM's notification reach
 *       Python as events; Python's answers leave through the connection's output queue;
 *     calling side: Python posts READ, WRITE, WRITE_IMM and CALL frames with their buffers
 *       (held as Py_buffers until the operation is over); a READ's answer is received straight
 *       into the caller's buffer;
 * - the event queue: completions and requests for Python, many per wake-up of one eventfd.
 *
 * Threads and the GIL: the I/O thread never touches a Python object. Py_buffers are taken
 * and released only in functions Python calls (with the GIL): an operation's buffers are let go
 * when Python takes its completion (poll), a freed region's when its last operation ended.
 *
 * Rules the I/O thread keeps:
 * - every field of every frame is checked before use (frame.c; lengths against the regions and
 *   the caller's buffers, offsets with overflow checked); a frame that breaks the protocol
 *   closes its connection only, with the reason as an event Python logs;
 * - one connection's frames are served in arrival order and its answers leave in that order,
 *   but for a probe's (a CALL with imm = IRDM_CALL_PROBE, transport/probes.py): while Python's
 *   published status is valid it is the answer, queued ahead of every answer not yet begun,
 *   and the probe's document goes to Python after it (EV_PROBED);
 *   a READ's bytes are copied by the kernel when its turn to send comes, so a READ of a header,
 *   the data and the header again reads them in that order (the seqlock, regions.py);
 * - a peer that stops reading costs only its own connection: sockets are non-blocking, and a
 *   connection whose queued answers pass OUT_LIMIT is not read from until they drain;
 * - buffered call documents count against BUFFER_BUDGET; past it no connection begins a new
 *   frame until Python takes them (a document begun is read to its end).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "frame.h"

#define ACCESS_READ 1
#define ACCESS_WRITE 2
#define BUCKETS 4096            /* region table hash buckets (chained) */
#define IBUF (64 << 10)         /* a connection's input buffer: many small frames per recv */
#define OUT_LIMIT (8 << 20)     /* queued answer bytes past which a connection is not read */
#define BUFFER_BUDGET (64 << 20) /* call documents waiting for Python, all connections */
#define MAX_IOV 64
#define SCRATCH (1 << 20)

/* ---------------------------------------------------------------------------------------------
 * region table
 */
struct region {
    uint32_t rkey;
    uint64_t gen;
    uint8_t *base;
    uint64_t len;
    int access;
    int dead;          /* freed by Python: no new operation finds it */
    uint64_t inflight; /* operations using its memory now (I/O thread) */
    Py_buffer view;    /* holds the memory; released with the GIL */
    struct region *next;   /* hash chain */
    struct region *zombie; /* on the engine's release list */
};

/* ---------------------------------------------------------------------------------------------
 * calling-side operations and output chunks
 */
struct op {
    uint64_t req_id;
    int opcode;
    int nbuf;
    Py_buffer *bufs;    /* READ: where the answer lands; WRITE, WRITE_IMM, CALL: the payload */
    uint64_t total;     /* bytes of bufs */
    int refs;           /* the pending table's + each output chunk's */
    int abandoned;      /* Python gave up: an answer is drained, never landed */
    int receiving;      /* its answer is arriving into bufs now */
    int status;         /* the answer's status; -1: the connection broke first */
    uint8_t *payload;   /* an answer's document or error text (malloc) */
    uint64_t payload_len;
    struct op *next;    /* pending table chain */
};

enum { BODY_NONE, BODY_OWNED, BODY_REGION, BODY_OP };

struct chunk {
    struct chunk *next;
    uint8_t hdr[IRDM_HEADER];
    size_t hdr_len;     /* 0 or IRDM_HEADER */
    const uint8_t *body;
    size_t body_len;
    size_t sent;        /* of hdr_len + body_len */
    int kind;
    uint8_t *owned;
    struct region *region;
    struct op *op;
};

/* ---------------------------------------------------------------------------------------------
 * connections
 */
enum { IN_HDR, IN_REGION, IN_DOC, IN_DRAIN, IN_LAND };
enum { SERVE = 1, CALLER = 2 };
#define PENDING_BUCKETS 256

struct conn {
    uint64_t id;
    int fd;
    int role;
    int notify;            /* serving: WRITE_IMM notifications wanted */
    pthread_mutex_t lock;  /* out queue, pending table, flags Python sets */
    /* input: the I/O thread only */
    uint8_t *ibuf;
    size_t ipos, ilen;
    int in_state;
    struct irdm_frame cur;
    struct region *cur_region;
    uint8_t *dst;
    uint64_t left;
    uint8_t *doc;
    uint64_t doc_len, doc_got;
    struct op *cur_op;
    int land_iov;
    uint64_t land_off;
    int refuse_after;      /* after a drain: refuse the frame with this status */
    const char *refuse_why;
    char refuse_buf[160];
    /* output (lock) */
    struct chunk *out_head, *out_tail;
    atomic_uint_fast64_t out_bytes; /* written under lock, read by the I/O thread without it */
    /* calling side (lock) */
    struct op *pending[PENDING_BUCKETS];
    uint64_t npending;
    /* state */
    int closing;           /* Python asked to close (lock) */
    int kick;              /* Python queued something for it (lock) */
    int dead;              /* the I/O thread closed it */
    uint32_t events;       /* the epoll interest now (0 is one too: paused with nothing to send) */
    int registered;        /* added to epoll (the I/O thread only) */
    atomic_llong heard_ns; /* CLOCK_MONOTONIC when a frame last began to arrive (0: never) */
    int lowat;             /* its SO_RCVLOWAT now (0: the kernel's default, 1) */
    struct conn *next;     /* the engine's list */
    char why[256];
};

/* ---------------------------------------------------------------------------------------------
 * events for Python
 */
enum { EV_CALL = 1, EV_DONE = 2, EV_CLOSED = 3, EV_RELEASED = 4, EV_LOG = 5, EV_PROBED = 6 };

struct event {
    struct event *next;
    int kind;
    uint64_t conn;
    struct irdm_frame f; /* EV_CALL: the request's header */
    uint8_t *payload;    /* EV_CALL: the document; EV_CLOSED: the reason (malloc) */
    uint64_t payload_len;
    struct op *op;       /* EV_DONE */
    uint32_t rkey;       /* EV_RELEASED */
};

typedef struct {
    PyObject_HEAD
    pthread_mutex_t tab_lock;
    struct region *buckets[BUCKETS];
    struct region *zombies;  /* freed with operations in flight: released when they end */
    uint64_t regions;
    uint64_t pinned;         /* freed, but held by operations in flight */
    pthread_mutex_t conn_lock;
    struct conn *conns;
    uint64_t next_conn;
    pthread_mutex_t ev_lock;
    struct event *ev_head, *ev_tail;
    int ev_fd;      /* Python waits on it */
    int wake_fd;    /* the I/O thread waits on it (with the sockets) */
    int ep;
    pthread_t thread;
    int running;
    atomic_int stop;
    atomic_int kick_all;   /* every connection looked at again (buffered documents taken) */
    atomic_uint_fast64_t buffered;  /* call documents waiting for Python */
    atomic_uint_fast64_t served[4][2]; /* read, write, write_imm, refused: count, bytes */
    atomic_uint_fast64_t landed[2];    /* calling side: READ answers landed: count, bytes */
    uint8_t *scratch;
    pid_t pid;      /* the process whose I/O thread this is: a forked child has none */
    pthread_mutex_t st_lock; /* the published status (probes.py) */
    uint8_t *status;
    size_t status_len;
    long long status_until_ns; /* CLOCK_MONOTONIC: past it the copy answers no probe */
    atomic_uint_fast64_t probes; /* probes answered from it */
} Engine;

enum { S_READ, S_WRITE, S_WRITE_IMM, S_REFUSED };

/* ---------------------------------------------------------------------------------------------
 * region table (tab_lock)
 */
static struct region **bucket_of(Engine *e, uint32_t rkey) { return &e->buckets[(rkey * 2654435761u) >> 20 & (BUCKETS - 1)]; }

static struct region *find_locked(Engine *e, uint32_t rkey) {
    for (struct region *r = *bucket_of(e, rkey); r; r = r->next)
        if (r->rkey == rkey) return r;
    return NULL;
}

/* The region for an operation of `access` on [offset, offset+length), its in-flight count
 * taken; NULL with *why set if it refuses. */
static struct region *take_region(Engine *e, uint32_t rkey, uint64_t offset, uint64_t length, int access, char *why, size_t whylen) {
    pthread_mutex_lock(&e->tab_lock);
    struct region *r = find_locked(e, rkey);
    if (!r) {
        snprintf(why, whylen, "unknown rkey %u", rkey);
    } else if (!(r->access & access)) {
        snprintf(why, whylen, "rkey %u does not allow %s", rkey, access == ACCESS_READ ? "READ" : "WRITE");
        r = NULL;
    } else if (offset > r->len || length > r->len - offset) {
        snprintf(why, whylen, "range %llu+%llu outside rkey %u of %llu bytes", (unsigned long long)offset,
                 (unsigned long long)length, rkey, (unsigned long long)r->len);
        r = NULL;
    } else {
        r->inflight++;
    }
    pthread_mutex_unlock(&e->tab_lock);
    return r;
}

static void push_event(Engine *e, struct event *ev);

static void put_region(Engine *e, struct region *r) {
    int release = 0;
    pthread_mutex_lock(&e->tab_lock);
    if (--r->inflight == 0 && r->dead) {
        release = 1;
        e->pinned--;
    }
    pthread_mutex_unlock(&e->tab_lock);
    if (release) { /* its Py_buffer goes back with the GIL: Python's poll */
        struct event *ev = calloc(1, sizeof *ev);
        if (!ev) abort(); /* cannot lose a release: memory would leak pinned */
        ev->kind = EV_RELEASED;
        ev->rkey = r->rkey;
        pthread_mutex_lock(&e->tab_lock);
        r->zombie = e->zombies;
        e->zombies = r;
        pthread_mutex_unlock(&e->tab_lock);
        push_event(e, ev);
    }
}

/* ---------------------------------------------------------------------------------------------
 * events (ev_lock)
 */
static void push_event(Engine *e, struct event *ev) {
    pthread_mutex_lock(&e->ev_lock);
    int was_empty = e->ev_head == NULL;
    if (e->ev_tail) e->ev_tail->next = ev; else e->ev_head = ev;
    e->ev_tail = ev;
    pthread_mutex_unlock(&e->ev_lock);
    if (was_empty) {
        uint64_t one = 1;
        ssize_t n = write(e->ev_fd, &one, sizeof one);
        (void)n; /* EAGAIN only when the counter is full: Python is woken anyway */
    }
}

static void wake(Engine *e) {
    uint64_t one = 1;
    ssize_t n = write(e->wake_fd, &one, sizeof one);
    (void)n;
}

/* A line for the node's log (a refused request): Python logs it with the peer's name. */
static void log_event(Engine *e, struct conn *c, const char *fmt, const char *why) {
    struct event *ev = calloc(1, sizeof *ev);
    char line[256];
    if (!ev) return; /* a log line may be lost under memory pressure; nothing else is */
    int n = snprintf(line, sizeof line, fmt, why);
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof line) n = sizeof line - 1;
    ev->kind = EV_LOG;
    ev->conn = c->id;
    ev->payload = malloc((size_t)n + 1);
    if (ev->payload) {
        memcpy(ev->payload, line, (size_t)n + 1);
        ev->payload_len = (uint64_t)n;
    }
    push_event(e, ev);
}

/* ---------------------------------------------------------------------------------------------
 * output
 */
static void queue_chunk(struct conn *c, struct chunk *k) {
    if (c->out_tail) c->out_tail->next = k; else c->out_head = k;
    c->out_tail = k;
    c->out_bytes += k->hdr_len + k->body_len;
}

static struct chunk *new_chunk(const struct irdm_frame *f) {
    struct chunk *k = calloc(1, sizeof *k);
    if (!k) return NULL;
    if (f) {
        irdm_pack(k->hdr, f);
        k->hdr_len = IRDM_HEADER;
    }
    return k;
}

static void op_put(Engine *e, struct conn *c, struct op *op);

static void free_chunk(Engine *e, struct conn *c, struct chunk *k) {
    if (k->kind == BODY_OWNED) free(k->owned);
    else if (k->kind == BODY_REGION) put_region(e, k->region);
    else if (k->kind == BODY_OP) op_put(e, c, k->op);
    free(k);
}

/* The I/O thread's answer to a request (serving side): header, and a copy of `msg`. */
static int answer(struct conn *c, const struct irdm_frame *req, int status, const void *msg, size_t len) {
    struct irdm_frame f = *req;
    f.opcode = (uint8_t)(req->opcode | IRDM_RESPONSE);
    f.status = (uint16_t)status;
    f.length = len;
    struct chunk *k = new_chunk(&f);
    if (!k) return -1;
    if (len) {
        k->owned = malloc(len);
        if (!k->owned) { free(k); return -1; }
        memcpy(k->owned, msg, len);
        k->kind = BODY_OWNED;
        k->body = k->owned;
        k->body_len = len;
    }
    pthread_mutex_lock(&c->lock);
    queue_chunk(c, k);
    pthread_mutex_unlock(&c->lock);
    return 0;
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* A probe answered with the published status if it is valid now: queued ahead of every answer
 * not yet begun (one half sent stays first). 1 answered, 0 not (no valid copy), -1 no memory. */
static int answer_probe(Engine *e, struct conn *c, const struct irdm_frame *req) {
    struct irdm_frame f = *req;
    f.opcode = (uint8_t)(req->opcode | IRDM_RESPONSE);
    f.status = IRDM_OK;
    f.imm = 0;
    struct chunk *k = NULL;
    pthread_mutex_lock(&e->st_lock);
    if (e->status && now_ns() < e->status_until_ns) {
        f.length = e->status_len;
        k = new_chunk(&f);
        if (k) {
            k->owned = malloc(e->status_len ? e->status_len : 1);
            if (k->owned) {
                memcpy(k->owned, e->status, e->status_len);
            } else {
                free(k);
                k = NULL;
            }
        }
        if (!k) {
            pthread_mutex_unlock(&e->st_lock);
            return -1;
        }
    }
    pthread_mutex_unlock(&e->st_lock);
    if (!k) return 0;
    k->kind = BODY_OWNED;
    k->body = k->owned;
    k->body_len = f.length;
    pthread_mutex_lock(&c->lock);
    struct chunk *head = c->out_head;
    if (!head) {
        queue_chunk(c, k);
    } else {
        struct chunk **at = head->sent ? &head->next : &c->out_head;
        k->next = *at;
        *at = k;
        if (!k->next) c->out_tail = k;
        c->out_bytes += k->hdr_len + k->body_len;
    }
    pthread_mutex_unlock(&c->lock);
    atomic_fetch_add(&e->probes, 1);
    return 1;
}

/* Send what is queued, as far as the socket takes it. 0, or -1 with c->why (the socket broke). */
static int flush_out(Engine *e, struct conn *c) {
    for (;;) {
        struct iovec iov[MAX_IOV];
        int n = 0;
        pthread_mutex_lock(&c->lock);
        for (struct chunk *k = c->out_head; k && n < MAX_IOV - 1; k = k->next) {
            size_t s = k->sent;
            if (s < k->hdr_len) {
                iov[n].iov_base = k->hdr + s;
                iov[n++].iov_len = k->hdr_len - s;
                s = k->hdr_len;
            }
            if (k->body_len && s - k->hdr_len < k->body_len) {
                iov[n].iov_base = (void *)(k->body + (s - k->hdr_len));
                iov[n++].iov_len = k->body_len - (s - k->hdr_len);
            }
        }
        pthread_mutex_unlock(&c->lock);
        if (!n) return 0;
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t got = sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            if (errno == EINTR) continue;
            snprintf(c->why, sizeof c->why, "connection lost: %s", strerror(errno));
            return -1;
        }
        /* retire what went */
        size_t left = (size_t)got;
        struct chunk *done = NULL, **tail = &done;
        pthread_mutex_lock(&c->lock);
        while (left && c->out_head) {
            struct chunk *k = c->out_head;
            size_t rest = k->hdr_len + k->body_len - k->sent;
            if (left >= rest) {
                left -= rest;
                c->out_bytes -= rest;
                c->out_head = k->next;
                if (!c->out_head) c->out_tail = NULL;
                k->next = NULL;
                *tail = k;
                tail = &k->next;
            } else {
                k->sent += left;
                c->out_bytes -= left;
                left = 0;
            }
        }
        pthread_mutex_unlock(&c->lock);
        while (done) {
            struct chunk *k = done;
            done = k->next;
            free_chunk(e, c, k);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * calling side: pending operations (c->lock)
 */
static struct op **pending_of(struct conn *c, uint64_t req_id) { return &c->pending[req_id % PENDING_BUCKETS]; }

static struct op *pending_take(struct conn *c, uint64_t req_id) {
    for (struct op **p = pending_of(c, req_id); *p; p = &(*p)->next) {
        if ((*p)->req_id == req_id) {
            struct op *op = *p;
            *p = op->next;
            op->next = NULL;
            c->npending--;
            return op;
        }
    }
    return NULL;
}

static struct op *pending_find(struct conn *c, uint64_t req_id) {
    for (struct op *op = *pending_of(c, req_id); op; op = op->next)
        if (op->req_id == req_id) return op;
    return NULL;
}

/* One reference to op dropped; at the last, its completion goes to Python (which lets its
 * buffers go). Called with c->lock not held. */
static void op_put(Engine *e, struct conn *c, struct op *op) {
    pthread_mutex_lock(&c->lock);
    int last = --op->refs == 0;
    pthread_mutex_unlock(&c->lock);
    if (!last) return;
    struct event *ev = calloc(1, sizeof *ev);
    if (!ev) abort(); /* a completion cannot be lost: the caller's buffers would stay held */
    ev->kind = EV_DONE;
    ev->conn = c->id;
    ev->op = op;
    push_event(e, ev);
}

/* ---------------------------------------------------------------------------------------------
 * closing
 */
static void close_conn(Engine *e, struct conn *c, const char *why) {
    if (c->dead) return;
    epoll_ctl(e->ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    /* the frame being received: its region or document let go */
    if (c->in_state == IN_REGION && c->cur_region) put_region(e, c->cur_region);
    c->cur_region = NULL;
    if (c->doc) {
        free(c->doc);
        uint64_t before = atomic_fetch_sub(&e->buffered, c->doc_len);
        c->doc = NULL;
        if (before > BUFFER_BUDGET && before - c->doc_len <= BUFFER_BUDGET) { /* the paused may read again */
            atomic_store(&e->kick_all, 1);
            wake(e);
        }
    }
    struct op *landing = c->cur_op;
    c->cur_op = NULL;
    /* unsent output and every pending operation: over, with the connection */
    pthread_mutex_lock(&c->lock);
    c->dead = 1; /* from here Python posts nothing more on it */
    c->fd = -1;
    struct chunk *out = c->out_head;
    c->out_head = c->out_tail = NULL;
    c->out_bytes = 0;
    struct op *ops = NULL;
    for (int b = 0; b < PENDING_BUCKETS; b++) {
        while (c->pending[b]) {
            struct op *op = c->pending[b];
            c->pending[b] = op->next;
            op->next = ops;
            ops = op;
        }
    }
    c->npending = 0;
    pthread_mutex_unlock(&c->lock);
    while (out) {
        struct chunk *k = out;
        out = k->next;
        free_chunk(e, c, k);
    }
    if (landing) { /* taken out of the table when its answer began */
        landing->status = -1;
        op_put(e, c, landing);
    }
    while (ops) {
        struct op *op = ops;
        ops = op->next;
        op->next = NULL;
        op->status = -1;
        op_put(e, c, op);
    }
    struct event *ev = calloc(1, sizeof *ev);
    if (!ev) abort();
    ev->kind = EV_CLOSED;
    ev->conn = c->id;
    size_t n = strlen(why);
    ev->payload = malloc(n + 1);
    if (ev->payload) {
        memcpy(ev->payload, why, n + 1);
        ev->payload_len = n;
    }
    push_event(e, ev);
}

/* ---------------------------------------------------------------------------------------------
 * input
 */

/* Bytes for the current payload: from the input buffer first, then the socket. Returns the
 * count (> 0), 0 for EAGAIN, -1 with c->why on EOF or an error. */
static ssize_t take_in(struct conn *c, void *dst, size_t want) {
    if (c->ipos < c->ilen) {
        size_t n = c->ilen - c->ipos;
        if (n > want) n = want;
        memcpy(dst, c->ibuf + c->ipos, n);
        c->ipos += n;
        return (ssize_t)n;
    }
    for (;;) {
        ssize_t n = recv(c->fd, dst, want, MSG_DONTWAIT);
        if (n > 0) return n;
        if (n == 0) {
            snprintf(c->why, sizeof c->why, "connection closed mid-frame");
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        snprintf(c->why, sizeof c->why, "connection lost: %s", strerror(errno));
        return -1;
    }
}

/* The same into the calling-side op's scatter list. */
static ssize_t take_in_iov(struct conn *c, struct op *op) {
    struct iovec iov[MAX_IOV];
    int n = 0;
    uint64_t off = c->land_off;
    for (int i = c->land_iov; i < op->nbuf && n < MAX_IOV; i++) {
        uint64_t len = (uint64_t)op->bufs[i].len;
        if (off >= len) { off = 0; continue; }
        iov[n].iov_base = (uint8_t *)op->bufs[i].buf + off;
        iov[n++].iov_len = len - off;
        off = 0;
    }
    if (!n) return 0;
    ssize_t got;
    if (c->ipos < c->ilen) {
        got = take_in(c, iov[0].iov_base, iov[0].iov_len);
    } else {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        for (;;) {
            got = recvmsg(c->fd, &m, MSG_DONTWAIT);
            if (got >= 0 || errno != EINTR) break;
        }
        if (got == 0) {
            snprintf(c->why, sizeof c->why, "connection closed mid-frame");
            return -1;
        }
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            snprintf(c->why, sizeof c->why, "connection lost: %s", strerror(errno));
            return -1;
        }
    }
    /* advance the position */
    uint64_t adv = (uint64_t)got;
    while (adv && c->land_iov < op->nbuf) {
        uint64_t room = (uint64_t)op->bufs[c->land_iov].len - c->land_off;
        if (adv >= room) {
            adv -= room;
            c->land_iov++;
            c->land_off = 0;
        } else {
            c->land_off += adv;
            adv = 0;
        }
    }
    while (c->land_iov < op->nbuf && (uint64_t)op->bufs[c->land_iov].len == 0) c->land_iov++;
    return got;
}

static void start_drain(struct conn *c, uint64_t n, int refuse_status) {
    c->left = n;
    c->in_state = IN_DRAIN;
    c->refuse_after = refuse_status;
}

/* A serving-side request header: decide what its payload is for. 0, or -1 to close. */
static int serve_header(Engine *e, struct conn *c) {
    struct irdm_frame *f = &c->cur;
    char why[160];
    switch (f->opcode) {
    case IRDM_READ: {
        struct region *r = take_region(e, f->rkey, f->offset, f->length, ACCESS_READ, why, sizeof why);
        if (!r) {
            atomic_fetch_add(&e->served[S_REFUSED][0], 1);
            log_event(e, c, "READ refused: %s", why);
            return answer(c, f, IRDM_ST_ACCESS, why, strlen(why));
        }
        struct irdm_frame resp = *f;
        resp.opcode = IRDM_READ | IRDM_RESPONSE;
        resp.status = IRDM_OK;
        struct chunk *k = new_chunk(&resp);
        if (!k) { put_region(e, r); return -1; }
        k->kind = BODY_REGION;
        k->region = r;
        k->body = r->base + f->offset;
        k->body_len = f->length;
        pthread_mutex_lock(&c->lock);
        queue_chunk(c, k);
        pthread_mutex_unlock(&c->lock);
        atomic_fetch_add(&e->served[S_READ][0], 1);
        atomic_fetch_add(&e->served[S_READ][1], f->length);
        return 0;
    }
    case IRDM_WRITE:
    case IRDM_WRITE_IMM: {
        struct region *r = take_region(e, f->rkey, f->offset, f->length, ACCESS_WRITE, why, sizeof why);
        if (!r) {
            snprintf(c->refuse_buf, sizeof c->refuse_buf, "%s", why);
            c->refuse_why = c->refuse_buf;
            atomic_fetch_add(&e->served[S_REFUSED][0], 1);
            log_event(e, c, "WRITE refused: %s", why);
            start_drain(c, f->length, IRDM_ST_ACCESS);
            return 0;
        }
        c->cur_region = r;
        c->dst = r->base + f->offset;
        c->left = f->length;
        c->in_state = IN_REGION;
        return 0;
    }
    case IRDM_CALL: {
        uint64_t n = f->length; /* <= IRDM_MAX_CONTROL: frame.c */
        c->doc = malloc(n ? n : 1);
        if (!c->doc) return -1;
        c->doc_len = n;
        c->doc_got = 0;
        atomic_fetch_add(&e->buffered, n);
        c->in_state = IN_DOC;
        return 0;
    }
    default:
        snprintf(c->refuse_buf, sizeof c->refuse_buf, "unknown opcode %#x", f->opcode);
        c->refuse_why = c->refuse_buf;
        log_event(e, c, "%s refused", c->refuse_buf);
        start_drain(c, irdm_payload_size(f), IRDM_ST_BAD_REQUEST);
        return 0;
    }
}

/* A calling-side answer header. 0, or -1 to close (c->why set). */
static int caller_header(Engine *e, struct conn *c) {
    struct irdm_frame *f = &c->cur;
    uint64_t size = irdm_payload_size(f);
    if (!(f->opcode & IRDM_RESPONSE)) {
        snprintf(c->why, sizeof c->why, "protocol error: a request (opcode %#x) sent to the calling side", f->opcode);
        return -1;
    }
    pthread_mutex_lock(&c->lock);
    struct op *op = pending_take(c, f->req_id);
    if (op && !op->abandoned && f->status == IRDM_OK && op->opcode == IRDM_READ) op->receiving = 1;
    pthread_mutex_unlock(&c->lock);
    if (!op) { /* not ours (a peer bug): skipped */
        start_drain(c, size, -1);
        return 0;
    }
    if ((f->opcode & ~IRDM_RESPONSE) != op->opcode) {
        snprintf(c->why, sizeof c->why, "protocol error: answer of opcode %#x to a request of opcode %#x", f->opcode, op->opcode);
        op->status = -1;
        op_put(e, c, op);
        return -1;
    }
    op->status = f->status;
    c->cur_op = op;
    if (f->status == IRDM_OK && op->opcode == IRDM_READ) {
        if (size != op->total) {
            snprintf(c->why, sizeof c->why, "protocol error: READ answered with %llu bytes, %llu asked",
                     (unsigned long long)size, (unsigned long long)op->total);
            return -1;
        }
        if (op->abandoned) {
            start_drain(c, size, -1);
            return 0;
        }
        c->land_iov = 0;
        c->land_off = 0;
        c->left = size;
        c->in_state = IN_LAND;
        return 0;
    }
    /* a document, an error's text or nothing: kept for Python, at most a control document's
     * size (frame.c lets an OK WRITE answer claim up to 1 GiB: a hostile node must not make a
     * client allocate that) */
    if (size > IRDM_MAX_CONTROL) {
        snprintf(c->why, sizeof c->why, "protocol error: an answer of %llu bytes to opcode %#x", (unsigned long long)size, op->opcode);
        return -1;
    }
    op->payload = malloc(size ? size : 1);
    if (!op->payload) return -1;
    op->payload_len = size;
    c->doc_got = 0;
    c->left = size;
    c->in_state = IN_DOC;
    return 0;
}

static void finish_op(Engine *e, struct conn *c) {
    struct op *op = c->cur_op;
    c->cur_op = NULL;
    if (op) op_put(e, c, op);
}

/* A frame's payload all in: what follows it. 0, or -1 to close. */
static int frame_done(Engine *e, struct conn *c) {
    struct irdm_frame *f = &c->cur;
    c->in_state = IN_HDR;
    if (c->role == CALLER) {
        if (c->cur_op && c->cur_op->opcode == IRDM_READ && c->cur_op->status == IRDM_OK) {
            atomic_fetch_add(&e->landed[0], 1);
            atomic_fetch_add(&e->landed[1], f->length);
        }
        finish_op(e, c);
        return 0;
    }
    if (c->refuse_after >= 0 && c->refuse_why) { /* a drained, refused request */
        int st = c->refuse_after;
        const char *why = c->refuse_why;
        c->refuse_after = -1;
        c->refuse_why = NULL;
        return answer(c, f, st, why, strlen(why));
    }
    if (f->opcode == IRDM_WRITE || f->opcode == IRDM_WRITE_IMM) {
        struct region *r = c->cur_region;
        c->cur_region = NULL;
        int imm = f->opcode == IRDM_WRITE_IMM;
        atomic_fetch_add(&e->served[imm ? S_WRITE_IMM : S_WRITE][0], 1);
        atomic_fetch_add(&e->served[imm ? S_WRITE_IMM : S_WRITE][1], f->length);
        put_region(e, r);
        if (!imm) return answer(c, f, IRDM_OK, NULL, 0);
        if (!c->notify) {
            static const char no[] = "this peer takes no notifications";
            return answer(c, f, IRDM_ST_BAD_REQUEST, no, sizeof no - 1);
        }
        struct event *ev = calloc(1, sizeof *ev);
        if (!ev) return -1;
        ev->kind = EV_CALL;
        ev->conn = c->id;
        ev->f = *f;
        push_event(e, ev);
        return 0;
    }
    if (f->opcode == IRDM_CALL) {
        int probed = 0;
        if (f->imm == IRDM_CALL_PROBE) {
            probed = answer_probe(e, c, f);
            if (probed < 0) return -1;
        }
        struct event *ev = calloc(1, sizeof *ev);
        if (!ev) return -1;
        ev->kind = probed ? EV_PROBED : EV_CALL;
        ev->conn = c->id;
        ev->f = *f;
        ev->payload = c->doc;
        ev->payload_len = c->doc_len;
        c->doc = NULL;
        push_event(e, ev);
    }
    return 0;
}

static int paused(Engine *e, struct conn *c);

/* Read what the socket has, frame by frame. 0, or -1 to close (c->why set). */
static int pump_frames(Engine *e, struct conn *c) {
    for (int rounds = 0; rounds < 256; rounds++) {
        if (paused(e, c)) return 0;
        ssize_t n;
        switch (c->in_state) {
        case IN_HDR: {
            if (c->ilen - c->ipos < IRDM_HEADER) {
                memmove(c->ibuf, c->ibuf + c->ipos, c->ilen - c->ipos);
                c->ilen -= c->ipos;
                c->ipos = 0;
                for (;;) {
                    n = recv(c->fd, c->ibuf + c->ilen, IBUF - c->ilen, MSG_DONTWAIT);
                    if (n >= 0 || errno != EINTR) break;
                }
                if (n == 0) {
                    snprintf(c->why, sizeof c->why, c->ilen ? "connection closed mid-frame" : "peer closed the connection");
                    return -1;
                }
                if (n < 0) {
                    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
                    snprintf(c->why, sizeof c->why, "connection lost: %s", strerror(errno));
                    return -1;
                }
                c->ilen += (size_t)n;
                if (c->ilen < IRDM_HEADER) continue;
            }
            int rc = irdm_parse(c->ibuf + c->ipos, IRDM_HEADER, &c->cur);
            if (rc != IRDM_PARSE_OK) {
                snprintf(c->why, sizeof c->why, "protocol error: %s", irdm_parse_error(rc));
                return -1;
            }
            c->ipos += IRDM_HEADER;
            c->refuse_after = -1;
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            atomic_store(&c->heard_ns, (long long)now.tv_sec * 1000000000LL + now.tv_nsec);
            if ((c->role == SERVE ? serve_header(e, c) : caller_header(e, c)) < 0) {
                if (!c->why[0]) snprintf(c->why, sizeof c->why, "out of memory");
                return -1;
            }
            if (c->in_state == IN_HDR) continue;
            if ((c->in_state == IN_REGION || c->in_state == IN_LAND || c->in_state == IN_DRAIN) && c->left == 0) {
                if (frame_done(e, c) < 0) return -1;
            } else if (c->in_state == IN_DOC && c->doc_got == (c->role == SERVE ? c->doc_len : c->cur_op->payload_len)) {
                if (frame_done(e, c) < 0) return -1;
            }
            continue;
        }
        case IN_REGION:
            n = take_in(c, c->dst, c->left);
            if (n <= 0) return (int)n;
            c->dst += n;
            c->left -= (uint64_t)n;
            break;
        case IN_LAND:
            n = take_in_iov(c, c->cur_op);
            if (n <= 0) return (int)n;
            c->left -= (uint64_t)n;
            break;
        case IN_DRAIN:
            n = take_in(c, e->scratch, c->left < SCRATCH ? c->left : SCRATCH);
            if (n <= 0) return (int)n;
            c->left -= (uint64_t)n;
            break;
        case IN_DOC: {
            uint8_t *buf = c->role == SERVE ? c->doc : c->cur_op->payload;
            uint64_t len = c->role == SERVE ? c->doc_len : c->cur_op->payload_len;
            n = take_in(c, buf + c->doc_got, len - c->doc_got);
            if (n <= 0) return (int)n;
            c->doc_got += (uint64_t)n;
            if (c->doc_got == len && frame_done(e, c) < 0) return -1;
            continue;
        }
        }
        if (c->left == 0 && frame_done(e, c) < 0) return -1;
    }
    return 0;
}

#define LOWAT_MIN (64 << 10)
#define LOWAT_MAX (2 << 20)

/* Wake this connection's thread only once min(left, LOWAT_MAX) bytes of a large payload wait
 * (SO_RCVLOWAT, which epoll honours for TCP): a payload arriving in 64 KB pieces otherwise costs
 * an epoll_wait and a recv each (tcp.py's _wake_at does the same for trio). Never more than what
 * is left of this payload, which the peer is sending; the kernel caps it at half its buffer. */
static void wake_at(struct conn *c) {
    int want = 1;
    if (c->in_state == IN_REGION || c->in_state == IN_LAND || c->in_state == IN_DRAIN) {
        uint64_t left = c->left;
        if (left >= LOWAT_MIN) want = left < LOWAT_MAX ? (int)left : LOWAT_MAX;
    }
    if (want != (c->lowat ? c->lowat : 1)) {
        if (setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) < 0) want = 1;
        c->lowat = want;
    }
}

static int pump_in(Engine *e, struct conn *c) {
    int rc = pump_frames(e, c);
    if (rc == 0 && !c->dead) wake_at(c);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * the I/O thread
 */
static int paused(Engine *e, struct conn *c);

static void set_interest(Engine *e, struct conn *c) {
    if (c->dead) return;
    pthread_mutex_lock(&c->lock);
    int out = c->out_head != NULL;
    int in = !paused(e, c);
    pthread_mutex_unlock(&c->lock);
    uint32_t want = (in ? EPOLLIN : 0) | (out ? EPOLLOUT : 0); /* EPOLLHUP, EPOLLERR: always */
    if (want != c->events) {
        struct epoll_event ev = {.events = want, .data.ptr = c};
        epoll_ctl(e->ep, EPOLL_CTL_MOD, c->fd, &ev);
        c->events = want;
    }
}

/* A serving connection is not read while its answers pass OUT_LIMIT, nor, between frames, while
 * the documents waiting for Python pass BUFFER_BUDGET. A document begun is always read to its
 * end: its length is counted from its header on, so holding it half read would hold every other
 * connection too (nothing reaches Python, nothing is taken, the budget never frees). */
static int paused(Engine *e, struct conn *c) {
    if (c->role != SERVE) return 0;
    return c->out_bytes > OUT_LIMIT || (c->in_state == IN_HDR && atomic_load(&e->buffered) > BUFFER_BUDGET);
}

static void service(Engine *e, struct conn *c, uint32_t happened) {
    if (c->dead) return;
    if (happened & (EPOLLHUP | EPOLLERR) && !(happened & EPOLLIN)) { /* nothing left to read: gone */
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        snprintf(c->why, sizeof c->why, "connection lost: %s", err ? strerror(err) : "hung up");
        close_conn(e, c, c->why);
        return;
    }
    if (happened & (EPOLLHUP | EPOLLERR) && paused(e, c)) { /* it would never be read again */
        close_conn(e, c, "connection lost: hung up while its answers were queued");
        return;
    }
    pthread_mutex_lock(&c->lock);
    int closing = c->closing;
    c->kick = 0;
    pthread_mutex_unlock(&c->lock);
    if (closing) {
        close_conn(e, c, "connection closed");
        return;
    }
    /* Bytes already in the input buffer never wake epoll again: go on while some wait and
     * the connection may read, a bounded number of times, then come back after the others. */
    for (int turn = 0;; turn++) {
        if (pump_in(e, c) < 0 || flush_out(e, c) < 0) {
            close_conn(e, c, c->why[0] ? c->why : "connection lost");
            return;
        }
        int waiting = c->ipos < c->ilen && (c->in_state != IN_HDR || c->ilen - c->ipos >= IRDM_HEADER);
        if (!waiting || paused(e, c)) break;
        if (turn == 8) {
            pthread_mutex_lock(&c->lock);
            c->kick = 1;
            pthread_mutex_unlock(&c->lock);
            wake(e);
            break;
        }
    }
    set_interest(e, c);
}

static void reap_dead(Engine *e) {
    pthread_mutex_lock(&e->conn_lock);
    for (struct conn **p = &e->conns; *p;) {
        struct conn *c = *p;
        if (c->dead) {
            *p = c->next;
            pthread_mutex_destroy(&c->lock);
            free(c->ibuf);
            free(c);
        } else {
            p = &c->next;
        }
    }
    pthread_mutex_unlock(&e->conn_lock);
}

static void *io_thread(void *arg) {
    Engine *e = arg;
    struct epoll_event evs[64];
    while (!atomic_load(&e->stop)) {
        int n = epoll_wait(e->ep, evs, 64, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        int woken = 0;
        for (int i = 0; i < n; i++) {
            if (evs[i].data.ptr == NULL) {
                uint64_t v;
                ssize_t r = read(e->wake_fd, &v, sizeof v);
                (void)r;
                woken = 1;
                continue;
            }
            service(e, evs[i].data.ptr, evs[i].events);
        }
        if (woken) { /* Python queued output, asked for a close, or took buffered documents */
            int all = atomic_exchange(&e->kick_all, 0);
            pthread_mutex_lock(&e->conn_lock);
            struct conn *list = e->conns;
            pthread_mutex_unlock(&e->conn_lock);
            for (struct conn *c = list; c; c = c->next) {
                if (c->dead) continue;
                if (!c->registered) { /* new: register it */
                    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
                    if (epoll_ctl(e->ep, EPOLL_CTL_ADD, c->fd, &ev) < 0) {
                        snprintf(c->why, sizeof c->why, "epoll: %s", strerror(errno));
                        close_conn(e, c, c->why);
                        continue;
                    }
                    c->events = EPOLLIN;
                    c->registered = 1;
                    service(e, c, 0);
                    continue;
                }
                pthread_mutex_lock(&c->lock);
                int kicked = c->kick || c->closing;
                pthread_mutex_unlock(&c->lock);
                if (kicked || all) service(e, c, 0);
            }
        }
        reap_dead(e);
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Python's side (the GIL held in every function below)
 */
static PyObject *EngineError;

static void release_op(struct op *op) {
    for (int i = 0; i < op->nbuf; i++) PyBuffer_Release(&op->bufs[i]);
    free(op->bufs);
    free(op->payload);
    free(op);
}

static int Engine_init(Engine *e, PyObject *args, PyObject *kw) {
    if (e->running) return 0;
    pthread_mutex_init(&e->tab_lock, NULL);
    pthread_mutex_init(&e->conn_lock, NULL);
    pthread_mutex_init(&e->ev_lock, NULL);
    pthread_mutex_init(&e->st_lock, NULL);
    e->ev_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    e->ep = epoll_create1(EPOLL_CLOEXEC);
    e->scratch = malloc(SCRATCH);
    e->next_conn = 1;
    e->pid = getpid();
    if (e->ev_fd < 0 || e->wake_fd < 0 || e->ep < 0 || !e->scratch) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(e->ep, EPOLL_CTL_ADD, e->wake_fd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    int rc = pthread_create(&e->thread, NULL, io_thread, e);
    if (rc) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    e->running = 1;
    return 0;
}

static struct conn *conn_locked(Engine *e, uint64_t id) {
    for (struct conn *c = e->conns; c; c = c->next)
        if (c->id == id) return c;
    return NULL;
}

static void release_zombies(Engine *e) {
    pthread_mutex_lock(&e->tab_lock);
    struct region *z = e->zombies;
    e->zombies = NULL;
    pthread_mutex_unlock(&e->tab_lock);
    while (z) {
        struct region *r = z;
        z = r->zombie;
        PyBuffer_Release(&r->view);
        free(r);
    }
}

static PyObject *Engine_stop(Engine *e, PyObject *unused) {
    if (!e->running) Py_RETURN_NONE;
    if (e->pid != getpid()) {
        /* A forked child (multiprocessing): the I/O thread, and whatever it held locked, stayed
         * in the parent. Nothing here is safe to join, lock or free; the child leaves it all
         * (its memory goes with the child) and never runs this engine. */
        e->running = 0;
        Py_RETURN_NONE;
    }
    e->running = 0; /* before the GIL is let go: a second stop or an adopt meanwhile is refused */
    atomic_store(&e->stop, 1);
    wake(e);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(e->thread, NULL);
    Py_END_ALLOW_THREADS
    /* every connection closed, every operation and event let go */
    for (struct conn *c = e->conns; c; c = c->next) close_conn(e, c, "engine stopped");
    reap_dead(e);
    struct event *ev = e->ev_head;
    e->ev_head = e->ev_tail = NULL;
    while (ev) {
        struct event *next = ev->next;
        if (ev->op) release_op(ev->op);
        free(ev->payload);
        free(ev);
        ev = next;
    }
    release_zombies(e);
    for (int b = 0; b < BUCKETS; b++) {
        while (e->buckets[b]) {
            struct region *r = e->buckets[b];
            e->buckets[b] = r->next;
            PyBuffer_Release(&r->view);
            free(r);
        }
    }
    close(e->ep);
    close(e->wake_fd);
    close(e->ev_fd);
    e->ep = e->wake_fd = e->ev_fd = -1; /* poll and fileno after a stop touch no reused fd */
    free(e->scratch);
    e->scratch = NULL;
    free(e->status);
    e->status = NULL;
    Py_RETURN_NONE;
}

static void Engine_dealloc(Engine *e) {
    PyObject *r = Engine_stop(e, NULL);
    Py_XDECREF(r);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

/* Every method but stop: a forked child must not take the parent thread's locks, before its
 * stop or after it (the pid, not `running`, says whose engine this is). */
static int forked(Engine *e) {
    if (e->pid && e->pid != getpid()) {
        PyErr_SetString(EngineError, "the engine belongs to the process that made it, not this forked child");
        return 1;
    }
    return 0;
}

static int check_running(Engine *e) {
    if (forked(e)) return -1;
    if (!e->running) {
        PyErr_SetString(EngineError, "the engine is stopped");
        return -1;
    }
    return 0;
}

/* add_region(rkey, gen, buffer, access): the engine serves `buffer` under `rkey`. */
static PyObject *Engine_add_region(Engine *e, PyObject *args) {
    unsigned int rkey;
    unsigned long long gen;
    PyObject *obj;
    int access;
    if (!PyArg_ParseTuple(args, "IKOi", &rkey, &gen, &obj, &access)) return NULL;
    if (check_running(e) < 0) return NULL;
    if (rkey == 0 || access < 1 || access > 3) {
        PyErr_SetString(PyExc_ValueError, "rkey must be nonzero and access 1, 2 or 3");
        return NULL;
    }
    struct region *r = calloc(1, sizeof *r);
    if (!r) return PyErr_NoMemory();
    if (PyObject_GetBuffer(obj, &r->view, (access & ACCESS_WRITE) ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        free(r);
        return NULL;
    }
    r->rkey = rkey;
    r->gen = gen;
    r->base = r->view.buf;
    r->len = (uint64_t)r->view.len;
    r->access = access;
    pthread_mutex_lock(&e->tab_lock);
    int taken = find_locked(e, rkey) != NULL;
    if (!taken) {
        struct region **b = bucket_of(e, rkey);
        r->next = *b;
        *b = r;
        e->regions++;
    }
    pthread_mutex_unlock(&e->tab_lock);
    if (taken) {
        PyBuffer_Release(&r->view);
        free(r);
        PyErr_Format(PyExc_KeyError, "rkey %u is in use", rkey);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* free_region(rkey) -> True if its memory was let go now, False if operations in flight hold
 * it (let go when the last ends: a ("released", rkey) event); KeyError if unknown. */
static PyObject *Engine_free_region(Engine *e, PyObject *args) {
    if (forked(e)) return NULL;
    unsigned int rkey;
    if (!PyArg_ParseTuple(args, "I", &rkey)) return NULL;
    pthread_mutex_lock(&e->tab_lock);
    struct region *found = NULL;
    for (struct region **p = bucket_of(e, rkey); *p; p = &(*p)->next) {
        if ((*p)->rkey == rkey) {
            found = *p;
            *p = found->next;
            found->next = NULL;
            found->dead = 1;
            e->regions--;
            break;
        }
    }
    int now = found && found->inflight == 0;
    if (found && !now) e->pinned++;
    pthread_mutex_unlock(&e->tab_lock);
    if (!found) {
        PyErr_Format(PyExc_KeyError, "unknown rkey %u", rkey);
        return NULL;
    }
    if (now) {
        PyBuffer_Release(&found->view);
        free(found);
    }
    return PyBool_FromLong(now);
}

/* adopt(fd, serving, notify) -> connection id. The engine owns fd from here (closes it). */
static PyObject *Engine_adopt(Engine *e, PyObject *args) {
    int fd, serving, notify;
    if (!PyArg_ParseTuple(args, "ipp", &fd, &serving, &notify)) return NULL;
    if (check_running(e) < 0) return NULL;
    /* the caller detached fd: from here it is this function's to close on any failure */
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        close(fd);
        return NULL;
    }
    struct conn *c = calloc(1, sizeof *c);
    uint8_t *ibuf = c ? malloc(IBUF) : NULL;
    if (!ibuf) {
        free(c);
        close(fd);
        return PyErr_NoMemory();
    }
    c->ibuf = ibuf;
    pthread_mutex_init(&c->lock, NULL);
    c->fd = fd;
    c->role = serving ? SERVE : CALLER;
    c->notify = notify;
    c->refuse_after = -1;
    pthread_mutex_lock(&e->conn_lock);
    uint64_t id = c->id = e->next_conn++;
    c->next = e->conns;
    e->conns = c;
    pthread_mutex_unlock(&e->conn_lock);
    /* From here the I/O thread owns c: it may serve, close and free it before wake() returns
     * (a peer whose bytes are waiting already), so nothing below reads it. */
    wake(e);
    return PyLong_FromUnsignedLongLong(id);
}

/* A connection by id with its lock held (and conn_lock: it cannot be freed meanwhile), or NULL
 * with an EngineError set; unlock with unlock_conn. */
static struct conn *lock_conn(Engine *e, unsigned long long id) {
    pthread_mutex_lock(&e->conn_lock);
    struct conn *c = conn_locked(e, id);
    if (c) pthread_mutex_lock(&c->lock);
    if (!c || c->dead) {
        if (c) pthread_mutex_unlock(&c->lock);
        pthread_mutex_unlock(&e->conn_lock);
        PyErr_Format(EngineError, "connection %llu is closed", id);
        return NULL;
    }
    return c;
}

static void unlock_conn(Engine *e, struct conn *c, int kick) {
    if (kick) c->kick = 1;
    pthread_mutex_unlock(&c->lock);
    pthread_mutex_unlock(&e->conn_lock);
    if (kick) wake(e);
}

/* send(conn, data): bytes (whole frames Python packed: a call's answer) queued on a serving
 * connection, copied. */
static PyObject *Engine_send(Engine *e, PyObject *args) {
    if (forked(e)) return NULL;
    unsigned long long id;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Ky*", &id, &b)) return NULL;
    struct chunk *k = calloc(1, sizeof *k);
    uint8_t *copy = malloc(b.len ? (size_t)b.len : 1);
    if (!k || !copy) {
        free(k);
        free(copy);
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    memcpy(copy, b.buf, (size_t)b.len);
    k->kind = BODY_OWNED;
    k->owned = copy;
    k->body = copy;
    k->body_len = (size_t)b.len;
    PyBuffer_Release(&b);
    struct conn *c = lock_conn(e, id);
    if (!c) {
        free(copy);
        free(k);
        return NULL;
    }
    queue_chunk(c, k);
    unlock_conn(e, c, 1);
    Py_RETURN_NONE;
}

/* submit(conn, req_id, opcode, rkey, offset, imm, buffers): one calling-side request. READ:
 * `buffers` receive the answer (writable, held until its completion); otherwise they are the
 * payload, sent from where they are (held likewise). */
static PyObject *Engine_submit(Engine *e, PyObject *args) {
    if (forked(e)) return NULL;
    unsigned long long id, req_id, offset;
    int opcode;
    unsigned int rkey, imm;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "KKiIKIO", &id, &req_id, &opcode, &rkey, &offset, &imm, &seq)) return NULL;
    if (opcode != IRDM_READ && opcode != IRDM_WRITE && opcode != IRDM_WRITE_IMM && opcode != IRDM_CALL) {
        PyErr_Format(PyExc_ValueError, "opcode %d is not a request the engine sends", opcode);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "buffers must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(fast);
    if (nb > 4096) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "too many buffers in one request");
        return NULL;
    }
    struct op *op = calloc(1, sizeof *op);
    if (!op || !(op->bufs = calloc((size_t)(nb ? nb : 1), sizeof(Py_buffer)))) {
        free(op);
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    int flags = opcode == IRDM_READ ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    for (Py_ssize_t i = 0; i < nb; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &op->bufs[i], flags) < 0) {
            release_op(op);
            Py_DECREF(fast);
            return NULL;
        }
        op->nbuf++;
        op->total += (uint64_t)op->bufs[i].len;
    }
    Py_DECREF(fast);
    op->req_id = req_id;
    op->opcode = opcode;
    op->status = -1;
    uint64_t limit = opcode == IRDM_CALL ? IRDM_MAX_CONTROL : IRDM_MAX_IO;
    if (op->total > limit) {
        release_op(op);
        PyErr_Format(PyExc_ValueError, "a request of %llu bytes is over the protocol's limit", (unsigned long long)limit);
        return NULL;
    }
    struct irdm_frame f = {.opcode = (uint8_t)opcode, .req_id = req_id, .rkey = rkey, .imm = imm, .offset = offset, .length = op->total};
    /* the header, then one chunk per payload buffer (each holds a reference on op) */
    struct chunk *first = new_chunk(&f), *tail = first;
    int nchunks = 1;
    if (!first) {
        release_op(op);
        return PyErr_NoMemory();
    }
    if (opcode != IRDM_READ) {
        for (int i = 0; i < op->nbuf; i++) {
            if (!op->bufs[i].len) continue;
            struct chunk *k = new_chunk(NULL);
            if (!k) {
                while (first) {
                    struct chunk *n = first->next;
                    free(first);
                    first = n;
                }
                release_op(op);
                return PyErr_NoMemory();
            }
            k->kind = BODY_OP;
            k->op = op;
            k->body = op->bufs[i].buf;
            k->body_len = (size_t)op->bufs[i].len;
            tail->next = k;
            tail = k;
            nchunks++;
        }
    }
    struct conn *c = lock_conn(e, id);
    if (!c) {
        while (first) {
            struct chunk *n = first->next;
            free(first);
            first = n;
        }
        release_op(op);
        return NULL;
    }
    if (c->role != CALLER || pending_find(c, req_id)) {
        int serving = c->role != CALLER;
        unlock_conn(e, c, 0);
        while (first) {
            struct chunk *n = first->next;
            free(first);
            first = n;
        }
        release_op(op);
        PyErr_SetString(PyExc_ValueError, serving ? "a serving connection takes no requests" : "request id in use");
        return NULL;
    }
    op->refs = nchunks; /* the header chunk's reference is the pending table's */
    struct op **b = pending_of(c, req_id);
    op->next = *b;
    *b = op;
    c->npending++;
    while (first) {
        struct chunk *n = first->next;
        first->next = NULL;
        queue_chunk(c, first);
        first = n;
    }
    unlock_conn(e, c, 1);
    Py_RETURN_NONE;
}

/* cancel(conn, req_id) -> 0: not pending (answered, or its answer is arriving: wait for its
 * completion); 1: given up, and its buffers will not be touched again; 2: given up, but its
 * payload is still being sent from its buffers: wait for its completion. */
static PyObject *Engine_cancel(Engine *e, PyObject *args) {
    if (forked(e)) return NULL;
    unsigned long long id, req_id;
    if (!PyArg_ParseTuple(args, "KK", &id, &req_id)) return NULL;
    pthread_mutex_lock(&e->conn_lock);
    struct conn *c = conn_locked(e, id);
    int rc = 0;
    if (c) {
        pthread_mutex_lock(&c->lock);
        struct op *op = c->dead ? NULL : pending_find(c, req_id);
        if (op) {
            op->abandoned = 1;
            rc = (op->opcode != IRDM_READ && op->refs > 1) ? 2 : 1;
        }
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&e->conn_lock);
    return PyLong_FromLong(rc);
}

/* close(conn): the I/O thread closes it (its pending operations complete as lost). */
static PyObject *Engine_close(Engine *e, PyObject *args) {
    if (forked(e)) return NULL;
    unsigned long long id;
    if (!PyArg_ParseTuple(args, "K", &id)) return NULL;
    pthread_mutex_lock(&e->conn_lock);
    struct conn *c = conn_locked(e, id);
    if (c) {
        pthread_mutex_lock(&c->lock);
        c->closing = 1;
        c->kick = 1;
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&e->conn_lock);
    if (c) wake(e);
    Py_RETURN_NONE;
}

/* conn_info(conn) -> (frames queued to send, their bytes, requests unanswered, seconds since a
 * frame last began to arrive or -1.0 if none ever did); None if it is closed. */
static PyObject *Engine_conn_info(Engine *e, PyObject *args) {
    if (forked(e)) return NULL;
    unsigned long long id;
    if (!PyArg_ParseTuple(args, "K", &id)) return NULL;
    pthread_mutex_lock(&e->conn_lock);
    struct conn *c = conn_locked(e, id);
    unsigned long long frames = 0, bytes = 0, pending = 0;
    long long heard = 0;
    int found = c && !c->dead;
    if (found) {
        pthread_mutex_lock(&c->lock);
        for (struct chunk *k = c->out_head; k; k = k->next) frames += k->hdr_len != 0;
        bytes = atomic_load(&c->out_bytes);
        pending = c->npending;
        heard = atomic_load(&c->heard_ns);
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&e->conn_lock);
    if (!found) Py_RETURN_NONE;
    double ago = -1.0;
    if (heard) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        ago = ((double)now.tv_sec * 1e9 + (double)now.tv_nsec - (double)heard) / 1e9;
    }
    return Py_BuildValue("(KKKd)", frames, bytes, pending, ago);
}

static PyObject *payload_bytes(const uint8_t *p, uint64_t n) {
    if (!p) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)n);
}

/* poll() -> the events since the last poll, in order:
 *   (1, conn, opcode, req_id, rkey, imm, offset, length, document or None)  a request for Python
 *   (2, conn, req_id, status, payload or None)   a calling-side completion (status -1: lost)
 *   (3, conn, reason)                             a connection closed
 *   (4, rkey)                                     a freed region's memory let go
 *   (5, conn, line)                               a line for the log (a refused request)
 *   (6, conn, document)                           a probe answered from the status: its call */
static PyObject *Engine_poll(Engine *e, PyObject *unused) {
    if (forked(e)) return NULL;
    if (e->ev_fd < 0) return PyList_New(0); /* stopped: nothing comes any more */
    uint64_t v;
    ssize_t r = read(e->ev_fd, &v, sizeof v);
    (void)r;
    pthread_mutex_lock(&e->ev_lock);
    struct event *ev = e->ev_head;
    e->ev_head = e->ev_tail = NULL;
    pthread_mutex_unlock(&e->ev_lock);
    PyObject *out = PyList_New(0);
    uint64_t docs = 0;
    while (ev && out) {
        struct event *next = ev->next;
        PyObject *item = NULL;
        switch (ev->kind) {
        case EV_CALL: {
            PyObject *doc = payload_bytes(ev->payload, ev->payload_len);
            if (doc)
                item = Py_BuildValue("(iKiKkkKKN)", EV_CALL, (unsigned long long)ev->conn, ev->f.opcode,
                                     (unsigned long long)ev->f.req_id, (unsigned long)ev->f.rkey, (unsigned long)ev->f.imm,
                                     (unsigned long long)ev->f.offset, (unsigned long long)ev->f.length, doc);
            break;
        }
        case EV_DONE: {
            struct op *op = ev->op;
            PyObject *pl = payload_bytes(op->payload, op->payload_len);
            if (pl) item = Py_BuildValue("(iKKiN)", EV_DONE, (unsigned long long)ev->conn, (unsigned long long)op->req_id, op->status, pl);
            break;
        }
        case EV_CLOSED:
        case EV_LOG: { /* the engine's own words; "replace" so a bad byte can never fail them for good */
            PyObject *line = PyUnicode_DecodeUTF8(ev->payload ? (const char *)ev->payload : "", (Py_ssize_t)ev->payload_len, "replace");
            if (line) item = Py_BuildValue("(iKN)", ev->kind, (unsigned long long)ev->conn, line);
            break;
        }
        case EV_PROBED: {
            PyObject *doc = payload_bytes(ev->payload, ev->payload_len);
            if (doc) item = Py_BuildValue("(iKN)", EV_PROBED, (unsigned long long)ev->conn, doc);
            break;
        }
        case EV_RELEASED:
            item = Py_BuildValue("(ik)", EV_RELEASED, (unsigned long)ev->rkey);
            break;
        }
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            break; /* ev and what follows it go back to the queue, for the next poll */
        }
        Py_DECREF(item);
        if ((ev->kind == EV_CALL && ev->f.opcode == IRDM_CALL) || ev->kind == EV_PROBED) docs += ev->payload_len;
        if (ev->op) release_op(ev->op);
        free(ev->payload);
        free(ev);
        ev = next;
    }
    if (ev) { /* a Python allocation failed: nothing taken is lost, the rest waits its turn */
        struct event *last = ev;
        while (last->next) last = last->next;
        pthread_mutex_lock(&e->ev_lock);
        last->next = e->ev_head;
        e->ev_head = ev;
        if (!e->ev_tail) e->ev_tail = last;
        pthread_mutex_unlock(&e->ev_lock);
        uint64_t one = 1;
        ssize_t n = write(e->ev_fd, &one, sizeof one); /* Python is woken again for them */
        (void)n;
    }
    release_zombies(e);
    if (docs) {
        uint64_t before = atomic_fetch_sub(&e->buffered, docs);
        if (before > BUFFER_BUDGET && before - docs <= BUFFER_BUDGET) {
            atomic_store(&e->kick_all, 1);
            wake(e);
        }
    }
    if (!out) return NULL; /* MemoryError; every event kept */
    if (PyList_GET_SIZE(out) == 0 && ev) { /* not even one taken: say why */
        Py_DECREF(out);
        return NULL;
    }
    PyErr_Clear(); /* some were taken: they are the answer; the failure is retried next poll */
    return out;
}

/* publish_status(document, valid_for): probes are answered `document` for the next valid_for
 * seconds (0: withdrawn), copied. */
static PyObject *Engine_publish_status(Engine *e, PyObject *args) {
    Py_buffer b;
    double valid_for;
    if (!PyArg_ParseTuple(args, "y*d", &b, &valid_for)) return NULL;
    if (check_running(e) < 0 || !(valid_for >= 0.0 && valid_for < 3600.0) || (uint64_t)b.len > IRDM_MAX_CONTROL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "publish_status: a document of at most a control document's size, valid for 0 to 3600 s");
        PyBuffer_Release(&b);
        return NULL;
    }
    uint8_t *copy = malloc(b.len ? (size_t)b.len : 1);
    if (!copy) {
        PyBuffer_Release(&b);
        return PyErr_NoMemory();
    }
    memcpy(copy, b.buf, (size_t)b.len);
    long long until = now_ns() + (long long)(valid_for * 1e9);
    pthread_mutex_lock(&e->st_lock);
    uint8_t *old = e->status;
    e->status = copy;
    e->status_len = (size_t)b.len;
    e->status_until_ns = valid_for > 0.0 ? until : 0;
    pthread_mutex_unlock(&e->st_lock);
    free(old);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyObject *Engine_fileno(Engine *e, PyObject *unused) { return PyLong_FromLong(e->ev_fd); }

static PyObject *Engine_stats(Engine *e, PyObject *unused) {
    if (forked(e)) return NULL;
    pthread_mutex_lock(&e->tab_lock);
    unsigned long long regions = e->regions, pinned = e->pinned;
    pthread_mutex_unlock(&e->tab_lock);
    unsigned long long conns = 0;
    pthread_mutex_lock(&e->conn_lock);
    for (struct conn *c = e->conns; c; c = c->next) conns += !c->dead;
    pthread_mutex_unlock(&e->conn_lock);
    return Py_BuildValue("{s:(KK),s:(KK),s:(KK),s:K,s:(KK),s:K,s:K,s:K,s:K,s:K}",
        "read", (unsigned long long)atomic_load(&e->served[S_READ][0]), (unsigned long long)atomic_load(&e->served[S_READ][1]),
        "write", (unsigned long long)atomic_load(&e->served[S_WRITE][0]), (unsigned long long)atomic_load(&e->served[S_WRITE][1]),
        "write_imm", (unsigned long long)atomic_load(&e->served[S_WRITE_IMM][0]), (unsigned long long)atomic_load(&e->served[S_WRITE_IMM][1]),
        "refused", (unsigned long long)atomic_load(&e->served[S_REFUSED][0]),
        "landed", (unsigned long long)atomic_load(&e->landed[0]), (unsigned long long)atomic_load(&e->landed[1]),
        "buffered", (unsigned long long)atomic_load(&e->buffered), "regions", regions, "pinned", pinned, "connections", conns,
        "probes", (unsigned long long)atomic_load(&e->probes));
}

static PyMethodDef Engine_methods[] = {
    {"add_region", (PyCFunction)Engine_add_region, METH_VARARGS, "add_region(rkey, gen, buffer, access)"},
    {"free_region", (PyCFunction)Engine_free_region, METH_VARARGS, "free_region(rkey) -> let go now"},
    {"adopt", (PyCFunction)Engine_adopt, METH_VARARGS, "adopt(fd, serving, notify) -> connection id"},
    {"send", (PyCFunction)Engine_send, METH_VARARGS, "send(conn, frames)"},
    {"submit", (PyCFunction)Engine_submit, METH_VARARGS, "submit(conn, req_id, opcode, rkey, offset, imm, buffers)"},
    {"cancel", (PyCFunction)Engine_cancel, METH_VARARGS, "cancel(conn, req_id) -> 0, 1 or 2"},
    {"close", (PyCFunction)Engine_close, METH_VARARGS, "close(conn)"},
    {"poll", (PyCFunction)Engine_poll, METH_NOARGS, "poll() -> events"},
    {"conn_info", (PyCFunction)Engine_conn_info, METH_VARARGS, "conn_info(conn) -> (frames queued, bytes queued, unanswered, seconds since heard)"},
    {"fileno", (PyCFunction)Engine_fileno, METH_NOARGS, "the eventfd Python waits on"},
    {"publish_status", (PyCFunction)Engine_publish_status, METH_VARARGS, "publish_status(document, valid_for): what probes get, copied"},
    {"stats", (PyCFunction)Engine_stats, METH_NOARGS, "counters"},
    {"stop", (PyCFunction)Engine_stop, METH_NOARGS, "stop the I/O thread, close everything"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "irdmafs._engine.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_doc = "The data-plane engine: a region table, connections, one I/O thread.",
};

static PyObject *parse_header(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    struct irdm_frame f;
    int rc = irdm_parse(b.buf, (size_t)b.len, &f);
    PyBuffer_Release(&b);
    if (rc != IRDM_PARSE_OK) {
        PyErr_SetObject(PyExc_ValueError, Py_BuildValue("(is)", rc, irdm_parse_error(rc)));
        return NULL;
    }
    return Py_BuildValue("(iiKkkKK)", f.opcode, f.status, (unsigned long long)f.req_id, (unsigned long)f.rkey,
                         (unsigned long)f.imm, (unsigned long long)f.offset, (unsigned long long)f.length);
}

static PyMethodDef methods[] = {
    {"parse_header", parse_header, METH_O, "parse_header(40 bytes) -> (opcode, status, req_id, rkey, imm, offset, length); ValueError((code, why))"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_engine", "irdmafs data-plane engine (native/engine)", -1, methods};

PyMODINIT_FUNC PyInit__engine(void) {
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    EngineError = PyErr_NewException("irdmafs._engine.EngineError", NULL, NULL);
    Py_INCREF(&EngineType);
    if (!EngineError || PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0 || PyModule_AddObject(m, "EngineError", EngineError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/*
 * nvme-offload native engine.
 *
 * A request is a list of segments (buffer <-> file range). It is cut into pieces of at most
 * block_size bytes, and the pieces are spread over the workers. Two backends share everything
 * but the worker loop:
 *   - io_uring: one ring per worker thread, at most queue_depth pieces in flight per ring,
 *     read/write-fixed when the buffer was registered;
 *   - threads: a pool of threads doing pread/pwrite, for kernels or sandboxes without io_uring.
 *
 * Every completion is checked: short transfers are queued again for their remainder, -EAGAIN and
 * -EINTR are retried a bounded number of times, and anything else completes the piece (and so the
 * request) with -errno. Nothing here prints, exits or aborts.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <time.h>
#include <linux/stat.h>

#ifdef OFL_HAVE_URING
#include <liburing.h>
#endif

#if defined(OFL_HAVE_XXHASH) && defined(OFL_XXH_DISPATCH)
#include <xxh_x86dispatch.h>  /* XXH3_64bits and its streaming calls: same digests, widest vector unit */
#elif defined(OFL_HAVE_XXHASH)
#include <xxhash.h>
#endif

#include "offload_engine.h"

#ifndef OFL_VERSION
#error "OFL_VERSION must be defined by the build (the package version)"
#endif

#define OFL_MAX_RETRIES 100
#define OFL_MAX_THREADS 64

typedef struct ofl_piece ofl_piece;

struct ofl_piece {
    ofl_piece *next;
    ofl_request *req;
    int op;
    int fd;
    int buf_index;
    int seg;
    char *buf;
    int64_t offset;
    int64_t len;       /* bytes still to move */
    int64_t rel;       /* position of buf within the request, for end-of-file prefixes */
    int retries;
    int fault_checked;
    char *obuf;        /* the piece's bytes as submitted, for its digest */
    int64_t olen;
    uint64_t h;        /* OFL_REQ_DIGEST: xxh3_64 of those bytes */
    ofl_piece *hnext;  /* the hasher's queue */
    ofl_piece *fprev, *fnext;  /* io_uring: the worker's list of pieces the kernel holds */
};

struct ofl_request {
    ofl_request *prev, *next;  /* engine's list of live requests */
    ofl_piece *pieces;
    int64_t pending;
    int64_t moved;
    int64_t total;             /* bytes asked for */
    int64_t eof_at;            /* smallest request position where a read met end of file (else total) */
    int error;
    int err_seg;
    int64_t err_offset;
    int done;
    /* OFL_REQ_DIGEST: every piece's bytes are hashed by the engine's hasher thread (a read's as each
     * piece lands, a write's while they are written), and the request's digest is the xxh3_64 of the
     * pieces' digests in order; the request is done only when its digest is. */
    int op;
    int64_t npieces;
    int want_digest;
    int64_t hash_pending;      /* pieces queued for or being hashed */
    int hashed;
    int has_digest;
    uint64_t digest;
};

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ofl_piece *head, *tail;
    int stop;
} ofl_queue;

typedef struct {
    ofl_engine *e;
    pthread_t thread;
    int started;
    ofl_queue *q;
#ifdef OFL_HAVE_URING
    struct io_uring ring;
    int ring_ok;
    int fixed_ok;              /* this ring holds the engine's fixed-buffer table */
#endif
} ofl_worker;

struct ofl_engine {
    ofl_config cfg;
    int backend;
    int fallback_reason;
    pid_t pid;                 /* the creating process: a forked child has none of the workers */

    /* Guards requests, stats and faults. Completions broadcast on done_cv. */
    pthread_mutex_t mu;
    pthread_cond_t done_cv;
    ofl_request live;          /* sentinel of the live list */
    int64_t live_count;
    ofl_stats stats;

    int fault_op, fault_kind, fault_err;
    int64_t fault_skip, fault_count;
    int fault_armed;           /* read without the lock as a cheap filter */

    /* Registered buffers, for validating buf_index. */
    void **fixed_addrs;
    int64_t *fixed_lens;
    int fixed_count;

    /* The hasher: one thread, started at the first digest asked for, so that hashing never holds up
     * the threads that keep the queues full. It takes pieces, reads' first (a read is waited on; a
     * write only holds its buffer). Guarded by e->mu; wakes on hash_cv. */
    pthread_cond_t hash_cv;
    ofl_piece *hread_head, *hread_tail, *hwrite_head, *hwrite_tail;
    int hash_stop;
    int hash_started;          /* 1: running; -1: it could not start (hash inline instead) */
    pthread_t hash_thread;

    int nworkers;
    ofl_worker *workers;
    int nqueues;
    ofl_queue *queues;         /* io_uring: one per worker; threads: one shared */
    uint64_t rr;               /* round robin start for the next request */
};

/*
 * A child forked after the engine was created has a copy of its memory but none of its threads,
 * and its mutexes may be copies taken while locked: it must neither wait on nor join anything.
 */
#define OFL_FOREIGN(e) ((e)->pid != getpid())

/* Testing hook: a non-zero errno makes every io_uring start fail with it (process-wide). */
static int ofl_refuse_uring;
/* Testing hook: non-zero makes engines made later hash without a thread of their own. */
static int ofl_no_hasher;

const char *ofl_version(void) { return OFL_VERSION; }

int ofl_have_xxhash(void)
{
#ifdef OFL_HAVE_XXHASH
    return 1;
#else
    return 0;
#endif
}

int ofl_have_io_uring(void)
{
#ifdef OFL_HAVE_URING
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------- queues */

static int queue_init(ofl_queue *q)
{
    memset(q, 0, sizeof(*q));
    if (pthread_mutex_init(&q->mu, NULL) != 0)
        return -ENOMEM;
    if (pthread_cond_init(&q->cv, NULL) != 0) {
        pthread_mutex_destroy(&q->mu);
        return -ENOMEM;
    }
    return 0;
}

static void queue_destroy(ofl_queue *q)
{
    pthread_cond_destroy(&q->cv);
    pthread_mutex_destroy(&q->mu);
}

/* Append a chain of pieces (first..last) to a queue and wake its workers. */
static void queue_push_chain(ofl_queue *q, ofl_piece *first, ofl_piece *last)
{
    last->next = NULL;
    pthread_mutex_lock(&q->mu);
    if (q->tail)
        q->tail->next = first;
    else
        q->head = first;
    q->tail = last;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

/* Pop up to max pieces without blocking; returns a NULL-terminated chain. */
static ofl_piece *queue_pop_locked(ofl_queue *q, int max, int *n)
{
    ofl_piece *first = q->head, *p = first, *last = NULL;
    int k = 0;
    while (p && k < max) {
        last = p;
        p = p->next;
        k++;
    }
    if (last) {
        q->head = p;
        if (!p)
            q->tail = NULL;
        last->next = NULL;
    } else {
        first = NULL;
    }
    *n = k;
    return first;
}

/* ---------------------------------------------------------------- completion */

/* The xxh3_64 of one piece's bytes as submitted (only built with libxxhash). */
static uint64_t piece_hash(const ofl_piece *p)
{
#ifdef OFL_HAVE_XXHASH
    return XXH3_64bits(p->obuf, (size_t)p->olen);
#else
    (void)p;
    return 0;
#endif
}

/*
 * A request's digest into *out: the xxh3_64 of its pieces' digests, in order, as 64-bit little-endian
 * words (this engine runs on little-endian machines). 0, or -ENOMEM (no memory for a streaming state:
 * the caller then reads no digest and computes it itself).
 */
static int request_hash(ofl_request *r, uint64_t *out)
{
#ifdef OFL_HAVE_XXHASH
    XXH3_state_t *st = XXH3_createState();
    if (!st)
        return -ENOMEM;
    XXH3_64bits_reset(st);
    for (int64_t k = 0; k < r->npieces; k++)
        XXH3_64bits_update(st, &r->pieces[k].h, sizeof(uint64_t));
    *out = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return 0;
#else
    (void)r;
    (void)out;
    return -ENOTSUP;
#endif
}

/* A request is done once its pieces are all in and, if a digest was asked for, its hash too. Under e->mu. */
static void finish_if_complete_locked(ofl_engine *e, ofl_request *r)
{
    if (r->done || r->pending > 0 || (r->want_digest && !r->hashed))
        return;
    r->done = 1;
    e->stats.requests++;
    pthread_cond_broadcast(&e->done_cv);
}

/*
 * Fold a request's piece digests once every piece is in and hashed: a read's only if all of its bytes
 * came (no error, no end of file), a write's always (the bytes as submitted). Under e->mu.
 */
static void fold_if_hashed_locked(ofl_request *r)
{
    if (r->hashed || r->pending > 0 || r->hash_pending > 0)
        return;
    uint64_t d = 0;
    int sound = r->op != OFL_OP_READ || (r->error == 0 && r->eof_at == r->total && r->moved == r->total);
    r->has_digest = sound && request_hash(r, &d) == 0;
    r->digest = d;
    r->hashed = 1;
}

static void *hash_worker(void *arg)
{
    ofl_engine *e = arg;
    (void)pthread_setname_np(pthread_self(), "offload-hash");  /* names seen in top -H, /proc */
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->hread_head && !e->hwrite_head && !e->hash_stop)
            pthread_cond_wait(&e->hash_cv, &e->mu);
        ofl_piece **head = e->hread_head ? &e->hread_head : &e->hwrite_head;
        ofl_piece *p = *head;
        if (!p)
            break;
        *head = p->hnext;
        if (!*head)
            *(head == &e->hread_head ? &e->hread_tail : &e->hwrite_tail) = NULL;
        /* Outside the lock: the request is not done, so nobody reuses its buffers meanwhile. */
        pthread_mutex_unlock(&e->mu);
        uint64_t h = piece_hash(p);
        pthread_mutex_lock(&e->mu);
        p->h = h;
        ofl_request *r = p->req;
        r->hash_pending--;
        fold_if_hashed_locked(r);
        finish_if_complete_locked(e, r);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* Queue a piece whose bytes are final for the hasher (started on first use); without one, hash it
 * here. Under e->mu. */
static void hash_enqueue_locked(ofl_engine *e, ofl_piece *p)
{
    if (e->hash_started == 0) {
        e->hash_started = pthread_create(&e->hash_thread, NULL, hash_worker, e) == 0 ? 1 : -1;
    }
    if (e->hash_started < 0) {
        /* Outside the lock, as the hasher would: the request is not done, so its buffers stay. */
        pthread_mutex_unlock(&e->mu);
        uint64_t h = piece_hash(p);
        pthread_mutex_lock(&e->mu);
        p->h = h;
        return;
    }
    p->req->hash_pending++;
    p->hnext = NULL;
    int read = p->op == OFL_OP_READ;
    ofl_piece **tail = read ? &e->hread_tail : &e->hwrite_tail;
    if (*tail)
        (*tail)->hnext = p;
    else
        *(read ? &e->hread_head : &e->hwrite_head) = p;
    *tail = p;
    pthread_cond_signal(&e->hash_cv);
}

/* Finish a piece: its last `moved` bytes, its error or end of file, and its request if it was the last. */
static void complete_piece(ofl_engine *e, ofl_piece *p, int err, int eof, int64_t moved)
{
    ofl_request *r = p->req;
    pthread_mutex_lock(&e->mu);
    e->stats.bytes += moved;
    r->moved += moved;
    if (err < 0) {
        e->stats.failures++;
        if (r->error == 0) {
            r->error = err;
            r->err_seg = p->seg;
            r->err_offset = p->offset;
        }
    }
    if (eof && p->rel < r->eof_at)
        r->eof_at = p->rel;
    e->stats.pieces++;
    if (r->want_digest && r->op == OFL_OP_READ && err == 0 && !eof)
        hash_enqueue_locked(e, p);  /* this piece's bytes are in: hashed while the others come */
    if (--r->pending == 0) {
        if (r->want_digest)
            fold_if_hashed_locked(r);
        finish_if_complete_locked(e, r);
    }
    pthread_mutex_unlock(&e->mu);
}

static void account_bytes(ofl_engine *e, ofl_request *r, int64_t n)
{
    pthread_mutex_lock(&e->mu);
    e->stats.bytes += n;
    r->moved += n;
    pthread_mutex_unlock(&e->mu);
}

static void count_stat(ofl_engine *e, int64_t *field)
{
    pthread_mutex_lock(&e->mu);
    (*field)++;
    pthread_mutex_unlock(&e->mu);
}

/*
 * Decide whether an injected fault applies to this piece's first submission.
 * Returns OFL_FAULT_NONE, OFL_FAULT_SHORT or OFL_FAULT_ERROR (with *err set).
 */
static int take_fault(ofl_engine *e, ofl_piece *p, int *err)
{
    int kind = OFL_FAULT_NONE;
    if (p->fault_checked)
        return kind;
    p->fault_checked = 1;
    if (!__atomic_load_n(&e->fault_armed, __ATOMIC_ACQUIRE))
        return kind;
    pthread_mutex_lock(&e->mu);
    if (e->fault_kind != OFL_FAULT_NONE && (e->fault_op < 0 || e->fault_op == p->op)) {
        if (e->fault_skip > 0) {
            e->fault_skip--;
        } else if (e->fault_count != 0) {
            if (e->fault_count > 0 && --e->fault_count == 0)
                __atomic_store_n(&e->fault_armed, 0, __ATOMIC_RELEASE);
            kind = e->fault_kind;
            *err = e->fault_err;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return kind;
}

/* Length to submit for a piece: the whole remainder, or half of it under a short fault. */
static int64_t submit_len(ofl_piece *p, int fault)
{
    if (fault == OFL_FAULT_SHORT && p->len >= 8192) {
        int64_t half = (p->len / 2) & ~(int64_t)4095;
        return half > 0 ? half : p->len;
    }
    return p->len;
}

/*
 * Apply a completion result of n bytes (or -errno) to a piece. Returns 1 if the piece must be
 * submitted again (remainder or retry), 0 if it is finished.
 */
static int settle(ofl_engine *e, ofl_piece *p, int64_t n)
{
    if (n == -EAGAIN || n == -EINTR) {
        if (++p->retries <= OFL_MAX_RETRIES) {
            count_stat(e, &e->stats.retries);
            return 1;
        }
        complete_piece(e, p, (int)n, 0, 0);
        return 0;
    }
    if (n < 0) {
        complete_piece(e, p, (int)n, 0, 0);
        return 0;
    }
    if (n == 0) {
        if (p->op == OFL_OP_READ)
            complete_piece(e, p, 0, 1, 0);   /* end of file: the request reports a prefix */
        else
            complete_piece(e, p, -EIO, 0, 0); /* a write that moves nothing would loop forever */
        return 0;
    }
    if (n < p->len) {
        account_bytes(e, p->req, n);
        p->buf += n;
        p->offset += n;
        p->len -= n;
        p->rel += n;
        count_stat(e, &e->stats.resubmits);
        return 1;
    }
    complete_piece(e, p, 0, 0, n); /* one lock for the bytes and the completion */
    return 0;
}

static void fail_chain(ofl_engine *e, ofl_piece *p, int err)
{
    while (p) {
        ofl_piece *next = p->next;
        complete_piece(e, p, err, 0, 0);
        p = next;
    }
}

/* ---------------------------------------------------------------- threads backend */

static void *thread_worker(void *arg)
{
    ofl_worker *w = arg;
    ofl_engine *e = w->e;
    ofl_queue *q = w->q;
    (void)pthread_setname_np(pthread_self(), "offload-io");
    for (;;) {
        pthread_mutex_lock(&q->mu);
        while (!q->head && !q->stop)
            pthread_cond_wait(&q->cv, &q->mu);
        if (!q->head && q->stop) {
            pthread_mutex_unlock(&q->mu);
            return NULL;
        }
        int n;
        ofl_piece *p = queue_pop_locked(q, 1, &n);
        pthread_mutex_unlock(&q->mu);

        int again = 1;
        while (again) {
            int ferr = 0;
            int fault = take_fault(e, p, &ferr);
            if (fault == OFL_FAULT_ERROR) {
                complete_piece(e, p, -ferr, 0, 0);
                break;
            }
            int64_t len = submit_len(p, fault);
            ssize_t res = p->op == OFL_OP_READ ? pread(p->fd, p->buf, (size_t)len, p->offset)
                                               : pwrite(p->fd, p->buf, (size_t)len, p->offset);
            again = settle(e, p, res < 0 ? -(int64_t)errno : (int64_t)res);
        }
    }
}

/* ---------------------------------------------------------------- io_uring backend */

#ifdef OFL_HAVE_URING

static unsigned ring_entries(int queue_depth)
{
    unsigned n = 1;
    while (n < (unsigned)queue_depth)
        n <<= 1;
    return n;
}

/* Prepare one SQE for a piece. Returns 1 if prepared, 0 if the piece was settled instead. */
static int prep_piece(ofl_worker *w, ofl_piece *p)
{
    ofl_engine *e = w->e;
    int ferr = 0;
    int fault = take_fault(e, p, &ferr);
    if (fault == OFL_FAULT_ERROR) {
        complete_piece(e, p, -ferr, 0, 0);
        return 0;
    }
    struct io_uring_sqe *sqe = io_uring_get_sqe(&w->ring);
    /* Never NULL: the ring has at least queue_depth entries and we keep at most that many. */
    unsigned len = (unsigned)submit_len(p, fault);
    int fixed = p->buf_index >= 0 && w->fixed_ok;
    if (p->op == OFL_OP_READ) {
        if (fixed)
            io_uring_prep_read_fixed(sqe, p->fd, p->buf, len, (uint64_t)p->offset, p->buf_index);
        else
            io_uring_prep_read(sqe, p->fd, p->buf, len, (uint64_t)p->offset);
    } else {
        if (fixed)
            io_uring_prep_write_fixed(sqe, p->fd, p->buf, len, (uint64_t)p->offset, p->buf_index);
        else
            io_uring_prep_write(sqe, p->fd, p->buf, len, (uint64_t)p->offset);
    }
    io_uring_sqe_set_data(sqe, p);
    return 1;
}

static void sleep_briefly(void)
{
    struct timespec ts = {0, 100000}; /* 100 us */
    nanosleep(&ts, NULL);
}

/* Register the engine's fixed-buffer table with one ring; returns 0 or -errno. */
static int ring_register(ofl_worker *w)
{
    ofl_engine *e = w->e;
    w->fixed_ok = 0;
    /*
     * Copy the table under the lock: a ring rebuilt after a failure does this on the worker thread,
     * when the failed request may already be freed and a registration may be replacing the table.
     */
    pthread_mutex_lock(&e->mu);
    int count = e->fixed_count;
    struct iovec *iov = count > 0 ? calloc((size_t)count, sizeof(*iov)) : NULL;
    for (int i = 0; iov && i < count; i++) {
        iov[i].iov_base = e->fixed_addrs[i];
        iov[i].iov_len = (size_t)e->fixed_lens[i];
    }
    pthread_mutex_unlock(&e->mu);
    if (count <= 0)
        return 0;
    if (!iov)
        return -ENOMEM;
    int rc = io_uring_register_buffers(&w->ring, iov, (unsigned)count);
    free(iov);
    w->fixed_ok = rc == 0;
    return rc;
}

/*
 * The state of one worker's loop. Pieces move: queue -> batch (SQE prepared, not yet taken by
 * the kernel) -> flight (the kernel holds them) -> settled, or back to `again` for a remainder.
 * Knowing exactly which pieces the kernel holds is what lets a broken ring fail them instead of
 * leaving their requests waiting forever.
 */
typedef struct {
    ofl_worker *w;
    ofl_piece flight;          /* sentinel of the in-flight list */
    int inflight;
    ofl_piece *batch, *batch_tail;
    int nbatch;
    ofl_piece *again;          /* remainders and retries to submit next */
    int nagain;
} uring_loop;

static void batch_push(uring_loop *L, ofl_piece *p)
{
    p->next = NULL;
    if (L->batch_tail)
        L->batch_tail->next = p;
    else
        L->batch = p;
    L->batch_tail = p;
    L->nbatch++;
}

/* The kernel consumes SQEs in order: move the ones it took from the batch to the flight list. */
static void launch_consumed(uring_loop *L)
{
    int unsent = (int)io_uring_sq_ready(&L->w->ring);
    while (L->nbatch > unsent) {
        ofl_piece *p = L->batch;
        L->batch = p->next;
        if (!L->batch)
            L->batch_tail = NULL;
        L->nbatch--;
        p->next = NULL;
        p->fnext = &L->flight;
        p->fprev = L->flight.fprev;
        L->flight.fprev->fnext = p;
        L->flight.fprev = p;
        L->inflight++;
    }
}

/* Apply one completion: settle its piece, keeping it for resubmission if it needs more. */
static void reap_one(uring_loop *L, struct io_uring_cqe *cqe)
{
    ofl_piece *p = io_uring_cqe_get_data(cqe);
    int64_t res = cqe->res;
    io_uring_cqe_seen(&L->w->ring, cqe);
    p->fprev->fnext = p->fnext;
    p->fnext->fprev = p->fprev;
    p->fprev = p->fnext = NULL;
    L->inflight--;
    if (settle(L->w->e, p, res)) {
        p->next = L->again;
        L->again = p;
        L->nagain++;
    }
}

/*
 * The ring refused a submission or a wait with err. Let what the kernel holds land first (its
 * buffers are in use), fail what it never took, then start a clean ring: SQEs cannot be taken
 * back out of a ring. If even waiting fails, the pieces still held are failed too, so that no
 * request waits forever on a broken ring.
 */
static void ring_fail(uring_loop *L, int err)
{
    ofl_worker *w = L->w;
    ofl_engine *e = w->e;
    while (L->inflight > 0) {
        struct io_uring_cqe *cqe;
        int rc = io_uring_wait_cqe(&w->ring, &cqe);
        if (rc == -EINTR)
            continue;
        if (rc < 0)
            break;
        reap_one(L, cqe);
    }
    while (L->flight.fnext != &L->flight) {
        ofl_piece *p = L->flight.fnext;
        p->fprev->fnext = p->fnext;
        p->fnext->fprev = p->fprev;
        p->fprev = p->fnext = NULL;
        complete_piece(e, p, err, 0, 0);
    }
    L->inflight = 0;
    fail_chain(e, L->batch, err);
    L->batch = L->batch_tail = NULL;
    L->nbatch = 0;
    io_uring_queue_exit(&w->ring);
    w->ring_ok = 0;
    w->fixed_ok = 0;
    if (io_uring_queue_init(ring_entries(e->cfg.queue_depth), &w->ring, 0) == 0) {
        w->ring_ok = 1;
        ring_register(w); /* without the table, this ring uses plain reads and writes */
    }
}

static void *uring_worker(void *arg)
{
    ofl_worker *w = arg;
    ofl_engine *e = w->e;
    ofl_queue *q = w->q;
    (void)pthread_setname_np(pthread_self(), "offload-io");
    const int qd = e->cfg.queue_depth;
    uring_loop L;
    memset(&L, 0, sizeof(L));
    L.w = w;
    L.flight.fnext = L.flight.fprev = &L.flight;

    for (;;) {
        /* Take new work: when idle, block; with overlap_events, top the ring up. */
        ofl_piece *fresh = NULL;
        int nfresh = 0;
        int room = qd - L.inflight - L.nagain;
        pthread_mutex_lock(&q->mu);
        while (!q->head && L.inflight == 0 && L.nagain == 0 && !q->stop)
            pthread_cond_wait(&q->cv, &q->mu);
        if (q->stop && !q->head && L.inflight == 0 && L.nagain == 0) {
            pthread_mutex_unlock(&q->mu);
            break;
        }
        if (room > 0 && (e->cfg.overlap_events || L.inflight == 0))
            fresh = queue_pop_locked(q, room, &nfresh);
        pthread_mutex_unlock(&q->mu);

        ofl_piece *again = L.again;
        L.again = NULL;
        L.nagain = 0;
        if (!w->ring_ok) {
            /* A ring reset failed earlier: nothing can be submitted on this worker any more. */
            fail_chain(e, again, -EIO);
            fail_chain(e, fresh, -EIO);
            continue;
        }

        /* Prepare SQEs: remainders first, then new pieces. */
        for (int pass = 0; pass < 2; pass++) {
            ofl_piece *p = pass == 0 ? again : fresh;
            while (p) {
                ofl_piece *next = p->next;
                if (prep_piece(w, p)) {
                    batch_push(&L, p);
                    if (e->cfg.single_submit) {
                        /* What this leaves unsent goes with the submit below. */
                        io_uring_submit(&w->ring);
                        launch_consumed(&L);
                    }
                }
                p = next;
            }
        }

        /* Hand the batch to the kernel and wait: for one completion, or for all of them. */
        if (L.nbatch > 0 || L.inflight > 0) {
            int want = e->cfg.overlap_events ? 1 : L.inflight + L.nbatch;
            int rc, tries = 0;
            for (;;) {
                rc = io_uring_submit_and_wait(&w->ring, (unsigned)want);
                launch_consumed(&L);
                if (rc >= 0)
                    break;
                if ((rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) && ++tries <= OFL_MAX_RETRIES) {
                    sleep_briefly();
                    want = e->cfg.overlap_events ? 1 : L.inflight + L.nbatch;
                    continue;
                }
                break;
            }
            if (rc < 0 && L.nbatch > 0) {
                ring_fail(&L, rc);
                continue;
            }
        }

        /* Reap: with overlap, whatever is ready; without, everything in flight. */
        while (L.inflight > 0) {
            struct io_uring_cqe *cqe;
            int rc = io_uring_peek_cqe(&w->ring, &cqe);
            if (rc == -EAGAIN) {
                if (e->cfg.overlap_events && (L.again || __atomic_load_n(&q->head, __ATOMIC_RELAXED)))
                    break;
                rc = io_uring_wait_cqe(&w->ring, &cqe);
                if (rc == -EINTR)
                    continue;
            }
            if (rc < 0) {
                ring_fail(&L, rc);
                break;
            }
            reap_one(&L, cqe);
            if (e->cfg.overlap_events && L.inflight > 0 && io_uring_cq_ready(&w->ring) == 0)
                break; /* go top up the ring */
        }
    }
    return NULL;
}

#endif /* OFL_HAVE_URING */

/* ---------------------------------------------------------------- engine */

static void engine_stop_workers(ofl_engine *e)
{
    for (int i = 0; i < e->nqueues; i++) {
        pthread_mutex_lock(&e->queues[i].mu);
        e->queues[i].stop = 1;
        pthread_cond_broadcast(&e->queues[i].cv);
        pthread_mutex_unlock(&e->queues[i].mu);
    }
    for (int i = 0; i < e->nworkers; i++) {
        if (e->workers[i].started)
            pthread_join(e->workers[i].thread, NULL);
#ifdef OFL_HAVE_URING
        if (e->workers[i].ring_ok)
            io_uring_queue_exit(&e->workers[i].ring);
#endif
    }
}

static void engine_free(ofl_engine *e)
{
    for (int i = 0; i < e->nqueues; i++)
        queue_destroy(&e->queues[i]);
    free(e->queues);
    free(e->workers);
    free(e->fixed_addrs);
    free(e->fixed_lens);
    pthread_cond_destroy(&e->hash_cv);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

static int start_threads(ofl_engine *e)
{
    int n = e->cfg.thread_count * e->cfg.queue_depth;
    if (n > OFL_MAX_THREADS)
        n = OFL_MAX_THREADS;
    if (n < e->cfg.thread_count)
        n = e->cfg.thread_count;
    e->queues = calloc(1, sizeof(ofl_queue));
    e->workers = calloc((size_t)n, sizeof(ofl_worker));
    if (!e->queues || !e->workers)
        return -ENOMEM;
    int rc = queue_init(&e->queues[0]);
    if (rc)
        return rc;
    e->nqueues = 1;
    e->nworkers = n;
    for (int i = 0; i < n; i++) {
        e->workers[i].e = e;
        e->workers[i].q = &e->queues[0];
        rc = -pthread_create(&e->workers[i].thread, NULL, thread_worker, &e->workers[i]);
        if (rc)
            return rc;
        e->workers[i].started = 1;
    }
    e->backend = OFL_BACKEND_THREADS;
    return 0;
}

#ifdef OFL_HAVE_URING
static int start_urings(ofl_engine *e)
{
    int refused = __atomic_load_n(&ofl_refuse_uring, __ATOMIC_ACQUIRE);
    if (refused > 0)
        return -refused;
    int n = e->cfg.thread_count;
    e->queues = calloc((size_t)n, sizeof(ofl_queue));
    e->workers = calloc((size_t)n, sizeof(ofl_worker));
    if (!e->queues || !e->workers)
        return -ENOMEM;
    /* Rings first: if the kernel refuses io_uring we learn it before any thread runs. */
    for (int i = 0; i < n; i++) {
        int rc = queue_init(&e->queues[i]);
        if (rc)
            return rc;
        e->nqueues++;
        e->nworkers++;
        e->workers[i].e = e;
        e->workers[i].q = &e->queues[i];
        rc = io_uring_queue_init(ring_entries(e->cfg.queue_depth), &e->workers[i].ring, 0);
        if (rc)
            return rc;
        e->workers[i].ring_ok = 1;
    }
    for (int i = 0; i < n; i++) {
        int rc = -pthread_create(&e->workers[i].thread, NULL, uring_worker, &e->workers[i]);
        if (rc)
            return rc;
        e->workers[i].started = 1;
    }
    e->backend = OFL_BACKEND_IO_URING;
    return 0;
}

/* Undo a partial start_urings so that threads can be tried instead. */
static void undo_start(ofl_engine *e)
{
    engine_stop_workers(e);
    for (int i = 0; i < e->nqueues; i++)
        queue_destroy(&e->queues[i]);
    free(e->queues);
    free(e->workers);
    e->queues = NULL;
    e->workers = NULL;
    e->nqueues = e->nworkers = 0;
}
#endif

int ofl_engine_create(const ofl_config *cfg, ofl_engine **out)
{
    if (!cfg || !out)
        return -EINVAL;
    *out = NULL;
    if (cfg->thread_count < 1 || cfg->queue_depth < 1 || cfg->queue_depth > 4096 || cfg->block_size < 4096 ||
        cfg->block_size > (1LL << 30) || cfg->backend < OFL_BACKEND_AUTO || cfg->backend > OFL_BACKEND_THREADS)
        return -EINVAL;
    ofl_engine *e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    e->cfg = *cfg;
    e->pid = getpid();
    if (pthread_mutex_init(&e->mu, NULL) != 0) {
        free(e);
        return -ENOMEM;
    }
    if (pthread_cond_init(&e->done_cv, NULL) != 0) {
        pthread_mutex_destroy(&e->mu);
        free(e);
        return -ENOMEM;
    }
    if (pthread_cond_init(&e->hash_cv, NULL) != 0) {
        pthread_cond_destroy(&e->done_cv);
        pthread_mutex_destroy(&e->mu);
        free(e);
        return -ENOMEM;
    }
    if (__atomic_load_n(&ofl_no_hasher, __ATOMIC_ACQUIRE))
        e->hash_started = -1;  /* as if the thread could not be created */
    e->live.next = e->live.prev = &e->live;

    int rc;
#ifdef OFL_HAVE_URING
    if (cfg->backend != OFL_BACKEND_THREADS) {
        rc = start_urings(e);
        if (rc == 0)
            goto started;
        undo_start(e);
        if (cfg->backend == OFL_BACKEND_IO_URING) {
            engine_free(e);
            return rc;
        }
        e->fallback_reason = rc;
    }
#else
    if (cfg->backend == OFL_BACKEND_IO_URING) {
        engine_free(e);
        return -ENOSYS;
    }
    e->fallback_reason = -ENOSYS;
#endif
    rc = start_threads(e);
    if (rc) {
        engine_stop_workers(e);
        engine_free(e);
        return rc;
    }
#ifdef OFL_HAVE_URING
started:
#endif
    e->stats.workers = e->nworkers;
    *out = e;
    return 0;
}

int ofl_test_refuse_io_uring(int err)
{
    if (err < 0)
        return -EINVAL;
    return __atomic_exchange_n(&ofl_refuse_uring, err, __ATOMIC_ACQ_REL);
}

int ofl_test_no_hasher(int on)
{
    return __atomic_exchange_n(&ofl_no_hasher, on != 0, __ATOMIC_ACQ_REL);
}

int ofl_engine_backend(ofl_engine *e) { return e ? e->backend : -EINVAL; }

int ofl_engine_fallback_reason(ofl_engine *e) { return e ? e->fallback_reason : -EINVAL; }

int ofl_engine_register_buffers(ofl_engine *e, void **addrs, int64_t *lens, int count)
{
    if (!e || count < 0 || (count > 0 && (!addrs || !lens)))
        return -EINVAL;
    if (OFL_FOREIGN(e))
        return -ECHILD;
    pthread_mutex_lock(&e->mu);
    if (e->live_count > 0) {
        pthread_mutex_unlock(&e->mu);
        return -EBUSY;
    }
    void **new_addrs = NULL;
    int64_t *new_lens = NULL;
    if (count > 0) {
        new_addrs = calloc((size_t)count, sizeof(void *));
        new_lens = calloc((size_t)count, sizeof(int64_t));
        if (!new_addrs || !new_lens) {
            free(new_addrs);
            free(new_lens);
            pthread_mutex_unlock(&e->mu);
            return -ENOMEM;
        }
        memcpy(new_addrs, addrs, (size_t)count * sizeof(void *));
        memcpy(new_lens, lens, (size_t)count * sizeof(int64_t));
    }
    int rc = 0;
#ifdef OFL_HAVE_URING
    if (e->backend == OFL_BACKEND_IO_URING) {
        struct iovec *iov = count ? calloc((size_t)count, sizeof(*iov)) : NULL;
        if (count && !iov) {
            rc = -ENOMEM;
        } else {
            for (int i = 0; i < count; i++) {
                iov[i].iov_base = addrs[i];
                iov[i].iov_len = (size_t)lens[i];
            }
            for (int i = 0; i < e->nworkers && rc == 0; i++) {
                if (e->workers[i].fixed_ok)
                    io_uring_unregister_buffers(&e->workers[i].ring);
                e->workers[i].fixed_ok = 0;
                if (count > 0) {
                    rc = io_uring_register_buffers(&e->workers[i].ring, iov, (unsigned)count);
                    e->workers[i].fixed_ok = rc == 0;
                }
            }
            if (rc < 0) {
                /* All or nothing: the engine then uses plain reads and writes everywhere. */
                for (int i = 0; i < e->nworkers; i++) {
                    if (e->workers[i].fixed_ok)
                        io_uring_unregister_buffers(&e->workers[i].ring);
                    e->workers[i].fixed_ok = 0;
                }
            }
            free(iov);
        }
    }
#endif
    free(e->fixed_addrs);
    free(e->fixed_lens);
    if (rc < 0) {
        free(new_addrs);
        free(new_lens);
        e->fixed_addrs = NULL;
        e->fixed_lens = NULL;
        e->fixed_count = 0;
    } else {
        e->fixed_addrs = new_addrs;
        e->fixed_lens = new_lens;
        e->fixed_count = count;
    }
    e->stats.fixed_buffers = e->backend == OFL_BACKEND_IO_URING ? e->fixed_count : 0;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int ofl_engine_submit(ofl_engine *e, int op, ofl_segment *segs, int nsegs, ofl_request **out)
{
    return ofl_engine_submit_flags(e, op, segs, nsegs, 0, out);
}

static void request_release(ofl_request *r)
{
    free(r->pieces);
    free(r);
}

int ofl_engine_submit_flags(ofl_engine *e, int op, ofl_segment *segs, int nsegs, int flags, ofl_request **out)
{
    if (!e || !out || nsegs < 0 || (nsegs > 0 && !segs) || (op != OFL_OP_READ && op != OFL_OP_WRITE)
        || (flags & ~OFL_REQ_DIGEST))
        return -EINVAL;
#ifndef OFL_HAVE_XXHASH
    if (flags & OFL_REQ_DIGEST)
        return -ENOTSUP;
#endif
    *out = NULL;
    if (OFL_FOREIGN(e))
        return -ECHILD;
    const int64_t bs = e->cfg.block_size;
    int64_t npieces = 0;
    for (int i = 0; i < nsegs; i++) {
        if (segs[i].len < 0 || segs[i].offset < 0 || segs[i].fd < 0 || (!segs[i].buf && segs[i].len > 0))
            return -EINVAL;
        npieces += (segs[i].len + bs - 1) / bs;
    }

    ofl_request *r = calloc(1, sizeof(*r));
    ofl_piece *pieces = npieces ? calloc((size_t)npieces, sizeof(ofl_piece)) : NULL;
    if (!r || (npieces && !pieces)) {
        free(r);
        free(pieces);
        return -ENOMEM;
    }
    r->pieces = pieces;
    r->pending = npieces;
    r->npieces = npieces;
    r->op = op;
    r->want_digest = (flags & OFL_REQ_DIGEST) != 0;
    int64_t total = 0, k = 0;
    for (int i = 0; i < nsegs; i++) {
        for (int64_t pos = 0; pos < segs[i].len; pos += bs, k++) {
            ofl_piece *p = &pieces[k];
            p->req = r;
            p->op = op;
            p->fd = segs[i].fd;
            p->buf_index = segs[i].buf_index;
            p->seg = i;
            p->buf = (char *)segs[i].buf + pos;
            p->offset = segs[i].offset + pos;
            p->len = segs[i].len - pos < bs ? segs[i].len - pos : bs;
            p->rel = total + pos;
            p->obuf = p->buf;
            p->olen = p->len;
        }
        total += segs[i].len;
    }
    r->total = total;
    r->eof_at = total;

    /*
     * Checked under the same lock that makes the request live, so the table cannot change in
     * between (registration waits for no live requests): a fixed op on memory outside its
     * registered buffer would fail in the kernel.
     */
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < nsegs; i++) {
        if (segs[i].buf_index < 0 || e->fixed_count == 0)
            continue; /* no table (off, or registration failed): plain ops are used */
        int ok = 0;
        if (segs[i].buf_index < e->fixed_count) {
            char *base = e->fixed_addrs[segs[i].buf_index];
            char *b = segs[i].buf;
            ok = b >= base && b + segs[i].len <= base + e->fixed_lens[segs[i].buf_index];
        }
        if (!ok) {
            pthread_mutex_unlock(&e->mu);
            request_release(r);
            return -EINVAL;
        }
    }
    r->next = &e->live;
    r->prev = e->live.prev;
    e->live.prev->next = r;
    e->live.prev = r;
    e->live_count++;
    if (npieces == 0) {
        if (r->want_digest) {
            r->has_digest = request_hash(r, &r->digest) == 0;  /* no pieces: the digest of nothing */
            r->hashed = 1;
        }
        r->done = 1;
        e->stats.requests++;
    } else if (r->want_digest && op == OFL_OP_WRITE) {
        for (int64_t t = 0; t < npieces; t++)
            hash_enqueue_locked(e, &pieces[t]);  /* the bytes are final: hashed while they are written */
    }
    uint64_t start = e->rr++;
    pthread_mutex_unlock(&e->mu);

    /* Contiguous runs of pieces go to the same queue, so each ring sees sequential offsets. */
    int nq = e->nqueues;
    int64_t i = 0;
    while (i < npieces) {
        int qi = (int)((start + (uint64_t)((i * nq) / npieces)) % (uint64_t)nq);
        int64_t j = i;
        while (j + 1 < npieces && (int)((start + (uint64_t)(((j + 1) * nq) / npieces)) % (uint64_t)nq) == qi)
            j++;
        for (int64_t t = i; t < j; t++)
            pieces[t].next = &pieces[t + 1];
        queue_push_chain(&e->queues[qi], &pieces[i], &pieces[j]);
        i = j + 1;
    }
    *out = r;
    return 0;
}

int ofl_request_wait(ofl_engine *e, ofl_request *r, int64_t *result, int *err_seg, int64_t *err_offset)
{
    if (!e || !r)
        return -EINVAL;
    if (OFL_FOREIGN(e))
        return -ECHILD;
    pthread_mutex_lock(&e->mu);
    while (!r->done)
        pthread_cond_wait(&e->done_cv, &e->mu);
    int err = r->error;
    if (result)
        *result = err ? r->moved : r->eof_at;
    if (err_seg)
        *err_seg = err ? r->err_seg : -1;
    if (err_offset)
        *err_offset = err ? r->err_offset : -1;
    pthread_mutex_unlock(&e->mu);
    return err;
}

int ofl_request_digest(ofl_engine *e, ofl_request *r, uint64_t *out)
{
    if (!e || !r || !out)
        return -EINVAL;
    if (OFL_FOREIGN(e))
        return -ECHILD;
    pthread_mutex_lock(&e->mu);
    int ok = r->done && r->has_digest;
    if (ok)
        *out = r->digest;
    pthread_mutex_unlock(&e->mu);
    return ok ? 0 : -ENODATA;
}

int ofl_request_done(ofl_engine *e, ofl_request *r)
{
    if (!e || !r)
        return -EINVAL;
    if (OFL_FOREIGN(e))
        return -ECHILD;
    pthread_mutex_lock(&e->mu);
    int done = r->done;
    pthread_mutex_unlock(&e->mu);
    return done;
}

static void request_unlink_free(ofl_engine *e, ofl_request *r)
{
    r->prev->next = r->next;
    r->next->prev = r->prev;
    e->live_count--;
    request_release(r);
}

void ofl_request_free(ofl_engine *e, ofl_request *r)
{
    if (!e || !r || OFL_FOREIGN(e))
        return;
    pthread_mutex_lock(&e->mu);
    while (!r->done)
        pthread_cond_wait(&e->done_cv, &e->mu);
    request_unlink_free(e, r);
    pthread_mutex_unlock(&e->mu);
}

int ofl_engine_inject_fault(ofl_engine *e, int op, int kind, int64_t skip, int64_t count, int err)
{
    if (!e || kind < OFL_FAULT_NONE || kind > OFL_FAULT_ERROR || skip < 0 || count < -1 ||
        (kind == OFL_FAULT_ERROR && err <= 0) || op < -1 || op > OFL_OP_WRITE)
        return -EINVAL;
    if (OFL_FOREIGN(e))
        return -ECHILD;
    pthread_mutex_lock(&e->mu);
    e->fault_op = op;
    e->fault_kind = kind;
    e->fault_skip = skip;
    e->fault_count = count;
    e->fault_err = err;
    __atomic_store_n(&e->fault_armed, kind != OFL_FAULT_NONE && count != 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->mu);
    return 0;
}

void ofl_engine_stats(ofl_engine *e, ofl_stats *out)
{
    if (!e || !out)
        return;
    if (OFL_FOREIGN(e)) {
        memset(out, 0, sizeof(*out));
        return;
    }
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
}

void ofl_engine_destroy(ofl_engine *e)
{
    if (!e)
        return;
    if (OFL_FOREIGN(e))
        return; /* in a forked child: the memory is a copy, leaked on purpose; the threads are not here */
    /* Buffers may still be the target of I/O: wait for every request before anything goes. */
    pthread_mutex_lock(&e->mu);
    for (ofl_request *r = e->live.next; r != &e->live; r = r->next)
        while (!r->done)
            pthread_cond_wait(&e->done_cv, &e->mu);
    e->hash_stop = 1;
    pthread_cond_broadcast(&e->hash_cv);
    int joined = e->hash_started == 1;
    pthread_mutex_unlock(&e->mu);
    if (joined)
        pthread_join(e->hash_thread, NULL);
    engine_stop_workers(e);
    while (e->live.next != &e->live)
        request_unlink_free(e, e->live.next);
    engine_free(e);
}

int ofl_dio_alignment(int fd, uint32_t *mem_align, uint32_t *offset_align)
{
    if (mem_align)
        *mem_align = 0;
    if (offset_align)
        *offset_align = 0;
#if defined(SYS_statx) && defined(STATX_DIOALIGN)
    struct statx stx;
    memset(&stx, 0, sizeof(stx));
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0)
        return -errno;
    if (stx.stx_mask & STATX_DIOALIGN) {
        if (mem_align)
            *mem_align = stx.stx_dio_mem_align;
        if (offset_align)
            *offset_align = stx.stx_dio_offset_align;
    }
    return 0;
#else
    (void)fd;
    return -EOPNOTSUPP;
#endif
}

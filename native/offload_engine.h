/*
 * nvme-offload native engine: the whole boundary between C and Python.
 *
 * This header is also read verbatim as the cffi cdef (offload/_build.py), so it holds only what
 * crosses the boundary and no preprocessor logic beyond integer #defines.
 *
 * Conventions: every function that can fail returns 0 (or a count) on success and -errno on
 * failure; errno is never relied upon. Nothing here prints or aborts. In a process forked after an
 * engine was created, every call on that engine returns -ECHILD (or does nothing) at once: the
 * child has none of the engine's threads.
 */

#define OFL_OP_READ 0
#define OFL_OP_WRITE 1

#define OFL_BACKEND_AUTO 0
#define OFL_BACKEND_IO_URING 1
#define OFL_BACKEND_THREADS 2

/* Request flags. */
#define OFL_REQ_DIGEST 1      /* a digest of the bytes moved: see ofl_engine_submit_flags */

#define OFL_FAULT_NONE 0
#define OFL_FAULT_SHORT 1
#define OFL_FAULT_ERROR 2

typedef struct ofl_engine ofl_engine;
typedef struct ofl_request ofl_request;

typedef struct {
    int backend;          /* OFL_BACKEND_* asked for */
    int thread_count;     /* worker threads, each with its own ring (io_uring) */
    int queue_depth;      /* pieces in flight per worker */
    int64_t block_size;   /* requests are split into pieces of at most this many bytes */
    int single_submit;    /* one submit call per piece instead of one per batch */
    int overlap_events;   /* refill as completions arrive instead of submit-all-then-wait */
} ofl_config;

/* One contiguous transfer between a host buffer and a file. A request is a list of these. */
typedef struct {
    int fd;
    int buf_index;        /* index of a registered buffer holding buf, or -1 */
    void *buf;
    int64_t len;
    int64_t offset;       /* file offset */
} ofl_segment;

typedef struct {
    int64_t requests;     /* requests completed */
    int64_t pieces;       /* pieces completed */
    int64_t bytes;        /* bytes transferred */
    int64_t resubmits;    /* short transfers whose remainder was queued again */
    int64_t retries;      /* pieces retried after -EAGAIN or -EINTR */
    int64_t failures;     /* pieces that completed with an error */
    int fixed_buffers;    /* buffers registered with every ring (0: plain read/write) */
    int workers;          /* rings (io_uring) or threads (threads backend) */
} ofl_stats;

/* Version string compiled into the extension; must equal the package version. */
const char *ofl_version(void);

/* 1 if the extension was built against liburing, else 0. */
int ofl_have_io_uring(void);

/* 1 if the extension was built against libxxhash (request digests), else 0. */
int ofl_have_xxhash(void);

/* Start an engine. With OFL_BACKEND_AUTO, falls back to threads when io_uring is refused. */
int ofl_engine_create(const ofl_config *cfg, ofl_engine **out);

/* The backend actually running (OFL_BACKEND_IO_URING or OFL_BACKEND_THREADS). */
int ofl_engine_backend(ofl_engine *e);

/* Why AUTO fell back to threads: 0, or the -errno io_uring setup returned. */
int ofl_engine_fallback_reason(ofl_engine *e);

/*
 * Testing hook, process-wide: with err > 0 every later io_uring start fails with -err (so AUTO
 * falls back to threads and IO_URING is refused); 0 stops it. Returns the previous value.
 */
int ofl_test_refuse_io_uring(int err);

/*
 * Testing hook, process-wide: with on != 0 engines created later never start a hasher thread and hash
 * on the threads that complete or submit requests instead (as when the thread cannot be created).
 * Returns the previous value.
 */
int ofl_test_no_hasher(int on);

/* Register host buffers as fixed buffers with every ring. -EBUSY while requests are live. */
int ofl_engine_register_buffers(ofl_engine *e, void **addrs, int64_t *lens, int count);

/* Queue a request of nsegs segments; *out is owned by the caller until ofl_request_free. */
int ofl_engine_submit(ofl_engine *e, int op, ofl_segment *segs, int nsegs, ofl_request **out);

/*
 * ofl_engine_submit with flags. With OFL_REQ_DIGEST (and libxxhash; else -ENOTSUP) the request gets a
 * digest of the bytes it moved: the xxh3_64 of the sequence of its pieces' xxh3_64 (each piece is
 * block_size bytes of a segment, the last of a segment shorter), as 64-bit little-endian words. A
 * read's pieces are hashed as they land, a write's on the engine's hasher thread while they are
 * written; the request counts as done only once its digest is there.
 */
int ofl_engine_submit_flags(ofl_engine *e, int op, ofl_segment *segs, int nsegs, int flags, ofl_request **out);

/*
 * The digest of a completed OFL_REQ_DIGEST request: 0, or -ENODATA (none asked for, the request failed,
 * or there was no memory to compute it: the caller then computes it from the buffers itself).
 */
int ofl_request_digest(ofl_engine *e, ofl_request *r, uint64_t *out);

/*
 * Block until the request has completed. Returns 0 and sets *result to the bytes transferred
 * (a read stops at end of file: *result is then the length of the prefix read), or returns
 * -errno of the first failed piece with *err_seg and *err_offset naming its segment and offset.
 */
int ofl_request_wait(ofl_engine *e, ofl_request *r, int64_t *result, int *err_seg, int64_t *err_offset);

/* 1 if the request has completed, else 0. Never blocks. */
int ofl_request_done(ofl_engine *e, ofl_request *r);

/* Wait for the request if needed, then release it. */
void ofl_request_free(ofl_engine *e, ofl_request *r);

/*
 * Testing hook: after letting `skip` matching pieces pass, affect the next `count` (-1: all).
 * op: OFL_OP_READ, OFL_OP_WRITE or -1 for both. OFL_FAULT_SHORT submits half the piece so the
 * engine must resubmit the remainder; OFL_FAULT_ERROR completes the piece with -err unsent.
 */
int ofl_engine_inject_fault(ofl_engine *e, int op, int kind, int64_t skip, int64_t count, int err);

void ofl_engine_stats(ofl_engine *e, ofl_stats *out);

/*
 * Wait for everything in flight, stop the workers and free the engine and any live requests.
 * In a forked child it returns at once and leaks the copy (the workers exist only in the parent).
 */
void ofl_engine_destroy(ofl_engine *e);

/* Direct-I/O alignment of an open file from statx (0 where the kernel does not say). */
int ofl_dio_alignment(int fd, uint32_t *mem_align, uint32_t *offset_align);

/* kvferry's native layer over UCX ucp (implemented in kvf_ucp.c), in UCX's own style:
 * typed opaque handles, parameter structs whose optional fields are named by a field
 * mask, named flag constants, and ucs_status_t returns whose output parameters are set
 * only on UCS_OK.
 *
 * Single-threaded: one thread owns a worker and makes every call on it and on its
 * endpoints, memory and keys (the worker runs in UCS_THREAD_MODE_SINGLE); nothing runs in
 * the background, completions and received messages happen inside kvf_worker_progress()
 * and kvf_worker_wait().
 *
 * Batches: every posting function takes a kvf_batch_t that the caller allocates and keeps
 * alive (and unmoved) until its `outstanding` count is zero: completion callbacks write
 * into it. Posting functions always record their outcome in it, immediate errors
 * included, so the caller reads one place for the result of everything it posted.
 *
 * This file is both a C header (kvf_ucp.c and the cffi module include it) and, between
 * the KVF_CDEF markers, the declarations that build_ucp.py hands to cffi's cdef: that
 * part is plain C without preprocessor lines, and the only UCX type in it is
 * ucs_status_t (declared to cffi as an integer type of the size UCX gives it). */
#ifndef KVF_UCP_H
#define KVF_UCP_H

#include <stddef.h>
#include <stdint.h>
#include <ucs/type/status.h>

/* KVF_CDEF_BEGIN */

/* ------------------------------------------------------------------------- handles */

/* A UCX context and worker with kvferry's receive queue (kvf_worker_create). */
typedef struct kvf_worker *kvf_worker_h;
/* An endpoint to a peer's worker (a ucp_ep_h; kvf_ep_create). */
typedef struct kvf_ep *kvf_ep_h;
/* Memory mapped for remote access (a ucp_mem_h; kvf_mem_map). */
typedef struct kvf_mem *kvf_mem_h;
/* A peer's unpacked remote key (a ucp_rkey_h; kvf_rkey_unpack). */
typedef struct kvf_rkey *kvf_rkey_h;

/* --------------------------------------------------------------------------- flags */

/* kvf_worker_params_t.field_mask: which optional fields are set (else the default). */
typedef enum {
    KVF_WORKER_PARAM_FIELD_OPTIONS      = 0x01, /* default: no ucp_config_modify */
    KVF_WORKER_PARAM_FIELD_MAX_SENDER   = 0x02, /* default: max_am_bytes */
    KVF_WORKER_PARAM_FIELD_MAX_PAYLOAD  = 0x04, /* default: max_am_bytes */
    KVF_WORKER_PARAM_FIELD_BUSY_POLL_US = 0x08, /* default: 0 */
    KVF_WORKER_PARAM_FIELD_SPIN_US      = 0x10, /* default: 0 */
    KVF_WORKER_PARAM_FIELD_BAD_OPTION   = 0x20  /* default: not reported */
} kvf_worker_param_field_t;

/* Flags of kvf_worker_wait(). */
typedef enum {
    KVF_WAIT_FLAG_STAY_AWAKE = 0x01 /* poll for all of the timeout, never sleep */
} kvf_wait_flags_t;

/* Flags of kvf_ep_close(). */
typedef enum {
    KVF_EP_CLOSE_FLAG_FORCE = 0x01 /* sever: in-flight requests end UCS_ERR_CANCELED */
} kvf_ep_close_flags_t;

/* kvf_mem_map_params_t.flags. */
typedef enum {
    KVF_MEM_MAP_FLAG_ALLOCATE = 0x01 /* UCX allocates (posix/sysv shared memory; host only) */
} kvf_mem_map_flags_t;

/* kvf_mem_map_params_t.field_mask: which optional fields are set. */
typedef enum {
    KVF_MEM_MAP_PARAM_FIELD_ADDRESS     = 0x01, /* default: NULL (with ALLOCATE) */
    KVF_MEM_MAP_PARAM_FIELD_FLAGS       = 0x02, /* default: 0 */
    KVF_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 0x04  /* default: KVF_MEMORY_TYPE_HOST */
} kvf_mem_map_param_field_t;

/* Memory types kvferry maps (kvf_mem_map_params_t.memory_type), as UCX's
 * UCS_MEMORY_TYPE_HOST and UCS_MEMORY_TYPE_CUDA. kvf_memory_types() reports a mask of
 * KVF_MEMORY_TYPE_FLAG(type) bits, i.e. 1 << type. */
typedef enum {
    KVF_MEMORY_TYPE_HOST = 0, /* ordinary host memory */
    KVF_MEMORY_TYPE_CUDA = 1  /* CUDA device memory (cudaMalloc), mapped for cuda_ipc/cuda_copy */
} kvf_memory_type_t;

/* kvf_rma_param_t.field_mask: which optional fields are set. */
typedef enum {
    KVF_RMA_PARAM_FIELD_DIRECT_BASE         = 0x01, /* default: post through UCX */
    KVF_RMA_PARAM_FIELD_STREAMING_MIN_BYTES = 0x02, /* default: never stream */
    KVF_RMA_PARAM_FIELD_SKIP_PAGE           = 0x04, /* default: skip none */
    KVF_RMA_PARAM_FIELD_NOTICE              = 0x08, /* default: no notice (puts only) */
    KVF_RMA_PARAM_FIELD_PEER_PROCESS        = 0x10, /* default: post through UCX */
    KVF_RMA_PARAM_FIELD_LOCAL_MEMORY_TYPE   = 0x20  /* default: local_base is host memory */
} kvf_rma_param_field_t;

/* kvf_msg_param_t.flags. */
typedef enum {
    KVF_MSG_FLAG_NOTICE = 0x01, /* a notice: its envelope is marked flushed */
    KVF_MSG_FLAG_FLUSH  = 0x02  /* post it only after an endpoint flush completes */
} kvf_msg_flags_t;

/* kvf_envelope_t.flags: the envelope's flag byte on the wire (transfer/envelope.py). */
typedef enum {
    KVF_ENVELOPE_FLAG_FLUSHED = 0x01 /* sent by notify: the data before it is visible */
} kvf_envelope_flags_t;

/* Why kvf_envelope_parse() refused an envelope (numbered as in transfer/envelope.py). */
typedef enum {
    KVF_ENVELOPE_OK               = 0,
    KVF_ENVELOPE_SHORT            = 1,
    KVF_ENVELOPE_MAGIC            = 2,
    KVF_ENVELOPE_VERSION_MISMATCH = 3,
    KVF_ENVELOPE_FLAGS            = 4,
    KVF_ENVELOPE_SENDER_SIZE      = 5,
    KVF_ENVELOPE_PAYLOAD_SIZE     = 6,
    KVF_ENVELOPE_LENGTH           = 7
} kvf_envelope_error_t;

/* Flags of kvf_memcpy_pages(). */
typedef enum {
    KVF_COPY_FLAG_STREAMING = 0x01 /* non-temporal stores, then a store fence */
} kvf_copy_flags_t;

/* ------------------------------------------------------------------------- structs */

/* Completion tracker of one batch (owned by the caller, see above). `status` holds the
 * first error (0: none so far); `posted` counts the pages posted (direct copies
 * included), `direct` those copied directly, `bytes` the batch's page bytes. */
typedef struct kvf_batch {
    int64_t outstanding;
    int32_t status;
    int64_t posted;
    int64_t direct;
    int64_t bytes;
} kvf_batch_t;

/* kvf_mem_map()'s parameters. length is required; address unless
 * KVF_MEM_MAP_FLAG_ALLOCATE is among the flags. */
typedef struct kvf_mem_map_params {
    uint64_t field_mask;    /* kvf_mem_map_param_field_t */
    void *address;
    size_t length;
    unsigned flags;         /* kvf_mem_map_flags_t */
    int32_t memory_type;    /* kvf_memory_type_t */
} kvf_mem_map_params_t;

/* kvf_worker_create()'s parameters. max_am_bytes is required: the largest active message
 * accepted on receipt (larger ones, and rendezvous ones, are dropped and counted). */
typedef struct kvf_worker_params {
    uint64_t field_mask;    /* kvf_worker_param_field_t */
    int64_t max_am_bytes;
    const char *options;    /* "KEY=VALUE" lines for ucp_config_modify (keys without UCX_) */
    int64_t max_sender;     /* envelope limits applied on receipt */
    int64_t max_payload;
    int64_t busy_poll_us;   /* kvf_worker_wait: keep polling this long after activity */
    int64_t spin_us;        /* kvf_worker_wait: poll at least this long before sleeping */
    char *bad_option;       /* receives the key of a refused option (NUL-terminated) */
    size_t bad_option_length;
} kvf_worker_params_t;

/* A message as kvf_msg_send() and kvf_envelope_encode() build it: the envelope's fields
 * and the payload (copied; the caller's buffers may go once the call returns). */
typedef struct kvf_msg_param {
    uint32_t flags;         /* kvf_msg_flags_t */
    uint64_t incarnation;
    uint64_t seq;
    const char *sender;     /* the sender's address (1 byte or more) */
    size_t sender_length;
    const char *payload;
    size_t payload_length;
} kvf_msg_param_t;

/* One batch of pages between a local and a remote segment (kvf_put_pages,
 * kvf_get_pages). `pages` points to `npages` int64 triples (local offset, remote offset,
 * length): every page is checked against both segments before anything is posted. The
 * required fields are the segments and the pages; the optional ones are named in
 * field_mask (kvf_rma_param_field_t):
 *   direct_base: this process's mapping of the remote segment (ucp_rkey_ptr): pages are
 *     copied with loads and stores, no UCX request;
 *   streaming_min_bytes: direct writes of batches of at least this many bytes use
 *     streaming stores (negative: never);
 *   skip_page: an injected fault for tests: this page is counted but never transferred;
 *   notice: (puts only) the message to post after the pages, behind an endpoint flush
 *     when a page went through UCX or notice->flags has KVF_MSG_FLAG_FLUSH;
 *   peer_pid, peer_pidfd: the remote segment lives in this process on this host (its
 *     pidfd held open by the caller): pages are moved by the kernel's cross-memory copy,
 *     up to KVF_CMA_IOVS pages a system call, no UCX request. The pidfd is polled before
 *     the first call and after the last: a process that exited fails the batch with
 *     UCS_ERR_CONNECTION_RESET (as a put to a dead process fails). Ignored with
 *     direct_base;
 *   local_memory_type: the kvf_memory_type_t of the local segment, which every UCX
 *     request of the batch tells UCX (its protocol depends on it: a device pointer
 *     passed as host memory is read by the CPU). Host memory when not set. */
typedef struct kvf_rma_param {
    uint64_t field_mask;    /* kvf_rma_param_field_t */
    uintptr_t local_base;
    int64_t local_length;
    kvf_rkey_h rkey;
    uint64_t remote_base;
    int64_t remote_length;
    const int64_t *pages;
    int64_t npages;
    uintptr_t direct_base;
    int64_t streaming_min_bytes;
    int64_t skip_page;
    const kvf_msg_param_t *notice;
    int32_t peer_pid;
    int32_t peer_pidfd;
    int32_t local_memory_type; /* kvf_memory_type_t */
} kvf_rma_param_t;

/* The ucs_memory_type_t that the UCX requests of a batch with these parameters carry for
 * the local buffer (UCS_MEMORY_TYPE_HOST unless local_memory_type says CUDA). */
int32_t kvf_rma_ucs_memory_type(const kvf_rma_param_t *param);

/* A parsed message envelope (layout in transfer/envelope.py). `error` is
 * KVF_ENVELOPE_OK for a well-formed envelope, else a kvf_envelope_error_t; the pointers
 * point into the message's own bytes. */
typedef struct kvf_envelope {
    int32_t error;
    int32_t flags;          /* kvf_envelope_flags_t */
    uint64_t incarnation;
    uint64_t seq;
    const char *sender;
    size_t sender_length;
    const char *payload;
    size_t payload_length;
} kvf_envelope_t;

/* One received active message, copied out of UCX's buffer inside the callback; its
 * envelope is already parsed (env.error says whether it is well formed). */
typedef struct kvf_msg {
    struct kvf_msg *next;
    size_t length;
    char *data;
    kvf_envelope_t env;
} kvf_msg_t;

/* -------------------------------------------------------------------- UCX and build */

/* The running UCX's version string (static storage). */
const char *kvf_version_string(void);
/* The file the running libucp was loaded from, or "" (static storage). */
const char *kvf_library_path(void);
/* The UCP API version of the headers this was built against, and of the running UCX. */
void kvf_ucx_versions(unsigned *build_major, unsigned *build_minor, unsigned *run_major,
                      unsigned *run_minor, unsigned *run_release);
/* Comma-separated names of the optional features compiled in ("ep_transports"), static. */
const char *kvf_features(void);
/* What UCX offers below ucp into out (NUL-terminated, truncated to cap): a line per uct
 * component, "name<TAB>md md ...", and for each memory domain of the components named in
 * `open` (comma-separated; opening one opens its device) "name<TAB>md<TAB> tl/dev ...".
 * UCS_OK, or the status of the failed component query. */
ucs_status_t kvf_uct_inventory(const char *open, char *out, size_t cap);
/* The value transport `tl` of uct component `component` would use for its interface
 * option `name` (the environment, else UCX's default) into value (cap bytes, "" unless
 * UCS_OK). UCS_ERR_NO_ELEM: no such option or component in this UCX;
 * UCS_ERR_NO_DEVICE: the component has no memory domain to read it from. */
ucs_status_t kvf_uct_iface_option(const char *component, const char *tl, const char *name,
                                  char *value, size_t cap);

/* -------------------------------------------------------------------------- worker */

/* Creates a UCX context (RMA, AM, wakeup) and a single-threaded worker with the
 * envelope receive handler, and sets *worker_p. A refused configuration option returns
 * its ucp_config_modify status (e.g. UCS_ERR_NO_ELEM) with its key in bad_option when
 * KVF_WORKER_PARAM_FIELD_BAD_OPTION is set; any other UCX failure returns its status;
 * UCS_ERR_NO_MEMORY; UCS_ERR_INVALID_PARAM when max_am_bytes is not positive. Nothing
 * is left allocated on failure. Destroy with kvf_worker_destroy(). */
ucs_status_t kvf_worker_create(const kvf_worker_params_t *params, kvf_worker_h *worker_p);
/* Frees queued messages, destroys the worker and its context. Endpoints, memory and keys
 * must be released first. */
void kvf_worker_destroy(kvf_worker_h worker);
/* The worker's address (*address_p: UCX's buffer of *length_p bytes, released with
 * kvf_worker_address_release). UCS_OK or ucp_worker_get_address's status. */
ucs_status_t kvf_worker_address(kvf_worker_h worker, void **address_p, size_t *length_p);
void kvf_worker_address_release(kvf_worker_h worker, void *address);
/* The worker's event fd (owned by the worker). Always UCS_OK. */
ucs_status_t kvf_worker_efd(kvf_worker_h worker, int *fd_p);
/* Arms the event fd before the caller sleeps on it: UCS_OK when armed (the fd signals
 * the next event), UCS_ERR_BUSY when work is pending (UCX events, or received messages
 * not yet popped: progress and pop first), else ucp_worker_arm's error. */
ucs_status_t kvf_worker_arm(kvf_worker_h worker);
/* One ucp_worker_progress(); returns the number of events it processed. */
unsigned kvf_worker_progress(kvf_worker_h worker);
/* Progresses while events keep coming: until idle_us passed without one, or max_us in
 * all; returns at once when the first pass finds nothing. For a caller that runs long
 * steps between polls: a message of many fragments (each pass takes only as many as the
 * transport's queue holds, and its sender refills it as it progresses) then crosses in
 * one poll instead of one fragment burst a step.
 * Returns the events processed. The caller releases the GIL around it (cffi does). */
unsigned kvf_worker_progress_drain(kvf_worker_h worker, int max_us, int idle_us);
/* Progresses; if nothing happened, polls until the later of now + spin_us and the end
 * of the busy window (busy_poll_us after the last activity), napping 5 us between polls
 * past spin_us, then arms the event fd and sleeps in poll() for the rest of timeout_ms
 * (KVF_WAIT_FLAG_STAY_AWAKE: polls for all of it). Sets *count_p to the events of the
 * last progress and returns UCS_OK, or returns kvf_worker_arm's error (*count_p not
 * set). The caller releases the GIL around it (cffi does). */
ucs_status_t kvf_worker_wait(kvf_worker_h worker, int timeout_ms, unsigned flags,
                             unsigned *count_p);
/* The oldest received message, or NULL when none is queued. The caller owns it and
 * frees it with kvf_msg_free(). */
kvf_msg_t *kvf_am_pop(kvf_worker_h worker);
void kvf_msg_free(kvf_msg_t *msg);
/* How many received messages were dropped (oversized, rendezvous, out of memory). */
int64_t kvf_am_dropped(kvf_worker_h worker);

/* ------------------------------------------------------------------------ endpoints */

/* An endpoint to the worker whose UCX address is `address` (*ep_p). UCS_OK or
 * ucp_ep_create's status. Close it with kvf_ep_close(). */
ucs_status_t kvf_ep_create(kvf_worker_h worker, const void *address, kvf_ep_h *ep_p);
/* The endpoint's lanes as "transport/device,..." (ucp_ep_query) into out (cap bytes,
 * "" unless UCS_OK). UCS_ERR_UNSUPPORTED when built against a UCX without that query
 * (before 1.14): use kvf_ep_print_info(). */
ucs_status_t kvf_ep_transports(kvf_ep_h ep, char *out, size_t cap);
/* ucp_ep_print_info's text into out (truncated to cap - 1 bytes, NUL-terminated).
 * UCS_ERR_NO_MEMORY when it could not be captured. */
ucs_status_t kvf_ep_print_info(kvf_ep_h ep, char *out, size_t cap);
/* Closes the endpoint (KVF_EP_CLOSE_FLAG_FORCE: severs it without flushing), progressing
 * the worker for at most timeout_ms. The endpoint is gone afterwards whatever the
 * status: UCS_OK, UCS_ERR_TIMED_OUT, or the close request's status. */
ucs_status_t kvf_ep_close(kvf_worker_h worker, kvf_ep_h ep, unsigned flags, int timeout_ms);

/* -------------------------------------------------------------------------- memory */

/* The memory types the worker's UCX context can map and move (ucp_context_query's
 * memory_types) as a mask of 1 << kvf_memory_type_t bits into *mask_p, and UCX's own
 * UCS_BIT(ucs_memory_type_t) mask into *ucs_mask_p. UCS_OK or the query's status. */
ucs_status_t kvf_memory_types(kvf_worker_h worker, uint64_t *mask_p, uint64_t *ucs_mask_p);
/* Maps params->length bytes at params->address (KVF_MEM_MAP_FLAG_ALLOCATE: UCX allocates
 * them, address ignored) for remote access, as memory of params->memory_type:
 * *memh_p, and the mapped range *base_p and *length_p. UCS_OK or UCX's status;
 * UCS_ERR_UNSUPPORTED for a memory type the context lacks (kvf_memory_types: UCX's own
 * ucp_mem_map reports success for CUDA memory even when no memory domain can register
 * it, so this is checked first), UCS_ERR_INVALID_PARAM for ALLOCATE with a type other
 * than host or an unknown type. Unmap with kvf_mem_unmap(). */
ucs_status_t kvf_mem_map(kvf_worker_h worker, const kvf_mem_map_params_t *params,
                         kvf_mem_h *memh_p, void **base_p, size_t *length_p);
ucs_status_t kvf_mem_unmap(kvf_worker_h worker, kvf_mem_h memh);
/* The packed remote key of memh (*buffer_p, *size_p bytes; release the buffer with
 * kvf_rkey_buffer_release). UCS_OK or ucp_rkey_pack's status. */
ucs_status_t kvf_rkey_pack(kvf_worker_h worker, kvf_mem_h memh, void **buffer_p,
                           size_t *size_p);
void kvf_rkey_buffer_release(void *buffer);
/* A peer's packed key unpacked for ep (*rkey_p; destroy it with kvf_rkey_destroy before
 * the endpoint closes). UCS_OK or ucp_ep_rkey_unpack's status. */
ucs_status_t kvf_rkey_unpack(kvf_ep_h ep, const void *buffer, kvf_rkey_h *rkey_p);
void kvf_rkey_destroy(kvf_rkey_h rkey);
/* This process's mapping of the peer's address remote_addr (*local_p), when the key's
 * memory can be mapped here (UCX-allocated shared memory on this host). UCS_OK, or
 * ucp_rkey_ptr's status (UCS_ERR_UNREACHABLE: not mappable; post through UCX). */
ucs_status_t kvf_rkey_ptr(kvf_rkey_h rkey, uint64_t remote_addr, void **local_p);
/* Populates this process's page tables for a mapped peer segment (writable), so the
 * first write to each page takes no fault. Returns 0, or errno (EINVAL before Linux
 * 5.14, which lacks MADV_POPULATE_WRITE: the mapping then faults lazily). */
int kvf_prefault(uintptr_t address, int64_t length);

/* ------------------------------------------------------------------------- batches */

/* One call per batch of puts: checks every page against both segments, then posts them
 * all (copies them directly when direct_base is set), then, if a page went through UCX,
 * an endpoint flush, so the batch completes only once every page is visible at the
 * target; with a notice, then posts it (kvf_msg_send) on the same batch, not if posting
 * a page failed. Returns UCS_OK when the batch was posted (its requests' errors,
 * immediate ones included, land in batch->status; posted, direct and bytes are set);
 * UCS_ERR_OUT_OF_RANGE when a page lies outside a segment or has a non-positive length:
 * nothing was posted and *batch is untouched (kvf_check_pages names the page). */
ucs_status_t kvf_put_pages(kvf_ep_h ep, const kvf_rma_param_t *param, kvf_batch_t *batch);
/* As kvf_put_pages for gets (the batch completes when the data is in local memory; no
 * flush). UCS_ERR_INVALID_PARAM with a notice. */
ucs_status_t kvf_get_pages(kvf_ep_h ep, const kvf_rma_param_t *param, kvf_batch_t *batch);
/* An endpoint flush: the batch completes once every earlier put on ep is visible at the
 * target. Returns the posting's status (also recorded in the batch). */
ucs_status_t kvf_flush(kvf_ep_h ep, kvf_batch_t *batch);
/* Whether this process may move bytes into process `pid` by cross-memory copy: one byte
 * read at remote_addr with process_vm_readv. 0, or the errno that refused it (EPERM:
 * ptrace rules forbid it; ESRCH: no such process; EFAULT: not mapped there). */
int kvf_cma_probe(int32_t pid, uint64_t remote_addr);
/* Builds msg's envelope straight into the send buffer and posts it as an eager active
 * message (behind an endpoint flush with KVF_MSG_FLAG_FLUSH: it then cannot overtake any
 * earlier put; the caller may leave the flag out only when no put through UCX can still
 * be outstanding on ep). Returns the posting's status (also recorded in the batch);
 * UCS_ERR_MESSAGE_TRUNCATED when a length exceeds the envelope's 32-bit fields. */
ucs_status_t kvf_msg_send(kvf_ep_h ep, const kvf_msg_param_t *msg, kvf_batch_t *batch);
/* Posts `length` bytes as they are (no envelope: the caller's business), behind an
 * endpoint flush with KVF_MSG_FLAG_FLUSH. Returns as kvf_msg_send. */
ucs_status_t kvf_raw_send(kvf_ep_h ep, const void *data, size_t length, unsigned flags,
                          kvf_batch_t *batch);

/* ------------------------------------------------------------- envelopes and pages */

/* msg's envelope into out: returns its size, or 0 when it does not fit in cap or a
 * length exceeds 32 bits. KVF_MSG_FLAG_NOTICE sets KVF_ENVELOPE_FLAG_FLUSHED. */
size_t kvf_envelope_encode(const kvf_msg_param_t *msg, char *out, size_t cap);
/* Checks every header field of the `length` bytes at data and that the lengths add up
 * to exactly `length`; fills *out (pointers into data) and returns out->error:
 * KVF_ENVELOPE_OK or the kvf_envelope_error_t of the first field that fails. */
int kvf_envelope_parse(const char *data, size_t length, int64_t max_sender,
                       int64_t max_payload, kvf_envelope_t *out);
/* The index of the first of n pages outside [0, local_len) / [0, remote_len) or with a
 * non-positive length (overflow-safe), or -1 when all are in bounds; *total gets the
 * byte count only then. The check kvf_put_pages and kvf_get_pages run. */
int64_t kvf_check_pages(const int64_t *pages, int64_t n, int64_t local_len,
                        int64_t remote_len, int64_t *total);
/* Copies n pages from src to dst as the direct path does (KVF_COPY_FLAG_STREAMING:
 * streaming stores and a store fence); the benchmark's ceiling. Pages are not checked. */
void kvf_memcpy_pages(char *dst, const char *src, const int64_t *pages, int64_t n,
                      unsigned flags);

/* KVF_CDEF_END */

#endif /* KVF_UCP_H */

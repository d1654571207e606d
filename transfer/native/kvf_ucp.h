/* Declarations shared by the cffi cdef and the C implementation (kvf_ucp.c).
 * Kept free of UCX types so that cffi's parser sees only plain C. */
typedef struct kvf_worker kvf_worker;

/* Completion tracker for one batch: the Python side owns the memory and keeps it
 * alive until `outstanding` reaches zero. `status` holds the first error (0 = OK). */
typedef struct kvf_batch {
    int64_t outstanding;
    int32_t status;
    int32_t stage;
    int64_t posted;
    int64_t direct;
    int64_t bytes;
} kvf_batch;

/* A parsed message envelope (layout in transfer/envelope.py). `error` is 0 for a
 * well-formed envelope, else one of the reasons numbered in envelope.py; the pointers
 * point into the message's own bytes. */
typedef struct kvf_envelope {
    int32_t error;
    int32_t flags;
    uint64_t incarnation;
    uint64_t seq;
    const char *sender;
    size_t sender_length;
    const char *payload;
    size_t payload_length;
} kvf_envelope;

/* One received active message, copied out of UCX's buffer inside the callback. */
typedef struct kvf_msg {
    struct kvf_msg *next;
    size_t length;
    char *data;
    kvf_envelope env;
} kvf_msg;

const char *kvf_status_string(int status);
const char *kvf_version_string(void);
const char *kvf_library_path(void);
void kvf_ucx_versions(unsigned *build_major, unsigned *build_minor, unsigned *run_major,
                      unsigned *run_minor, unsigned *run_release);
const char *kvf_features(void);
int kvf_uct_inventory(const char *open, char *out, size_t cap);
int kvf_uct_iface_option(const char *component, const char *tl, const char *name,
                         char *value, size_t cap);
int kvf_worker_create(const char *options, int64_t max_am_bytes, kvf_worker **out);
void kvf_worker_destroy(kvf_worker *w);
const char *kvf_worker_bad_option(kvf_worker *w);
void kvf_worker_free_failed(kvf_worker *w);
int kvf_worker_address(kvf_worker *w, void **addr, size_t *length);
void kvf_worker_address_release(kvf_worker *w, void *addr);
int kvf_worker_efd(kvf_worker *w, int *fd);
int kvf_worker_arm(kvf_worker *w);
unsigned kvf_worker_progress(kvf_worker *w);
int kvf_worker_wait(kvf_worker *w, int timeout_ms, int spin_us, int stay_awake);
void kvf_worker_configure(kvf_worker *w, int64_t max_sender, int64_t max_payload,
                          int64_t busy_poll_us);

int kvf_ep_create(kvf_worker *w, const void *addr, void **ep);
int kvf_ep_transports(void *ep, char *out, size_t cap);
int64_t kvf_ep_print_info(void *ep, char *out, size_t cap);
int kvf_ep_close(kvf_worker *w, void *ep, int force, int timeout_ms);

int kvf_mem_map(kvf_worker *w, void *address, size_t length, int allocate,
                void **memh, void **base, size_t *mapped_length);
int kvf_mem_unmap(kvf_worker *w, void *memh);
int kvf_rkey_pack(kvf_worker *w, void *memh, void **buffer, size_t *size);
void kvf_rkey_buffer_release(void *buffer);
int kvf_rkey_unpack(void *ep, const void *buffer, void **rkey);
void kvf_rkey_destroy(void *rkey);
int kvf_rkey_ptr(void *rkey, uint64_t remote_addr, void **local);

int64_t kvf_rma_pages(void *ep, int write, int64_t streaming_min_bytes,
                      uintptr_t local_base, int64_t local_len, void *rkey,
                      uint64_t remote_base, int64_t remote_len, uintptr_t direct_base,
                      const void *triples, int64_t n, int64_t skip, kvf_batch *batch);
int64_t kvf_write_notice(void *ep, int64_t streaming_min_bytes, uintptr_t local_base,
                         int64_t local_len, void *rkey, uint64_t remote_base,
                         int64_t remote_len, uintptr_t direct_base, const void *triples,
                         int64_t n, int64_t skip, int flush, const char *sender,
                         size_t sender_length, uint64_t incarnation, uint64_t seq,
                         const char *payload, size_t payload_length, kvf_batch *batch);
int kvf_flush(void *ep, kvf_batch *batch);
int kvf_flush_then_send(void *ep, uint16_t am_id, const void *payload, size_t length,
                        kvf_batch *batch);
int kvf_am_send(void *ep, uint16_t am_id, const void *payload, size_t length,
                kvf_batch *batch);
int kvf_send_envelope(void *ep, int flags, const char *sender, size_t sender_length,
                      uint64_t incarnation, uint64_t seq, const char *payload,
                      size_t payload_length, kvf_batch *batch);
size_t kvf_envelope_encode(char *out, size_t cap, int flags, const char *sender,
                           size_t sender_length, uint64_t incarnation, uint64_t seq,
                           const char *payload, size_t payload_length);
int kvf_envelope_parse(const char *data, size_t length, int64_t max_sender,
                       int64_t max_payload, kvf_envelope *out);
kvf_msg *kvf_am_pop(kvf_worker *w);
void kvf_msg_free(kvf_msg *m);
int64_t kvf_am_dropped(kvf_worker *w);
int kvf_prefault(uintptr_t address, int64_t length);
int kvf_memcpy_pages(char *dst, const char *src, const int64_t *triples, int64_t n,
                     int streaming);
int64_t kvf_check_pages(const int64_t *triples, int64_t n, int64_t local_len,
                        int64_t remote_len, int64_t *total);

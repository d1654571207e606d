/* kvferry's native layer over UCX ucp: one worker per engine, batched one-sided
 * puts/gets whose per-page loop runs here, flush-ordered notices and an active-message
 * receive queue. Single-threaded: the owning Python thread is the only caller.
 *
 * Pages are int64 triples (local offset, remote offset, length), already bounds-checked
 * by the caller against both segments. When the remote segment is mapped into this
 * process (ucp_rkey_ptr succeeds: UCX-allocated posix/sysv memory on the same host),
 * pages are copied directly; otherwise each page is one ucp_put_nbx/ucp_get_nbx. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

struct kvf_worker {
    ucp_context_h context;
    ucp_worker_h worker;
    int efd;
    int64_t max_am_bytes;
    kvf_msg *head;
    kvf_msg *tail;
    int64_t dropped;
    char bad_option[128];
};

#define KVF_AM_ID 7

typedef struct kvf_send_ctx {
    kvf_batch *batch;
    ucp_ep_h ep;
    uint16_t am_id;
    size_t length;
    char payload[];
} kvf_send_ctx;

const char *kvf_status_string(int status) { return ucs_status_string((ucs_status_t)status); }

const char *kvf_version_string(void) { return ucp_get_version_string(); }

const char *kvf_library_path(void)
{
    Dl_info info;
    if (dladdr((void *)&ucp_worker_create, &info) && info.dli_fname != NULL) {
        return info.dli_fname;
    }
    return "";
}

static ucs_status_t kvf_am_recv(void *arg, const void *header, size_t header_length,
                                void *data, size_t length, const ucp_am_recv_param_t *param)
{
    kvf_worker *w = (kvf_worker *)arg;
    kvf_msg *m;
    (void)header; (void)header_length;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || (int64_t)length > w->max_am_bytes) {
        w->dropped++; /* oversized or rendezvous: never accepted, counted */
        return UCS_OK;
    }
    m = (kvf_msg *)malloc(sizeof(kvf_msg) + length);
    if (m == NULL) {
        w->dropped++;
        return UCS_OK;
    }
    m->next = NULL;
    m->length = length;
    m->data = (char *)(m + 1);
    memcpy(m->data, data, length);
    if (w->tail) w->tail->next = m; else w->head = m;
    w->tail = m;
    return UCS_OK;
}

int kvf_worker_create(const char *options, int64_t max_am_bytes, kvf_worker **out)
{
    ucp_config_t *config;
    ucp_params_t params;
    ucp_worker_params_t wparams;
    ucp_am_handler_param_t am;
    ucs_status_t st;
    kvf_worker *w = (kvf_worker *)calloc(1, sizeof(*w));
    if (w == NULL) return UCS_ERR_NO_MEMORY;
    w->max_am_bytes = max_am_bytes;
    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) goto err_free;
    /* options: "KEY=VALUE" lines applied with ucp_config_modify (keys without UCX_). */
    if (options != NULL) {
        const char *line = options;
        char key[128], value[512];
        while (*line != '\0') {
            const char *eol = strchr(line, '\n');
            const char *eq = strchr(line, '=');
            size_t len = eol ? (size_t)(eol - line) : strlen(line);
            if (eq != NULL && eq < line + len && (size_t)(eq - line) < sizeof(key) &&
                len - (size_t)(eq - line) - 1 < sizeof(value)) {
                memcpy(key, line, (size_t)(eq - line));
                key[eq - line] = '\0';
                memcpy(value, eq + 1, len - (size_t)(eq - line) - 1);
                value[len - (size_t)(eq - line) - 1] = '\0';
                st = ucp_config_modify(config, key, value);
                if (st != UCS_OK) {
                    snprintf(w->bad_option, sizeof(w->bad_option), "%s", key);
                    *out = w;
                    ucp_config_release(config);
                    return st;
                }
            }
            line += len + (eol ? 1 : 0);
        }
    }
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    st = ucp_init(&params, config, &w->context);
    ucp_config_release(config);
    if (st != UCS_OK) goto err_free;
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    st = ucp_worker_create(w->context, &wparams, &w->worker);
    if (st != UCS_OK) goto err_ctx;
    st = ucp_worker_get_efd(w->worker, &w->efd);
    if (st != UCS_OK) goto err_worker;
    memset(&am, 0, sizeof(am));
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    am.id = KVF_AM_ID;
    am.flags = UCP_AM_FLAG_WHOLE_MSG;
    am.cb = kvf_am_recv;
    am.arg = w;
    st = ucp_worker_set_am_recv_handler(w->worker, &am);
    if (st != UCS_OK) goto err_worker;
    *out = w;
    return UCS_OK;
err_worker:
    ucp_worker_destroy(w->worker);
err_ctx:
    ucp_cleanup(w->context);
err_free:
    free(w);
    *out = NULL;
    return st;
}

const char *kvf_worker_bad_option(kvf_worker *w) { return w->bad_option; }

/* Frees a worker whose creation failed on a config option (context never created). */
void kvf_worker_free_failed(kvf_worker *w) { free(w); }

void kvf_worker_destroy(kvf_worker *w)
{
    kvf_msg *m = w->head, *next;
    while (m) { next = m->next; free(m); m = next; }
    ucp_worker_destroy(w->worker);
    ucp_cleanup(w->context);
    free(w);
}

int kvf_worker_address(kvf_worker *w, void **addr, size_t *length)
{
    return ucp_worker_get_address(w->worker, (ucp_address_t **)addr, length);
}

void kvf_worker_address_release(kvf_worker *w, void *addr)
{
    ucp_worker_release_address(w->worker, (ucp_address_t *)addr);
}

int kvf_worker_efd(kvf_worker *w, int *fd) { *fd = w->efd; return UCS_OK; }

int kvf_worker_arm(kvf_worker *w) { return ucp_worker_arm(w->worker); }

unsigned kvf_worker_progress(kvf_worker *w) { return ucp_worker_progress(w->worker); }

static int64_t kvf_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Progress; if nothing happened, spin up to spin_us, then arm the event fd and sleep in
 * poll() for up to timeout_ms (the GIL is released by cffi around this call). */
int kvf_worker_wait(kvf_worker *w, int timeout_ms, int spin_us)
{
    unsigned n = ucp_worker_progress(w->worker);
    int64_t until;
    struct pollfd pfd;
    ucs_status_t st;
    if (n || w->head || timeout_ms == 0) return (int)n;
    until = kvf_now_us() + spin_us;
    while (spin_us > 0 && kvf_now_us() < until) {
        n = ucp_worker_progress(w->worker);
        if (n || w->head) return (int)n;
    }
    st = ucp_worker_arm(w->worker);
    if (st == UCS_ERR_BUSY) return (int)ucp_worker_progress(w->worker);
    if (st != UCS_OK) return (int)st;
    pfd.fd = w->efd;
    pfd.events = POLLIN;
    pfd.revents = 0;
    poll(&pfd, 1, timeout_ms);
    return (int)ucp_worker_progress(w->worker);
}

int kvf_ep_create(kvf_worker *w, const void *addr, void **ep)
{
    ucp_ep_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = (const ucp_address_t *)addr;
    return ucp_ep_create(w->worker, &params, (ucp_ep_h *)ep);
}

int kvf_ep_transports(void *ep, char *out, size_t cap)
{
    ucp_transport_entry_t entries[16];
    ucp_ep_attr_t attr;
    ucs_status_t st;
    size_t used = 0;
    unsigned i;
    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries;
    attr.transports.num_entries = 16;
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    st = ucp_ep_query((ucp_ep_h)ep, &attr);
    if (st != UCS_OK) return st;
    out[0] = '\0';
    for (i = 0; i < attr.transports.num_entries && used + 1 < cap; ++i) {
        int k = snprintf(out + used, cap - used, "%s%s/%s", i ? "," : "",
                         entries[i].transport_name, entries[i].device_name);
        if (k < 0) break;
        used += (size_t)k;
    }
    return UCS_OK;
}

int kvf_ep_close(kvf_worker *w, void *ep, int force, int timeout_ms)
{
    ucp_request_param_t param;
    ucs_status_ptr_t req;
    ucs_status_t st;
    int64_t until = kvf_now_us() + (int64_t)timeout_ms * 1000;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    req = ucp_ep_close_nbx((ucp_ep_h)ep, &param);
    if (req == NULL) return UCS_OK;
    if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
    for (;;) {
        ucp_worker_progress(w->worker);
        st = ucp_request_check_status(req);
        if (st != UCS_INPROGRESS) break;
        if (kvf_now_us() > until) {
            ucp_request_free(req);
            return UCS_ERR_TIMED_OUT;
        }
    }
    ucp_request_free(req);
    return st;
}

int kvf_mem_map(kvf_worker *w, void *address, size_t length, int allocate,
                void **memh, void **base, size_t *mapped_length)
{
    ucp_mem_map_params_t params;
    ucp_mem_attr_t attr;
    ucs_status_t st;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    params.address = allocate ? NULL : address;
    params.length = length;
    params.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
    params.memory_type = UCS_MEMORY_TYPE_HOST;
    st = ucp_mem_map(w->context, &params, (ucp_mem_h *)memh);
    if (st != UCS_OK) return st;
    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    st = ucp_mem_query((ucp_mem_h)*memh, &attr);
    if (st != UCS_OK) {
        ucp_mem_unmap(w->context, (ucp_mem_h)*memh);
        return st;
    }
    *base = attr.address;
    *mapped_length = attr.length;
    return UCS_OK;
}

int kvf_mem_unmap(kvf_worker *w, void *memh) { return ucp_mem_unmap(w->context, (ucp_mem_h)memh); }

int kvf_rkey_pack(kvf_worker *w, void *memh, void **buffer, size_t *size)
{
    return ucp_rkey_pack(w->context, (ucp_mem_h)memh, buffer, size);
}

void kvf_rkey_buffer_release(void *buffer) { ucp_rkey_buffer_release(buffer); }

int kvf_rkey_unpack(void *ep, const void *buffer, void **rkey)
{
    return ucp_ep_rkey_unpack((ucp_ep_h)ep, buffer, (ucp_rkey_h *)rkey);
}

void kvf_rkey_destroy(void *rkey) { ucp_rkey_destroy((ucp_rkey_h)rkey); }

int kvf_rkey_ptr(void *rkey, uint64_t remote_addr, void **local)
{
    return ucp_rkey_ptr((ucp_rkey_h)rkey, remote_addr, local);
}

static void kvf_batch_fail(kvf_batch *b, ucs_status_t st)
{
    if (st != UCS_OK && b->status == 0) b->status = st;
}

static void kvf_op_done(void *request, ucs_status_t status, void *user_data)
{
    kvf_batch *b = (kvf_batch *)user_data;
    kvf_batch_fail(b, status);
    b->outstanding--;
    ucp_request_free(request);
}

static ucs_status_t kvf_track(ucs_status_ptr_t p, kvf_batch *b)
{
    if (p == NULL) return UCS_OK;
    if (UCS_PTR_IS_ERR(p)) {
        kvf_batch_fail(b, UCS_PTR_STATUS(p));
        return UCS_PTR_STATUS(p);
    }
    b->outstanding++;
    return UCS_OK;
}

static void kvf_param_init(ucp_request_param_t *param, kvf_batch *b)
{
    memset(param, 0, sizeof(*param));
    param->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                          UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param->cb.send = kvf_op_done;
    param->user_data = b;
    param->memory_type = UCS_MEMORY_TYPE_HOST;
}

int kvf_flush(void *ep, kvf_batch *batch)
{
    ucp_request_param_t param;
    kvf_param_init(&param, batch);
    param.op_attr_mask &= ~(uint32_t)UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    return kvf_track(ucp_ep_flush_nbx((ucp_ep_h)ep, &param), batch);
}

int kvf_put_pages(void *ep, char *local_base, void *rkey, uint64_t remote_base,
                  char *direct_base, const int64_t *triples, int64_t n, int flush,
                  kvf_batch *batch)
{
    ucp_request_param_t param;
    ucs_status_t st;
    int64_t i;
    kvf_param_init(&param, batch);
    for (i = 0; i < n; ++i) {
        const int64_t *t = triples + 3 * i;
        if (direct_base != NULL) {
            memcpy(direct_base + t[1], local_base + t[0], (size_t)t[2]);
            batch->direct++;
        } else {
            st = kvf_track(ucp_put_nbx((ucp_ep_h)ep, local_base + t[0], (size_t)t[2],
                                       remote_base + (uint64_t)t[1], (ucp_rkey_h)rkey,
                                       &param), batch);
            if (st != UCS_OK) return st;
        }
        batch->posted++;
    }
    if (direct_base != NULL) __atomic_thread_fence(__ATOMIC_RELEASE);
    return flush ? kvf_flush(ep, batch) : UCS_OK;
}

int kvf_get_pages(void *ep, char *local_base, void *rkey, uint64_t remote_base,
                  char *direct_base, const int64_t *triples, int64_t n, kvf_batch *batch)
{
    ucp_request_param_t param;
    ucs_status_t st;
    int64_t i;
    kvf_param_init(&param, batch);
    if (direct_base != NULL) __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (i = 0; i < n; ++i) {
        const int64_t *t = triples + 3 * i;
        if (direct_base != NULL) {
            memcpy(local_base + t[0], direct_base + t[1], (size_t)t[2]);
            batch->direct++;
        } else {
            st = kvf_track(ucp_get_nbx((ucp_ep_h)ep, local_base + t[0], (size_t)t[2],
                                       remote_base + (uint64_t)t[1], (ucp_rkey_h)rkey,
                                       &param), batch);
            if (st != UCS_OK) return st;
        }
        batch->posted++;
    }
    return UCS_OK;
}

static void kvf_send_done(void *request, ucs_status_t status, void *user_data)
{
    kvf_send_ctx *ctx = (kvf_send_ctx *)user_data;
    kvf_batch_fail(ctx->batch, status);
    ctx->batch->outstanding--;
    free(ctx);
    if (request != NULL) ucp_request_free(request);
}

static ucs_status_t kvf_post_send(kvf_send_ctx *ctx)
{
    ucp_request_param_t param;
    ucs_status_ptr_t p;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
    param.cb.send = kvf_send_done;
    param.user_data = ctx;
    ctx->batch->outstanding++;
    p = ucp_am_send_nbx(ctx->ep, ctx->am_id, NULL, 0, ctx->payload, ctx->length, &param);
    if (p == NULL) {
        kvf_send_done(NULL, UCS_OK, ctx);
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(p)) {
        ucs_status_t st = UCS_PTR_STATUS(p);
        kvf_send_done(NULL, st, ctx);
        return st;
    }
    return UCS_OK;
}

static kvf_send_ctx *kvf_send_ctx_new(void *ep, uint16_t am_id, const void *payload,
                                      size_t length, kvf_batch *batch)
{
    kvf_send_ctx *ctx = (kvf_send_ctx *)malloc(sizeof(kvf_send_ctx) + length);
    if (ctx == NULL) return NULL;
    ctx->batch = batch;
    ctx->ep = (ucp_ep_h)ep;
    ctx->am_id = am_id ? am_id : KVF_AM_ID;
    ctx->length = length;
    memcpy(ctx->payload, payload, length);
    return ctx;
}

int kvf_am_send(void *ep, uint16_t am_id, const void *payload, size_t length,
                kvf_batch *batch)
{
    kvf_send_ctx *ctx = kvf_send_ctx_new(ep, am_id, payload, length, batch);
    if (ctx == NULL) { kvf_batch_fail(batch, UCS_ERR_NO_MEMORY); return UCS_ERR_NO_MEMORY; }
    return kvf_post_send(ctx);
}

/* The notice is posted from the flush's completion: it cannot overtake any earlier put. */
static void kvf_flush_done_send(void *request, ucs_status_t status, void *user_data)
{
    kvf_send_ctx *ctx = (kvf_send_ctx *)user_data;
    kvf_batch *b = ctx->batch;
    if (status == UCS_OK) {
        kvf_post_send(ctx);
    } else {
        kvf_batch_fail(b, status);
        free(ctx);
    }
    b->outstanding--;
    if (request != NULL) ucp_request_free(request);
}

int kvf_flush_then_send(void *ep, uint16_t am_id, const void *payload, size_t length,
                        kvf_batch *batch)
{
    ucp_request_param_t param;
    ucs_status_ptr_t p;
    kvf_send_ctx *ctx = kvf_send_ctx_new(ep, am_id, payload, length, batch);
    if (ctx == NULL) { kvf_batch_fail(batch, UCS_ERR_NO_MEMORY); return UCS_ERR_NO_MEMORY; }
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = kvf_flush_done_send;
    param.user_data = ctx;
    batch->outstanding++;
    p = ucp_ep_flush_nbx((ucp_ep_h)ep, &param);
    if (p == NULL) {
        kvf_flush_done_send(NULL, UCS_OK, ctx);
        return batch->status;
    }
    if (UCS_PTR_IS_ERR(p)) {
        ucs_status_t st = UCS_PTR_STATUS(p);
        kvf_flush_done_send(NULL, st, ctx);
        return st;
    }
    return UCS_OK;
}

kvf_msg *kvf_am_pop(kvf_worker *w)
{
    kvf_msg *m = w->head;
    if (m != NULL) {
        w->head = m->next;
        if (w->head == NULL) w->tail = NULL;
        m->next = NULL;
    }
    return m;
}

void kvf_msg_free(kvf_msg *m) { free(m); }

int64_t kvf_am_dropped(kvf_worker *w) { return w->dropped; }

int kvf_memcpy_pages(char *dst, const char *src, const int64_t *triples, int64_t n)
{
    int64_t i;
    for (i = 0; i < n; ++i) {
        const int64_t *t = triples + 3 * i;
        memcpy(dst + t[1], src + t[0], (size_t)t[2]);
    }
    return 0;
}

/* Index of the first page outside [0, local_len) / [0, remote_len) or with a non-positive
 * length, or -1 when all are in bounds; *total gets the byte count. Overflow-safe. */
int64_t kvf_check_pages(const int64_t *triples, int64_t n, int64_t local_len,
                        int64_t remote_len, int64_t *total)
{
    int64_t i, sum = 0;
    for (i = 0; i < n; ++i) {
        const int64_t lo = triples[3 * i], ro = triples[3 * i + 1], ln = triples[3 * i + 2];
        if (ln <= 0 || lo < 0 || ro < 0 || ln > local_len || ln > remote_len ||
            lo > local_len - ln || ro > remote_len - ln) {
            return i;
        }
        sum += ln;
    }
    *total = sum;
    return -1;
}

/* kvferry's native layer over UCX ucp: one worker per engine, batched one-sided
 * puts/gets whose per-page loop runs here, flush-ordered notices and an active-message
 * receive queue. Single-threaded: the owning Python thread is the only caller.
 *
 * The API, with each function's ownership and statuses, is documented in kvf_ucp.h.
 *
 * Pages are int64 triples (local offset, remote offset, length). kvf_put_pages and
 * kvf_get_pages check every page against both segments themselves (kvf_check_pages)
 * before anything is posted. When the remote segment is mapped into this process
 * (ucp_rkey_ptr succeeds: UCX-allocated posix/sysv memory on the same host), pages are
 * copied directly; when it lives in a known process on this host (memory the user
 * registered), the kernel copies them, up to KVF_CMA_IOVS pieces a side per
 * process_vm_writev (each side's contiguous neighbours joined); otherwise each run of pages
 * contiguous on both sides is one ucp_put_nbx/ucp_get_nbx. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include <ucp/api/ucp_version.h>
#include <uct/api/uct.h>
#include "kvf_ucp.h"
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* Oldest UCX this binding builds against (build_ucp.py checks it first, with both
 * versions in its message); features of later releases sit behind KVF_UCX_AT_LEAST and
 * are listed by kvf_features(), so describe() can say what a build lacks. */
#define KVF_UCX_AT_LEAST(major, minor) (UCP_API_VERSION >= UCP_VERSION(major, minor))
#if !KVF_UCX_AT_LEAST(1, 13)
#error "kvferry needs UCX 1.13 or newer; these headers are older (ucp/api/ucp_version.h)"
#endif
/* ucp_ep_query() with UCP_EP_ATTR_FIELD_TRANSPORTS (the transports and devices of an
 * endpoint's lanes) arrived after 1.13; older builds read ucp_ep_print_info() instead. */
#define KVF_HAVE_EP_TRANSPORTS KVF_UCX_AT_LEAST(1, 14)

struct kvf_worker {
    ucp_context_h context;
    ucp_worker_h worker;
    int efd;
    int64_t max_am_bytes;
    kvf_msg_t *head;
    kvf_msg_t *tail;
    int64_t dropped;
    int64_t max_sender;       /* envelope limits applied on receipt */
    int64_t max_payload;
    int64_t busy_poll_us;     /* keep polling this long after the last activity */
    int64_t spin_us;          /* poll at least this long before sleeping */
    int64_t last_activity_us; /* last time progress did something or a message came */
};

/* The handles of kvf_ucp.h are UCX's own, under kvferry's names. */
static inline ucp_ep_h kvf_ucp_ep(kvf_ep_h ep) { return (ucp_ep_h)(void *)ep; }
static inline ucp_mem_h kvf_ucp_mem(kvf_mem_h memh) { return (ucp_mem_h)(void *)memh; }
static inline ucp_rkey_h kvf_ucp_rkey(kvf_rkey_h rkey) { return (ucp_rkey_h)(void *)rkey; }

#define KVF_AM_ID 7

/* Message envelope (see transfer/envelope.py, the reference codec):
 *   0 magic "KVFE" | 4 version u8 | 5 flags u8 | 6 reserved u16 (0)
 *   8 incarnation u64 | 16 seq u64 | 24 sender length u32 | 28 payload length u32
 *   32 sender address bytes | payload bytes; little-endian, nothing after the payload. */
#define KVF_ENV_HEADER 32
#define KVF_ENV_VERSION 2
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the envelope codec assumes a little-endian host"
#endif

/* A message on its way: posted from kvf_post_send, or from a flush's completion. */
typedef struct kvf_send_ctx {
    kvf_batch_t *batch;
    ucp_ep_h ep;
    size_t length;
    char payload[];
} kvf_send_ctx;

const char *kvf_version_string(void) { return ucp_get_version_string(); }

void kvf_ucx_versions(unsigned *build_major, unsigned *build_minor, unsigned *run_major,
                      unsigned *run_minor, unsigned *run_release)
{
    *build_major = UCP_API_MAJOR;
    *build_minor = UCP_API_MINOR;
    ucp_get_version(run_major, run_minor, run_release);
}

/* Comma-separated names of the optional features compiled in (see KVF_HAVE_*). */
const char *kvf_features(void)
{
#if KVF_HAVE_EP_TRANSPORTS
    return "ep_transports";
#else
    return "";
#endif
}

const char *kvf_library_path(void)
{
    Dl_info info;
    if (dladdr((void *)&ucp_worker_create, &info) && info.dli_fname != NULL) {
        return info.dli_fname;
    }
    return "";
}

static int64_t kvf_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

size_t kvf_envelope_encode(const kvf_msg_param_t *msg, char *out, size_t cap)
{
    size_t total = KVF_ENV_HEADER + msg->sender_length + msg->payload_length;
    uint32_t slen = (uint32_t)msg->sender_length, plen = (uint32_t)msg->payload_length;
    uint16_t reserved = 0;
    uint8_t version = KVF_ENV_VERSION;
    uint8_t fl = (msg->flags & KVF_MSG_FLAG_NOTICE) ? KVF_ENVELOPE_FLAG_FLUSHED : 0;
    if (total > cap || msg->sender_length > UINT32_MAX || msg->payload_length > UINT32_MAX) {
        return 0;
    }
    memcpy(out, "KVFE", 4);
    memcpy(out + 4, &version, 1);
    memcpy(out + 5, &fl, 1);
    memcpy(out + 6, &reserved, 2);
    memcpy(out + 8, &msg->incarnation, 8);
    memcpy(out + 16, &msg->seq, 8);
    memcpy(out + 24, &slen, 4);
    memcpy(out + 28, &plen, 4);
    memcpy(out + KVF_ENV_HEADER, msg->sender, msg->sender_length);
    if (msg->payload_length) {
        memcpy(out + KVF_ENV_HEADER + msg->sender_length, msg->payload, msg->payload_length);
    }
    return total;
}

int kvf_envelope_parse(const char *data, size_t length, int64_t max_sender,
                       int64_t max_payload, kvf_envelope_t *out)
{
    uint32_t slen, plen;
    uint16_t reserved;
    memset(out, 0, sizeof(*out));
    out->error = KVF_ENVELOPE_SHORT;
    if (length < KVF_ENV_HEADER) return out->error;
    out->error = KVF_ENVELOPE_MAGIC;
    if (memcmp(data, "KVFE", 4) != 0) return out->error;
    out->error = KVF_ENVELOPE_VERSION_MISMATCH;
    if ((uint8_t)data[4] != KVF_ENV_VERSION) return out->error;
    memcpy(&reserved, data + 6, 2);
    out->error = KVF_ENVELOPE_FLAGS;
    if (((uint8_t)data[5] & ~KVF_ENVELOPE_FLAG_FLUSHED) != 0 || reserved != 0) return out->error;
    memcpy(&slen, data + 24, 4);
    memcpy(&plen, data + 28, 4);
    out->error = KVF_ENVELOPE_SENDER_SIZE;
    if (slen == 0 || (int64_t)slen > max_sender) return out->error;
    out->error = KVF_ENVELOPE_PAYLOAD_SIZE;
    if ((int64_t)plen > max_payload) return out->error;
    out->error = KVF_ENVELOPE_LENGTH;
    if ((uint64_t)KVF_ENV_HEADER + slen + plen != (uint64_t)length) return out->error;
    out->error = KVF_ENVELOPE_OK;
    out->flags = (uint8_t)data[5];
    memcpy(&out->incarnation, data + 8, 8);
    memcpy(&out->seq, data + 16, 8);
    out->sender = data + KVF_ENV_HEADER;
    out->sender_length = slen;
    out->payload = data + KVF_ENV_HEADER + slen;
    out->payload_length = plen;
    return KVF_ENVELOPE_OK;
}

static ucs_status_t kvf_am_recv(void *arg, const void *header, size_t header_length,
                                void *data, size_t length, const ucp_am_recv_param_t *param)
{
    kvf_worker_h w = (kvf_worker_h)arg;
    kvf_msg_t *m;
    (void)header; (void)header_length;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || (int64_t)length > w->max_am_bytes) {
        w->dropped++; /* oversized or rendezvous: never accepted, counted */
        return UCS_OK;
    }
    m = (kvf_msg_t *)malloc(sizeof(kvf_msg_t) + length);
    if (m == NULL) {
        w->dropped++;
        return UCS_OK;
    }
    m->next = NULL;
    m->length = length;
    m->data = (char *)(m + 1);
    memcpy(m->data, data, length);
    kvf_envelope_parse(m->data, length, w->max_sender, w->max_payload, &m->env);
    w->last_activity_us = kvf_now_us();
    if (w->tail) w->tail->next = m; else w->head = m;
    w->tail = m;
    return UCS_OK;
}

/* Applies "KEY=VALUE" lines with ucp_config_modify; on a refused key, returns its status
 * with the key in bad (when given). */
static ucs_status_t kvf_config_apply(ucp_config_t *config, const char *options, char *bad,
                                     size_t bad_length)
{
    const char *line = options;
    char key[128], value[512];
    ucs_status_t st;
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
                if (bad != NULL && bad_length > 0) snprintf(bad, bad_length, "%s", key);
                return st;
            }
        }
        line += len + (eol ? 1 : 0);
    }
    return UCS_OK;
}

ucs_status_t kvf_worker_create(const kvf_worker_params_t *p, kvf_worker_h *worker_p)
{
    ucp_config_t *config;
    ucp_params_t params;
    ucp_worker_params_t wparams;
    ucp_am_handler_param_t am;
    ucs_status_t st;
    kvf_worker_h w;
    uint64_t mask = p->field_mask;
    if (p->max_am_bytes <= 0) return UCS_ERR_INVALID_PARAM;
    w = (kvf_worker_h)calloc(1, sizeof(*w));
    if (w == NULL) return UCS_ERR_NO_MEMORY;
    w->max_am_bytes = p->max_am_bytes;
    w->max_sender = (mask & KVF_WORKER_PARAM_FIELD_MAX_SENDER) ? p->max_sender
                                                                : p->max_am_bytes;
    w->max_payload = (mask & KVF_WORKER_PARAM_FIELD_MAX_PAYLOAD) ? p->max_payload
                                                                  : p->max_am_bytes;
    w->busy_poll_us = (mask & KVF_WORKER_PARAM_FIELD_BUSY_POLL_US) && p->busy_poll_us > 0
                      ? p->busy_poll_us : 0;
    w->spin_us = (mask & KVF_WORKER_PARAM_FIELD_SPIN_US) && p->spin_us > 0 ? p->spin_us : 0;
    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) goto err_free;
    if ((mask & KVF_WORKER_PARAM_FIELD_OPTIONS) && p->options != NULL) {
        int report = (mask & KVF_WORKER_PARAM_FIELD_BAD_OPTION) != 0;
        st = kvf_config_apply(config, p->options, report ? p->bad_option : NULL,
                              report ? p->bad_option_length : 0);
        if (st != UCS_OK) {
            ucp_config_release(config);
            goto err_free;
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
    *worker_p = w;
    return UCS_OK;
err_worker:
    ucp_worker_destroy(w->worker);
err_ctx:
    ucp_cleanup(w->context);
err_free:
    free(w);
    return st;
}

void kvf_worker_destroy(kvf_worker_h w)
{
    kvf_msg_t *m = w->head, *next;
    while (m) { next = m->next; free(m); m = next; }
    ucp_worker_destroy(w->worker);
    ucp_cleanup(w->context);
    free(w);
}

ucs_status_t kvf_worker_address(kvf_worker_h w, void **address_p, size_t *length_p)
{
    ucp_address_t *address;
    size_t length;
    ucs_status_t st = ucp_worker_get_address(w->worker, &address, &length);
    if (st != UCS_OK) return st;
    *address_p = address;
    *length_p = length;
    return UCS_OK;
}

void kvf_worker_address_release(kvf_worker_h w, void *address)
{
    ucp_worker_release_address(w->worker, (ucp_address_t *)address);
}

ucs_status_t kvf_worker_efd(kvf_worker_h w, int *fd_p) { *fd_p = w->efd; return UCS_OK; }

ucs_status_t kvf_worker_arm(kvf_worker_h w)
{
    ucs_status_t st = ucp_worker_arm(w->worker);
    if (st != UCS_OK) return st;   /* UCS_ERR_BUSY: events pending */
    return w->head == NULL ? UCS_OK : UCS_ERR_BUSY;
}

unsigned kvf_worker_progress(kvf_worker_h w)
{
    unsigned n = ucp_worker_progress(w->worker);
    if (n) w->last_activity_us = kvf_now_us();
    return n;
}

unsigned kvf_worker_progress_drain(kvf_worker_h w, int max_us, int idle_us)
{
    int64_t start = kvf_now_us(), now = start, last = start;
    unsigned total = 0, n;
    for (;;) {
        n = ucp_worker_progress(w->worker);
        if (!n && !total) return 0; /* nothing on the wire: no spinning */
        now = kvf_now_us();
        if (n) {
            total += n;
            last = now;
        }
        if (now - start >= max_us || now - last >= idle_us) break;
    }
    if (total) w->last_activity_us = last;
    return total;
}

/* A short nap between polls once the spin window is over, where a sched_yield() loop
 * kept its CPU busy: a target yield-spinning while its peer copied pages cut the copy to
 * 10 GB/s against 15.9 with naps (two vCPUs that seem to share a host core), and a yielding
 * spinner does not reliably hand its CPU to a rank that just ran a long step. A message
 * that arrives during a nap waits for it (about 25 us here). The thread's timer slack is
 * set to 1 us on first use, or a 5 us sleep lasts 50-100 us. */
#define KVF_NAP_NS 5000
static __thread int kvf_slack_set;

static void kvf_nap(void)
{
    struct timespec nap = {0, KVF_NAP_NS};
    if (!kvf_slack_set) {
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
        kvf_slack_set = 1;
    }
    nanosleep(&nap, NULL);
}

/* See kvf_ucp.h. Under traffic the busy window keeps the thread awake, so a message
 * costs no wake-up; an idle worker sleeps. Past spin_us the loop naps between polls
 * (kvf_nap). */
ucs_status_t kvf_worker_wait(kvf_worker_h w, int timeout_ms, unsigned flags,
                             unsigned *count_p)
{
    unsigned n = kvf_worker_progress(w);
    int64_t now, deadline, spin_until, nap_after, remaining_ms;
    struct pollfd pfd;
    ucs_status_t st;
    if (n || w->head || timeout_ms == 0) goto out;
    now = kvf_now_us();
    deadline = now + (int64_t)timeout_ms * 1000;
    nap_after = now + w->spin_us;
    spin_until = nap_after;
    if (w->last_activity_us + w->busy_poll_us > spin_until) {
        spin_until = w->last_activity_us + w->busy_poll_us;
    }
    if (spin_until > deadline || (flags & KVF_WAIT_FLAG_STAY_AWAKE)) spin_until = deadline;
    while (now < spin_until) {
        n = ucp_worker_progress(w->worker);
        if (n || w->head) {
            if (n) w->last_activity_us = kvf_now_us();
            goto out;
        }
        now = kvf_now_us();
        if (now >= nap_after) kvf_nap();
    }
    n = 0;
    if (now >= deadline) goto out;
    st = kvf_worker_arm(w);
    if (st == UCS_OK) {
        pfd.fd = w->efd;
        pfd.events = POLLIN;
        pfd.revents = 0;
        remaining_ms = (deadline - now + 999) / 1000;
        poll(&pfd, 1, (int)(remaining_ms > 0 ? remaining_ms : 0));
    } else if (st != UCS_ERR_BUSY) {
        return st;
    }
    n = kvf_worker_progress(w);
out:
    *count_p = n;
    return UCS_OK;
}

ucs_status_t kvf_ep_create(kvf_worker_h w, const void *address, kvf_ep_h *ep_p)
{
    ucp_ep_params_t params;
    ucp_ep_h ep;
    ucs_status_t st;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = (const ucp_address_t *)address;
    st = ucp_ep_create(w->worker, &params, &ep);
    if (st != UCS_OK) return st;
    *ep_p = (kvf_ep_h)(void *)ep;
    return UCS_OK;
}

ucs_status_t kvf_ep_transports(kvf_ep_h ep, char *out, size_t cap)
{
#if KVF_HAVE_EP_TRANSPORTS
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
    if (cap > 0) out[0] = '\0';
    st = ucp_ep_query(kvf_ucp_ep(ep), &attr);
    if (st != UCS_OK) return st;
    for (i = 0; i < attr.transports.num_entries && used + 1 < cap; ++i) {
        int k = snprintf(out + used, cap - used, "%s%s/%s", i ? "," : "",
                         entries[i].transport_name, entries[i].device_name);
        if (k < 0) break;
        used += (size_t)k;
    }
    return UCS_OK;
#else
    (void)ep;
    if (cap > 0) out[0] = '\0';
    return UCS_ERR_UNSUPPORTED;
#endif
}

ucs_status_t kvf_ep_print_info(kvf_ep_h ep, char *out, size_t cap)
{
    char *text = NULL;
    size_t length = 0;
    FILE *f = open_memstream(&text, &length);
    if (f == NULL) return UCS_ERR_NO_MEMORY;
    ucp_ep_print_info(kvf_ucp_ep(ep), f);
    fclose(f);
    if (cap > 0) {
        size_t n = length < cap - 1 ? length : cap - 1;
        if (n) memcpy(out, text, n);
        out[n] = '\0';
    }
    free(text);
    return UCS_OK;
}

/* Appends to out (NUL-terminated, used bytes in *used); returns 0 once out is full. */
static int kvf_append(char *out, size_t cap, size_t *used, const char *text)
{
    size_t n = strlen(text);
    if (*used + n + 1 > cap) return 0;
    memcpy(out + *used, text, n + 1);
    *used += n;
    return 1;
}

/* The transport resources of one memory domain as " tl/dev" words appended to out. */
static void kvf_md_resources(uct_component_h component, const char *md_name, char *out,
                             size_t cap, size_t *used)
{
    uct_md_config_t *config;
    uct_md_h md;
    uct_tl_resource_desc_t *tls;
    unsigned n = 0, i;
    char word[UCT_TL_NAME_MAX + UCT_DEVICE_NAME_MAX + 4];
    if (uct_md_config_read(component, NULL, NULL, &config) != UCS_OK) return;
    if (uct_md_open(component, md_name, config, &md) != UCS_OK) {
        uct_config_release(config);
        return;
    }
    uct_config_release(config);
    if (uct_md_query_tl_resources(md, &tls, &n) == UCS_OK) {
        for (i = 0; i < n; ++i) {
            snprintf(word, sizeof(word), " %s/%s", tls[i].tl_name, tls[i].dev_name);
            if (!kvf_append(out, cap, used, word)) break;
        }
        uct_release_tl_resource_list(tls);
    }
    uct_md_close(md);
}

/* Opens the first memory domain of the component called `name` (*md, with *found set
 * when the component exists). UCS_ERR_NO_ELEM: no such component in this UCX;
 * UCS_ERR_NO_DEVICE: it has no memory domain here (e.g. "ib" without an RDMA device). */
static ucs_status_t kvf_open_first_md(const char *name, uct_md_h *md)
{
    uct_component_h *components;
    unsigned count, i;
    ucs_status_t st = uct_query_components(&components, &count);
    if (st != UCS_OK) return st;
    st = UCS_ERR_NO_ELEM;
    for (i = 0; i < count && st == UCS_ERR_NO_ELEM; ++i) {
        uct_component_attr_t attr;
        uct_md_resource_desc_t first;
        uct_md_config_t *config;
        memset(&attr, 0, sizeof(attr));
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME |
                          UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
        if (uct_component_query(components[i], &attr) != UCS_OK) continue;
        if (strcmp(attr.name, name) != 0) continue;
        st = UCS_ERR_NO_DEVICE;
        if (attr.md_resource_count == 0) break;
        attr.md_resource_count = 1; /* the first one is enough to read options */
        attr.md_resources = &first;
        attr.field_mask |= UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        if (uct_component_query(components[i], &attr) != UCS_OK) break;
        if (uct_md_config_read(components[i], NULL, NULL, &config) != UCS_OK) break;
        st = uct_md_open(components[i], first.md_name, config, md);
        uct_config_release(config);
    }
    uct_release_component_list(components);
    return st;
}

/* E.g. ("tcp", "tcp", "KEEPIDLE"); see kvf_ucp.h. */
ucs_status_t kvf_uct_iface_option(const char *component, const char *tl, const char *name,
                                  char *value, size_t cap)
{
    uct_md_h md;
    uct_iface_config_t *config;
    ucs_status_t st = kvf_open_first_md(component, &md);
    if (cap > 0) value[0] = '\0';
    if (st != UCS_OK) return st;
    st = uct_md_iface_config_read(md, tl, NULL, NULL, &config);
    if (st == UCS_OK) {
        st = uct_config_get(config, name, value, cap);
        if (st != UCS_OK) st = UCS_ERR_NO_ELEM;
        uct_config_release(config);
    }
    uct_md_close(md);
    return st;
}

/* `open` e.g. "ib,mlx5"; see kvf_ucp.h. */
ucs_status_t kvf_uct_inventory(const char *open, char *out, size_t cap)
{
    uct_component_h *components;
    unsigned count, i, j;
    size_t used = 0;
    ucs_status_t st = uct_query_components(&components, &count);
    if (cap > 0) out[0] = '\0';
    if (st != UCS_OK) return st;
    for (i = 0; i < count; ++i) {
        uct_component_attr_t attr;
        char needle[UCT_COMPONENT_NAME_MAX + 2], haystack[256];
        int opened;
        memset(&attr, 0, sizeof(attr));
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME |
                          UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
        if (uct_component_query(components[i], &attr) != UCS_OK) continue;
        attr.md_resources = (uct_md_resource_desc_t *)calloc(
            attr.md_resource_count ? attr.md_resource_count : 1, sizeof(uct_md_resource_desc_t));
        if (attr.md_resources == NULL) break;
        attr.field_mask |= UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        if (uct_component_query(components[i], &attr) != UCS_OK) attr.md_resource_count = 0;
        snprintf(needle, sizeof(needle), ",%s,", attr.name);
        snprintf(haystack, sizeof(haystack), ",%s,", open ? open : "");
        opened = strstr(haystack, needle) != NULL;
        kvf_append(out, cap, &used, attr.name);
        kvf_append(out, cap, &used, "\t");
        for (j = 0; j < attr.md_resource_count; ++j) {
            if (j) kvf_append(out, cap, &used, " ");
            kvf_append(out, cap, &used, attr.md_resources[j].md_name);
        }
        kvf_append(out, cap, &used, "\n");
        for (j = 0; opened && j < attr.md_resource_count; ++j) {
            kvf_append(out, cap, &used, attr.name);
            kvf_append(out, cap, &used, "\t");
            kvf_append(out, cap, &used, attr.md_resources[j].md_name);
            kvf_append(out, cap, &used, "\t");
            kvf_md_resources(components[i], attr.md_resources[j].md_name, out, cap, &used);
            kvf_append(out, cap, &used, "\n");
        }
        free(attr.md_resources);
    }
    uct_release_component_list(components);
    return UCS_OK;
}

ucs_status_t kvf_ep_close(kvf_worker_h w, kvf_ep_h ep, unsigned flags, int timeout_ms)
{
    ucp_request_param_t param;
    ucs_status_ptr_t req;
    ucs_status_t st;
    int64_t until = kvf_now_us() + (int64_t)timeout_ms * 1000;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = (flags & KVF_EP_CLOSE_FLAG_FORCE) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    req = ucp_ep_close_nbx(kvf_ucp_ep(ep), &param);
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

ucs_status_t kvf_memory_types(kvf_worker_h w, uint64_t *mask_p, uint64_t *ucs_mask_p)
{
    ucp_context_attr_t attr;
    uint64_t mask = 0;
    ucs_status_t st;
    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    st = ucp_context_query(w->context, &attr);
    if (st != UCS_OK) return st;
    if (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_HOST)) {
        mask |= 1ull << KVF_MEMORY_TYPE_HOST;
    }
    if (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) {
        mask |= 1ull << KVF_MEMORY_TYPE_CUDA;
    }
    *mask_p = mask;
    *ucs_mask_p = attr.memory_types;
    return UCS_OK;
}

ucs_status_t kvf_mem_map(kvf_worker_h w, const kvf_mem_map_params_t *p, kvf_mem_h *memh_p,
                         void **base_p, size_t *length_p)
{
    ucp_mem_map_params_t params;
    ucp_mem_attr_t attr;
    ucp_mem_h memh;
    ucs_status_t st;
    uint64_t mask = p->field_mask, types, ucs_types;
    unsigned flags = (mask & KVF_MEM_MAP_PARAM_FIELD_FLAGS) ? p->flags : 0;
    int allocate = (flags & KVF_MEM_MAP_FLAG_ALLOCATE) != 0;
    int32_t type = (mask & KVF_MEM_MAP_PARAM_FIELD_MEMORY_TYPE) ? p->memory_type
                                                                 : KVF_MEMORY_TYPE_HOST;
    if (type != KVF_MEMORY_TYPE_HOST && type != KVF_MEMORY_TYPE_CUDA) {
        return UCS_ERR_INVALID_PARAM;
    }
    if (allocate && type != KVF_MEMORY_TYPE_HOST) return UCS_ERR_INVALID_PARAM;
    if (type != KVF_MEMORY_TYPE_HOST) {
        /* ucp_mem_map skips the memory domains that cannot register this type and
         * reports success with none: refuse here instead of handing out a key that
         * makes every put a host-memory access of a device pointer. */
        st = kvf_memory_types(w, &types, &ucs_types);
        if (st != UCS_OK) return st;
        if (!(types & (1ull << type))) return UCS_ERR_UNSUPPORTED;
    }
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    params.address = allocate || !(mask & KVF_MEM_MAP_PARAM_FIELD_ADDRESS) ? NULL : p->address;
    params.length = p->length;
    params.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
    params.memory_type = type == KVF_MEMORY_TYPE_CUDA ? UCS_MEMORY_TYPE_CUDA
                                                      : UCS_MEMORY_TYPE_HOST;
    st = ucp_mem_map(w->context, &params, &memh);
    if (st != UCS_OK) return st;
    memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    st = ucp_mem_query(memh, &attr);
    if (st != UCS_OK) {
        ucp_mem_unmap(w->context, memh);
        return st;
    }
    *memh_p = (kvf_mem_h)(void *)memh;
    *base_p = attr.address;
    *length_p = attr.length;
    return UCS_OK;
}

ucs_status_t kvf_mem_unmap(kvf_worker_h w, kvf_mem_h memh)
{
    return ucp_mem_unmap(w->context, kvf_ucp_mem(memh));
}

ucs_status_t kvf_rkey_pack(kvf_worker_h w, kvf_mem_h memh, void **buffer_p, size_t *size_p)
{
    void *buffer;
    size_t size;
    ucs_status_t st = ucp_rkey_pack(w->context, kvf_ucp_mem(memh), &buffer, &size);
    if (st != UCS_OK) return st;
    *buffer_p = buffer;
    *size_p = size;
    return UCS_OK;
}

void kvf_rkey_buffer_release(void *buffer) { ucp_rkey_buffer_release(buffer); }

ucs_status_t kvf_rkey_unpack(kvf_ep_h ep, const void *buffer, kvf_rkey_h *rkey_p)
{
    ucp_rkey_h rkey;
    ucs_status_t st = ucp_ep_rkey_unpack(kvf_ucp_ep(ep), buffer, &rkey);
    if (st != UCS_OK) return st;
    *rkey_p = (kvf_rkey_h)(void *)rkey;
    return UCS_OK;
}

void kvf_rkey_destroy(kvf_rkey_h rkey) { ucp_rkey_destroy(kvf_ucp_rkey(rkey)); }

ucs_status_t kvf_rkey_ptr(kvf_rkey_h rkey, uint64_t remote_addr, void **local_p)
{
    void *local;
    ucs_status_t st = ucp_rkey_ptr(kvf_ucp_rkey(rkey), remote_addr, &local);
    if (st != UCS_OK) return st;
    *local_p = local;
    return UCS_OK;
}

int kvf_prefault(uintptr_t address, int64_t length)
{
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = address & ~(uintptr_t)(page - 1);
    size_t len = (size_t)(address + (uintptr_t)length - start);
    return madvise((void *)start, len, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
}

static void kvf_batch_fail(kvf_batch_t *b, ucs_status_t st)
{
    if (st != UCS_OK && b->status == 0) b->status = st;
}

static void kvf_op_done(void *request, ucs_status_t status, void *user_data)
{
    kvf_batch_t *b = (kvf_batch_t *)user_data;
    kvf_batch_fail(b, status);
    b->outstanding--;
    ucp_request_free(request);
}

static ucs_status_t kvf_track(ucs_status_ptr_t p, kvf_batch_t *b)
{
    if (p == NULL) return UCS_OK;
    if (UCS_PTR_IS_ERR(p)) {
        kvf_batch_fail(b, UCS_PTR_STATUS(p));
        return UCS_PTR_STATUS(p);
    }
    b->outstanding++;
    return UCS_OK;
}

static void kvf_param_init(ucp_request_param_t *param, kvf_batch_t *b,
                           ucs_memory_type_t memory_type)
{
    memset(param, 0, sizeof(*param));
    param->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                          UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param->cb.send = kvf_op_done;
    param->user_data = b;
    param->memory_type = memory_type;
}

int32_t kvf_rma_ucs_memory_type(const kvf_rma_param_t *p)
{
    if ((p->field_mask & KVF_RMA_PARAM_FIELD_LOCAL_MEMORY_TYPE) &&
        p->local_memory_type == KVF_MEMORY_TYPE_CUDA) {
        return UCS_MEMORY_TYPE_CUDA;
    }
    return UCS_MEMORY_TYPE_HOST;
}

ucs_status_t kvf_flush(kvf_ep_h ep, kvf_batch_t *batch)
{
    ucp_request_param_t param;
    kvf_param_init(&param, batch, UCS_MEMORY_TYPE_HOST);
    param.op_attr_mask &= ~(uint32_t)UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    return kvf_track(ucp_ep_flush_nbx(kvf_ucp_ep(ep), &param), batch);
}

/* Copy into another process's mapping with streaming (non-temporal) stores: the lines
 * go to memory without first being read for ownership, which on this path they would
 * otherwise be (the reader's core holds them from the previous use of the page). Whole
 * 64-byte lines only; the unaligned head and tail go through memcpy. The caller fences. */
static void kvf_copy_streaming(char *dst, const char *src, size_t n)
{
#if defined(__x86_64__)
    size_t head = (size_t)(-(uintptr_t)dst & 63);
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
#endif
    memcpy(dst, src, n);
}

/* One page written into another process's memory, as the direct path and the benchmark's
 * ceiling copy it. The caller fences (streaming stores are weakly ordered). */
static void kvf_copy_out(char *dst, const char *src, size_t n, int streaming)
{
    if (streaming) kvf_copy_streaming(dst, src, n);
    else memcpy(dst, src, n);
}

/* Streaming stores for batches of at least streaming_min_bytes (-1: never). Small batches
 * are copied through the caches, which often still hold their lines; large ones stream
 * past them (no read-for-ownership, no eviction of everything else). */
static int kvf_streams(int64_t streaming_min_bytes, int64_t total)
{
    return streaming_min_bytes >= 0 && total >= streaming_min_bytes;
}

/* Posts the n pages of a checked batch: direct copies when direct_base is set, else one
 * ucp_put_nbx/ucp_get_nbx per run, where a run is as many consecutive pages as are
 * contiguous both here and there (a reshaped plan's pieces of one page, or pages that
 * follow each other on both sides); stops at the first posting error (in the batch too). */
static ucs_status_t kvf_post_pages(ucp_ep_h ep, int write, int streaming, char *local_base,
                                   ucs_memory_type_t local_type, ucp_rkey_h rkey,
                                   uint64_t remote_base, char *direct_base,
                                   const int64_t *pages, int64_t n, int64_t skip,
                                   kvf_batch_t *batch)
{
    ucp_request_param_t param;
    ucs_status_t st;
    int64_t i = 0;
    kvf_param_init(&param, batch, local_type);
    if (!write && direct_base != NULL) __atomic_thread_fence(__ATOMIC_ACQUIRE);
    while (i < n) {
        const int64_t *t = pages + 3 * i;
        int64_t local_off = t[0], remote_off = t[1], len = t[2], joined = 1;
        if (i == skip) { /* injected fault: this page is never transferred */
            ++i;
            continue;
        }
        for (++i; i < n && i != skip; ++i, ++joined) { /* the run goes on while both do */
            const int64_t *u = pages + 3 * i;
            if (u[0] != local_off + len || u[1] != remote_off + len) break;
            len += u[2];
        }
        if (direct_base != NULL) {
            if (write) kvf_copy_out(direct_base + remote_off, local_base + local_off,
                                    (size_t)len, streaming);
            else memcpy(local_base + local_off, direct_base + remote_off, (size_t)len);
            batch->direct += joined;
        } else if (len > 0) {
            ucs_status_ptr_t p = write
                ? ucp_put_nbx(ep, local_base + local_off, (size_t)len,
                              remote_base + (uint64_t)remote_off, rkey, &param)
                : ucp_get_nbx(ep, local_base + local_off, (size_t)len,
                              remote_base + (uint64_t)remote_off, rkey, &param);
            st = kvf_track(p, batch);
            if (st != UCS_OK) return st;
        }
        batch->posted += joined;
    }
    if (write && direct_base != NULL) {
#if defined(__x86_64__)
        _mm_sfence();  /* streaming stores are weakly ordered: drain them first */
#endif
        __atomic_thread_fence(__ATOMIC_RELEASE);
    }
    return UCS_OK;
}

/* Pages per cross-memory system call: the kernel's limit on iovecs (UIO_MAXIOV). */
#define KVF_CMA_IOVS 1024

/* Whether the process behind pidfd has exited (its pidfd polls readable). A pidfd that
 * cannot be polled counts as exited: nothing is written on a guess. */
static int kvf_process_exited(int pidfd)
{
    struct pollfd p;
    int r;
    p.fd = pidfd;
    p.events = POLLIN;
    p.revents = 0;
    do {
        r = poll(&p, 1, 0);
    } while (r < 0 && errno == EINTR);
    return r != 0;
}

/* The UCX status standing for a cross-memory copy's errno. */
static ucs_status_t kvf_cma_status(int err)
{
    switch (err) {
    case ESRCH: return UCS_ERR_CONNECTION_RESET;  /* the process is gone */
    case EFAULT: return UCS_ERR_INVALID_ADDR;     /* not mapped there (any more) */
    case EPERM: return UCS_ERR_UNSUPPORTED;       /* ptrace rules forbid it */
    case ENOMEM: return UCS_ERR_NO_MEMORY;
    default: return UCS_ERR_IO_ERROR;
    }
}

/* Appends [base, base + len) to the n entries of an iovec list, extending the last one
 * when the two are contiguous; the list's new length. */
static int kvf_iov_append(struct iovec *v, int n, char *base, size_t len)
{
    if (n > 0 && (char *)v[n - 1].iov_base + v[n - 1].iov_len == base) {
        v[n - 1].iov_len += len;
        return n;
    }
    v[n].iov_base = base;
    v[n].iov_len = len;
    return n + 1;
}

/* Skips `bytes` from entry *first of an n-entry iovec list (after a partial transfer). */
static void kvf_iov_skip(struct iovec *v, int n, int *first, size_t bytes)
{
    while (bytes > 0 && *first < n) {
        size_t step = bytes < v[*first].iov_len ? bytes : v[*first].iov_len;
        v[*first].iov_base = (char *)v[*first].iov_base + step;
        v[*first].iov_len -= step;
        bytes -= step;
        if (v[*first].iov_len == 0) ++*first;
    }
}

/* Moves the bytes of nl local iovecs into nr remote ones (`want` bytes on each side; the
 * kernel pairs them as two streams, so the lists need not match entry for entry),
 * resuming after a partial transfer; UCS_OK or the status of the call that failed. */
static ucs_status_t kvf_cma_move(int write, int32_t pid, struct iovec *local, int nl,
                                 struct iovec *remote, int nr, size_t want)
{
    size_t done = 0;
    int fl = 0, fr = 0;
    while (done < want) {
        ssize_t r = write ? process_vm_writev(pid, local + fl, (unsigned long)(nl - fl),
                                              remote + fr, (unsigned long)(nr - fr), 0)
                          : process_vm_readv(pid, local + fl, (unsigned long)(nl - fl),
                                             remote + fr, (unsigned long)(nr - fr), 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return kvf_cma_status(errno);
        }
        if (r == 0) return UCS_ERR_IO_ERROR;
        done += (size_t)r;
        kvf_iov_skip(local, nl, &fl, (size_t)r);
        kvf_iov_skip(remote, nr, &fr, (size_t)r);
    }
    return UCS_OK;
}

/* Moves the n pages of a checked batch by the kernel's cross-memory copy. Each side's
 * pieces are joined where they are contiguous on that side: what costs the kernel is the
 * remote pieces (each pins the target's pages anew), so a plan whose small runs fill a
 * target page in order moves it as one remote piece, whatever its local pieces. Up to
 * KVF_CMA_IOVS pieces a side per call. Synchronous: the bytes are at the target when this
 * returns, so nothing needs a flush. The process is checked through its pidfd before the
 * first call and after the last (a pid is only reused once its process exited and was
 * reaped, which the first check excludes up to the call; the second fails a batch whose
 * target died meanwhile). */
static ucs_status_t kvf_post_pages_cma(int write, int32_t pid, int pidfd, char *local_base,
                                       uint64_t remote_base, const int64_t *pages, int64_t n,
                                       int64_t skip, kvf_batch_t *batch)
{
    struct iovec local[KVF_CMA_IOVS], remote[KVF_CMA_IOVS];
    ucs_status_t st;
    int64_t i = 0;
    if (kvf_process_exited(pidfd)) {
        kvf_batch_fail(batch, UCS_ERR_CONNECTION_RESET);
        return UCS_ERR_CONNECTION_RESET;
    }
    while (i < n) {
        int nl = 0, nr = 0;
        size_t want = 0;
        for (; i < n && nl < KVF_CMA_IOVS && nr < KVF_CMA_IOVS; ++i) {
            const int64_t *t = pages + 3 * i;
            if (i == skip) continue; /* injected fault: this page is never transferred */
            batch->posted++;
            batch->direct++;
            if (t[2] == 0) continue;
            nl = kvf_iov_append(local, nl, local_base + t[0], (size_t)t[2]);
            nr = kvf_iov_append(remote, nr, (char *)(uintptr_t)(remote_base + (uint64_t)t[1]),
                                (size_t)t[2]);
            want += (size_t)t[2];
        }
        if (want == 0) continue;
        st = kvf_cma_move(write, pid, local, nl, remote, nr, want);
        if (st != UCS_OK) {
            kvf_batch_fail(batch, st);
            return st;
        }
    }
    if (kvf_process_exited(pidfd)) {
        kvf_batch_fail(batch, UCS_ERR_CONNECTION_RESET);
        return UCS_ERR_CONNECTION_RESET;
    }
    return UCS_OK;
}

int kvf_cma_probe(int32_t pid, uint64_t remote_addr)
{
    char byte;
    struct iovec local = {&byte, 1};
    struct iovec remote = {(void *)(uintptr_t)remote_addr, 1};
    return process_vm_readv(pid, &local, 1, &remote, 1, 0) == 1 ? 0 : errno;
}

/* Checks every page of param against both segments, then posts them all (*posted: the
 * posting's status). UCS_ERR_OUT_OF_RANGE when a page is out of bounds (nothing posted,
 * batch untouched). */
static ucs_status_t kvf_check_and_post(ucp_ep_h ep, int write, const kvf_rma_param_t *p,
                                       kvf_batch_t *batch, ucs_status_t *posted)
{
    uint64_t mask = p->field_mask;
    int64_t total = 0;
    int64_t streaming_min = (mask & KVF_RMA_PARAM_FIELD_STREAMING_MIN_BYTES)
                            ? p->streaming_min_bytes : -1;
    int64_t skip = (mask & KVF_RMA_PARAM_FIELD_SKIP_PAGE) ? p->skip_page : -1;
    char *direct = (mask & KVF_RMA_PARAM_FIELD_DIRECT_BASE) ? (char *)p->direct_base : NULL;
    if (kvf_check_pages(p->pages, p->npages, p->local_length, p->remote_length, &total) >= 0) {
        return UCS_ERR_OUT_OF_RANGE;
    }
    if (kvf_rma_ucs_memory_type(p) != UCS_MEMORY_TYPE_HOST &&
        (direct != NULL || (mask & KVF_RMA_PARAM_FIELD_PEER_PROCESS))) {
        return UCS_ERR_INVALID_PARAM; /* device memory is never copied by the CPU */
    }
    batch->bytes = total;
    if (direct == NULL && (mask & KVF_RMA_PARAM_FIELD_PEER_PROCESS)) {
        *posted = kvf_post_pages_cma(write, p->peer_pid, p->peer_pidfd, (char *)p->local_base,
                                     p->remote_base, p->pages, p->npages, skip, batch);
        return UCS_OK;
    }
    *posted = kvf_post_pages(ep, write, kvf_streams(streaming_min, total),
                             (char *)p->local_base,
                             (ucs_memory_type_t)kvf_rma_ucs_memory_type(p),
                             kvf_ucp_rkey(p->rkey), p->remote_base, direct, p->pages,
                             p->npages, skip, batch);
    return UCS_OK;
}

ucs_status_t kvf_put_pages(kvf_ep_h ep, const kvf_rma_param_t *param, kvf_batch_t *batch)
{
    ucs_status_t posted = UCS_OK;
    ucs_status_t st = kvf_check_and_post(kvf_ucp_ep(ep), 1, param, batch, &posted);
    if (st != UCS_OK) return st;
    if (posted != UCS_OK) return UCS_OK;   /* the error is the batch's */
    if (param->field_mask & KVF_RMA_PARAM_FIELD_NOTICE) {
        /* the notice's flush, when it needs one, also flushes the pages put through UCX */
        kvf_msg_param_t notice = *param->notice;
        notice.flags |= KVF_MSG_FLAG_NOTICE;
        if (batch->posted != batch->direct) notice.flags |= KVF_MSG_FLAG_FLUSH;
        kvf_msg_send(ep, &notice, batch);
    } else if (batch->posted != batch->direct) {
        kvf_flush(ep, batch);
    }
    return UCS_OK;
}

ucs_status_t kvf_get_pages(kvf_ep_h ep, const kvf_rma_param_t *param, kvf_batch_t *batch)
{
    ucs_status_t posted = UCS_OK;
    if (param->field_mask & KVF_RMA_PARAM_FIELD_NOTICE) return UCS_ERR_INVALID_PARAM;
    return kvf_check_and_post(kvf_ucp_ep(ep), 0, param, batch, &posted);
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
    p = ucp_am_send_nbx(ctx->ep, KVF_AM_ID, NULL, 0, ctx->payload, ctx->length, &param);
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

/* The notice is posted from the flush's completion: it cannot overtake any earlier put. */
static void kvf_flush_done_send(void *request, ucs_status_t status, void *user_data)
{
    kvf_send_ctx *ctx = (kvf_send_ctx *)user_data;
    kvf_batch_t *b = ctx->batch;
    if (status == UCS_OK) {
        kvf_post_send(ctx);
    } else {
        kvf_batch_fail(b, status);
        free(ctx);
    }
    b->outstanding--;
    if (request != NULL) ucp_request_free(request);
}

static ucs_status_t kvf_flush_then_post(kvf_send_ctx *ctx)
{
    ucp_request_param_t param;
    ucs_status_ptr_t p;
    kvf_batch_t *batch = ctx->batch;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = kvf_flush_done_send;
    param.user_data = ctx;
    batch->outstanding++;
    p = ucp_ep_flush_nbx(ctx->ep, &param);
    if (p == NULL) {
        kvf_flush_done_send(NULL, UCS_OK, ctx);
        return (ucs_status_t)batch->status;
    }
    if (UCS_PTR_IS_ERR(p)) {
        ucs_status_t st = UCS_PTR_STATUS(p);
        kvf_flush_done_send(NULL, st, ctx);
        return st;
    }
    return UCS_OK;
}

/* A send context for `length` bytes on ep, not yet filled (the batch's NO_MEMORY). */
static kvf_send_ctx *kvf_send_ctx_new(kvf_ep_h ep, size_t length, kvf_batch_t *batch)
{
    kvf_send_ctx *ctx = (kvf_send_ctx *)malloc(sizeof(kvf_send_ctx) + length);
    if (ctx == NULL) {
        kvf_batch_fail(batch, UCS_ERR_NO_MEMORY);
        return NULL;
    }
    ctx->batch = batch;
    ctx->ep = kvf_ucp_ep(ep);
    ctx->length = length;
    return ctx;
}

static ucs_status_t kvf_send_ctx_post(kvf_send_ctx *ctx, unsigned flags)
{
    return (flags & KVF_MSG_FLAG_FLUSH) ? kvf_flush_then_post(ctx) : kvf_post_send(ctx);
}

ucs_status_t kvf_raw_send(kvf_ep_h ep, const void *data, size_t length, unsigned flags,
                          kvf_batch_t *batch)
{
    kvf_send_ctx *ctx = kvf_send_ctx_new(ep, length, batch);
    if (ctx == NULL) return UCS_ERR_NO_MEMORY;
    memcpy(ctx->payload, data, length);
    return kvf_send_ctx_post(ctx, flags);
}

/* One allocation: the envelope is built straight into the send buffer. */
ucs_status_t kvf_msg_send(kvf_ep_h ep, const kvf_msg_param_t *msg, kvf_batch_t *batch)
{
    size_t total = KVF_ENV_HEADER + msg->sender_length + msg->payload_length;
    kvf_send_ctx *ctx = kvf_send_ctx_new(ep, total, batch);
    if (ctx == NULL) return UCS_ERR_NO_MEMORY;
    ctx->length = kvf_envelope_encode(msg, ctx->payload, total);
    if (ctx->length == 0) {
        free(ctx);
        kvf_batch_fail(batch, UCS_ERR_MESSAGE_TRUNCATED);
        return UCS_ERR_MESSAGE_TRUNCATED;
    }
    return kvf_send_ctx_post(ctx, msg->flags);
}

kvf_msg_t *kvf_am_pop(kvf_worker_h w)
{
    kvf_msg_t *m = w->head;
    if (m != NULL) {
        w->head = m->next;
        if (w->head == NULL) w->tail = NULL;
        m->next = NULL;
    }
    return m;
}

void kvf_msg_free(kvf_msg_t *m) { free(m); }

int64_t kvf_am_dropped(kvf_worker_h w) { return w->dropped; }

void kvf_memcpy_pages(char *dst, const char *src, const int64_t *pages, int64_t n,
                      unsigned flags)
{
    int streaming = (flags & KVF_COPY_FLAG_STREAMING) != 0;
    int64_t i;
    for (i = 0; i < n; ++i) {
        const int64_t *t = pages + 3 * i;
        kvf_copy_out(dst + t[1], src + t[0], (size_t)t[2], streaming);
    }
#if defined(__x86_64__)
    if (streaming) _mm_sfence();
#endif
}

int64_t kvf_check_pages(const int64_t *pages, int64_t n, int64_t local_len,
                        int64_t remote_len, int64_t *total)
{
    int64_t i, sum = 0;
    for (i = 0; i < n; ++i) {
        const int64_t lo = pages[3 * i], ro = pages[3 * i + 1], ln = pages[3 * i + 2];
        if (ln <= 0 || lo < 0 || ro < 0 || ln > local_len || ln > remote_len ||
            lo > local_len - ln || ro > remote_len - ln) {
            return i;
        }
        sum += ln;
    }
    *total = sum;
    return -1;
}

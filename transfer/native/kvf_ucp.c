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
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include <ucp/api/ucp_version.h>
#include <uct/api/uct.h>
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
    kvf_msg *head;
    kvf_msg *tail;
    int64_t dropped;
    int64_t max_sender;       /* envelope limits applied on receipt */
    int64_t max_payload;
    int64_t busy_poll_us;     /* keep polling this long after the last activity */
    int64_t last_activity_us; /* last time progress did something or a message came */
    char bad_option[128];
};

#define KVF_AM_ID 7

/* Message envelope (see transfer/envelope.py, the reference codec):
 *   0 magic "KVFE" | 4 version u8 | 5 flags u8 | 6 reserved u16 (0)
 *   8 incarnation u64 | 16 seq u64 | 24 sender length u32 | 28 payload length u32
 *   32 sender address bytes | payload bytes; little-endian, nothing after the payload. */
#define KVF_ENV_HEADER 32
#define KVF_ENV_VERSION 2
#define KVF_ENV_FLAG_FLUSHED 1
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the envelope codec assumes a little-endian host"
#endif
enum {
    KVF_ENV_OK = 0, KVF_ENV_SHORT = 1, KVF_ENV_MAGIC = 2, KVF_ENV_VERSION_MISMATCH = 3,
    KVF_ENV_FLAGS = 4, KVF_ENV_SENDER_SIZE = 5, KVF_ENV_PAYLOAD_SIZE = 6, KVF_ENV_LENGTH = 7
};

typedef struct kvf_send_ctx {
    kvf_batch *batch;
    ucp_ep_h ep;
    uint16_t am_id;
    size_t length;
    char payload[];
} kvf_send_ctx;

const char *kvf_status_string(int status) { return ucs_status_string((ucs_status_t)status); }

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

size_t kvf_envelope_encode(char *out, size_t cap, int flags, const char *sender,
                           size_t sender_length, uint64_t incarnation, uint64_t seq,
                           const char *payload, size_t payload_length)
{
    size_t total = KVF_ENV_HEADER + sender_length + payload_length;
    uint32_t slen = (uint32_t)sender_length, plen = (uint32_t)payload_length;
    uint16_t reserved = 0;
    uint8_t version = KVF_ENV_VERSION, fl = (uint8_t)flags;
    if (total > cap || sender_length > UINT32_MAX || payload_length > UINT32_MAX) return 0;
    memcpy(out, "KVFE", 4);
    memcpy(out + 4, &version, 1);
    memcpy(out + 5, &fl, 1);
    memcpy(out + 6, &reserved, 2);
    memcpy(out + 8, &incarnation, 8);
    memcpy(out + 16, &seq, 8);
    memcpy(out + 24, &slen, 4);
    memcpy(out + 28, &plen, 4);
    memcpy(out + KVF_ENV_HEADER, sender, sender_length);
    if (payload_length) memcpy(out + KVF_ENV_HEADER + sender_length, payload, payload_length);
    return total;
}

/* Checks every header field and that the lengths add up to exactly `length`. */
int kvf_envelope_parse(const char *data, size_t length, int64_t max_sender,
                       int64_t max_payload, kvf_envelope *out)
{
    uint32_t slen, plen;
    uint16_t reserved;
    memset(out, 0, sizeof(*out));
    out->error = KVF_ENV_SHORT;
    if (length < KVF_ENV_HEADER) return out->error;
    out->error = KVF_ENV_MAGIC;
    if (memcmp(data, "KVFE", 4) != 0) return out->error;
    out->error = KVF_ENV_VERSION_MISMATCH;
    if ((uint8_t)data[4] != KVF_ENV_VERSION) return out->error;
    memcpy(&reserved, data + 6, 2);
    out->error = KVF_ENV_FLAGS;
    if (((uint8_t)data[5] & ~KVF_ENV_FLAG_FLUSHED) != 0 || reserved != 0) return out->error;
    memcpy(&slen, data + 24, 4);
    memcpy(&plen, data + 28, 4);
    out->error = KVF_ENV_SENDER_SIZE;
    if (slen == 0 || (int64_t)slen > max_sender) return out->error;
    out->error = KVF_ENV_PAYLOAD_SIZE;
    if ((int64_t)plen > max_payload) return out->error;
    out->error = KVF_ENV_LENGTH;
    if ((uint64_t)KVF_ENV_HEADER + slen + plen != (uint64_t)length) return out->error;
    out->error = KVF_ENV_OK;
    out->flags = (uint8_t)data[5];
    memcpy(&out->incarnation, data + 8, 8);
    memcpy(&out->seq, data + 16, 8);
    out->sender = data + KVF_ENV_HEADER;
    out->sender_length = slen;
    out->payload = data + KVF_ENV_HEADER + slen;
    out->payload_length = plen;
    return KVF_ENV_OK;
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
    kvf_envelope_parse(m->data, length, w->max_sender, w->max_payload, &m->env);
    w->last_activity_us = kvf_now_us();
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
    w->max_sender = max_am_bytes;
    w->max_payload = max_am_bytes;
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

/* Arm the event fd before sleeping on it outside kvf_worker_wait: 1 when armed (the fd
 * signals the next event), 0 when work is pending (UCX events, or received messages not
 * yet popped), else the ucs_status_t of the failure. */
int kvf_worker_arm(kvf_worker *w)
{
    ucs_status_t st = ucp_worker_arm(w->worker);
    if (st == UCS_ERR_BUSY) return 0;
    if (st != UCS_OK) return (int)st;
    return w->head == NULL;
}

void kvf_worker_configure(kvf_worker *w, int64_t max_sender, int64_t max_payload,
                          int64_t busy_poll_us)
{
    w->max_sender = max_sender;
    w->max_payload = max_payload;
    w->busy_poll_us = busy_poll_us > 0 ? busy_poll_us : 0;
}

unsigned kvf_worker_progress(kvf_worker *w)
{
    unsigned n = ucp_worker_progress(w->worker);
    if (n) w->last_activity_us = kvf_now_us();
    return n;
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

/* Progress; if nothing happened, poll until the later of now + spin_us and the end of the
 * busy window (busy_poll_us after the last activity), then arm the event fd and sleep in
 * poll() for the rest of timeout_ms. Under traffic the window keeps the thread awake, so
 * a message costs no wake-up; an idle worker sleeps. stay_awake: poll for all of
 * timeout_ms (a caller expecting a reply soon: a sleeping vCPU can take milliseconds to
 * wake). Past spin_us the loop naps between polls (kvf_nap). The GIL is released by cffi
 * around this call. */
int kvf_worker_wait(kvf_worker *w, int timeout_ms, int spin_us, int stay_awake)
{
    unsigned n = kvf_worker_progress(w);
    int64_t now, deadline, spin_until, nap_after, remaining_ms;
    struct pollfd pfd;
    int armed;
    if (n || w->head || timeout_ms == 0) return (int)n;
    now = kvf_now_us();
    deadline = now + (int64_t)timeout_ms * 1000;
    nap_after = now + (spin_us > 0 ? spin_us : 0);
    spin_until = nap_after;
    if (w->last_activity_us + w->busy_poll_us > spin_until) {
        spin_until = w->last_activity_us + w->busy_poll_us;
    }
    if (spin_until > deadline || stay_awake) spin_until = deadline;
    while (now < spin_until) {
        n = ucp_worker_progress(w->worker);
        if (n || w->head) {
            if (n) w->last_activity_us = kvf_now_us();
            return (int)n;
        }
        now = kvf_now_us();
        if (now >= nap_after) kvf_nap();
    }
    if (now >= deadline) return 0;
    armed = kvf_worker_arm(w);
    if (armed < 0) return armed;
    if (armed == 0) return (int)kvf_worker_progress(w);
    pfd.fd = w->efd;
    pfd.events = POLLIN;
    pfd.revents = 0;
    remaining_ms = (deadline - now + 999) / 1000;
    poll(&pfd, 1, (int)(remaining_ms > 0 ? remaining_ms : 0));
    return (int)kvf_worker_progress(w);
}

int kvf_ep_create(kvf_worker *w, const void *addr, void **ep)
{
    ucp_ep_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = (const ucp_address_t *)addr;
    return ucp_ep_create(w->worker, &params, (ucp_ep_h *)ep);
}

/* The endpoint's lanes as "transport/device,..." (ucp_ep_query). UCS_ERR_UNSUPPORTED
 * when built against a UCX without that query: use kvf_ep_print_info then. */
int kvf_ep_transports(void *ep, char *out, size_t cap)
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
#else
    (void)ep; (void)cap;
    out[0] = '\0';
    return UCS_ERR_UNSUPPORTED;
#endif
}

/* ucp_ep_print_info's text (the endpoint's configuration and lanes), truncated to cap - 1
 * bytes and NUL-terminated. Returns the full length, or -1 when it could not be captured. */
int64_t kvf_ep_print_info(void *ep, char *out, size_t cap)
{
    char *text = NULL;
    size_t length = 0;
    FILE *f = open_memstream(&text, &length);
    if (f == NULL) return -1;
    ucp_ep_print_info((ucp_ep_h)ep, f);
    fclose(f);
    if (cap > 0) {
        size_t n = length < cap - 1 ? length : cap - 1;
        if (n) memcpy(out, text, n);
        out[n] = '\0';
    }
    free(text);
    return (int64_t)length;
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

/* The value that transport `tl` of component `component` would use for its interface
 * option `name` (e.g. "tcp", "tcp", "KEEPIDLE"), as this UCX reads it: the environment,
 * else its default. UCS_ERR_NO_ELEM when this UCX has no such option (or component);
 * UCS_ERR_NO_DEVICE when the component has no device to read it from. */
int kvf_uct_iface_option(const char *component, const char *tl, const char *name,
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

/* What this UCX offers below ucp: one line per component, "name<TAB>md md ...", and for
 * each memory domain of the components named in `open` (comma-separated, e.g. "ib,mlx5";
 * opening one opens its device) one line "name<TAB>md<TAB> tl/dev tl/dev ...".
 * Returns 0, or the ucs_status_t of the failed component query. */
int kvf_uct_inventory(const char *open, char *out, size_t cap)
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

/* Populate this process's page tables for a peer's mapped segment (writable), so the
 * first write to each page costs no fault. Returns 0, or errno (e.g. EINVAL on kernels
 * before 5.14, which lack MADV_POPULATE_WRITE; the mapping then faults lazily). */
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

static ucs_status_t kvf_post_pages(void *ep, int write, int streaming, char *local_base,
                                   void *rkey, uint64_t remote_base, char *direct_base,
                                   const int64_t *triples, int64_t n, int64_t skip,
                                   kvf_batch *batch)
{
    ucp_request_param_t param;
    ucs_status_t st;
    int64_t i;
    kvf_param_init(&param, batch);
    if (!write && direct_base != NULL) __atomic_thread_fence(__ATOMIC_ACQUIRE);
    for (i = 0; i < n; ++i) {
        const int64_t *t = triples + 3 * i;
        char *local = local_base + t[0];
        if (i == skip) continue; /* injected fault: this page is never transferred */
        if (direct_base != NULL) {
            if (write) kvf_copy_out(direct_base + t[1], local, (size_t)t[2], streaming);
            else memcpy(local, direct_base + t[1], (size_t)t[2]);
            batch->direct++;
        } else {
            ucs_status_ptr_t p = write
                ? ucp_put_nbx((ucp_ep_h)ep, local, (size_t)t[2], remote_base + (uint64_t)t[1],
                              (ucp_rkey_h)rkey, &param)
                : ucp_get_nbx((ucp_ep_h)ep, local, (size_t)t[2], remote_base + (uint64_t)t[1],
                              (ucp_rkey_h)rkey, &param);
            st = kvf_track(p, batch);
            if (st != UCS_OK) return st;
        }
        batch->posted++;
    }
    if (write && direct_base != NULL) {
#if defined(__x86_64__)
        _mm_sfence();  /* streaming stores are weakly ordered: drain them first */
#endif
        __atomic_thread_fence(__ATOMIC_RELEASE);
    }
    return UCS_OK;
}

/* Bounds-check every page against both segments, then post them all (*st: the posting's
 * status). Returns -1, or the index of the first page out of bounds (nothing posted). */
static int64_t kvf_check_and_post(void *ep, int write, int64_t streaming_min_bytes,
                                  uintptr_t local_base, int64_t local_len, void *rkey,
                                  uint64_t remote_base, int64_t remote_len,
                                  uintptr_t direct_base, const void *triples, int64_t n,
                                  int64_t skip, kvf_batch *batch, ucs_status_t *st)
{
    int64_t total = 0;
    int64_t bad = kvf_check_pages((const int64_t *)triples, n, local_len, remote_len, &total);
    if (bad >= 0) return bad;
    batch->bytes = total;
    *st = kvf_post_pages(ep, write, kvf_streams(streaming_min_bytes, total),
                         (char *)local_base, rkey, remote_base, (char *)direct_base,
                         (const int64_t *)triples, n, skip, batch);
    return -1;
}

/* One call per batch: bounds-check every page against both segments, then post them all.
 * A write completes only once visible at the target: pages put through UCX are followed by
 * an endpoint flush; direct pages are visible once the copy's fences have run.
 * Returns -1 when posted (errors land in batch->status), or the index of the first page
 * out of bounds, in which case nothing was posted. batch->bytes gets the byte count. */
int64_t kvf_rma_pages(void *ep, int write, int64_t streaming_min_bytes,
                      uintptr_t local_base, int64_t local_len, void *rkey,
                      uint64_t remote_base, int64_t remote_len, uintptr_t direct_base,
                      const void *triples, int64_t n, int64_t skip, kvf_batch *batch)
{
    ucs_status_t st = UCS_OK;
    int64_t bad = kvf_check_and_post(ep, write, streaming_min_bytes, local_base, local_len,
                                     rkey, remote_base, remote_len, direct_base, triples, n,
                                     skip, batch, &st);
    if (bad >= 0) return bad;
    if (st == UCS_OK && write && batch->posted != batch->direct) kvf_flush(ep, batch);
    return -1;
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

static int kvf_flush_then_post(void *ep, kvf_send_ctx *ctx)
{
    ucp_request_param_t param;
    ucs_status_ptr_t p;
    kvf_batch *batch = ctx->batch;
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

int kvf_flush_then_send(void *ep, uint16_t am_id, const void *payload, size_t length,
                        kvf_batch *batch)
{
    kvf_send_ctx *ctx = kvf_send_ctx_new(ep, am_id, payload, length, batch);
    if (ctx == NULL) { kvf_batch_fail(batch, UCS_ERR_NO_MEMORY); return UCS_ERR_NO_MEMORY; }
    return kvf_flush_then_post(ep, ctx);
}

/* Builds the envelope straight into the send buffer (one allocation, no Python codec)
 * and posts it. flags bit 0: the envelope is a notice (marked flushed); bit 1: post it
 * only after an endpoint flush, i.e. after every earlier put on ep is visible. The caller
 * clears bit 1 only when no put through UCX can still be outstanding on ep. */
int kvf_send_envelope(void *ep, int flags, const char *sender, size_t sender_length,
                      uint64_t incarnation, uint64_t seq, const char *payload,
                      size_t payload_length, kvf_batch *batch)
{
    size_t total = KVF_ENV_HEADER + sender_length + payload_length;
    kvf_send_ctx *ctx = (kvf_send_ctx *)malloc(sizeof(kvf_send_ctx) + total);
    if (ctx == NULL) { kvf_batch_fail(batch, UCS_ERR_NO_MEMORY); return UCS_ERR_NO_MEMORY; }
    ctx->batch = batch;
    ctx->ep = (ucp_ep_h)ep;
    ctx->am_id = KVF_AM_ID;
    ctx->length = kvf_envelope_encode(ctx->payload, total,
                                      (flags & 1) ? KVF_ENV_FLAG_FLUSHED : 0, sender,
                                      sender_length, incarnation, seq, payload,
                                      payload_length);
    if (ctx->length == 0) {
        free(ctx);
        kvf_batch_fail(batch, UCS_ERR_MESSAGE_TRUNCATED);
        return UCS_ERR_MESSAGE_TRUNCATED;
    }
    return (flags & 2) ? kvf_flush_then_post(ep, ctx) : kvf_post_send(ctx);
}

/* A write and its notice in one call: bounds-check, post the pages, then post the notice
 * envelope on the same endpoint, behind an endpoint flush when a put went through UCX
 * (or `flush` asks for one: an earlier put may still be outstanding). One batch tracks
 * both; the notice is not sent if posting the pages failed. Returns as kvf_rma_pages. */
int64_t kvf_write_notice(void *ep, int64_t streaming_min_bytes, uintptr_t local_base,
                         int64_t local_len, void *rkey, uint64_t remote_base,
                         int64_t remote_len, uintptr_t direct_base, const void *triples,
                         int64_t n, int64_t skip, int flush, const char *sender,
                         size_t sender_length, uint64_t incarnation, uint64_t seq,
                         const char *payload, size_t payload_length, kvf_batch *batch)
{
    ucs_status_t st = UCS_OK;
    int64_t bad = kvf_check_and_post(ep, 1, streaming_min_bytes, local_base, local_len,
                                     rkey, remote_base, remote_len, direct_base, triples, n,
                                     skip, batch, &st);
    if (bad >= 0) return bad;
    if (st != UCS_OK) return -1;
    if (batch->posted != batch->direct) flush = 1;
    kvf_send_envelope(ep, 1 | (flush ? 2 : 0), sender, sender_length, incarnation, seq,
                      payload, payload_length, batch);
    return -1;
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

int kvf_memcpy_pages(char *dst, const char *src, const int64_t *triples, int64_t n,
                     int streaming)
{
    int64_t i;
    for (i = 0; i < n; ++i) {
        const int64_t *t = triples + 3 * i;
        kvf_copy_out(dst + t[1], src + t[0], (size_t)t[2], streaming);
    }
#if defined(__x86_64__)
    if (streaming) _mm_sfence();
#endif
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

/*
 * kvmm.h: the C API of the kvmm client library (libkvmm.so and libkvmm.a, crate kvmm-capi).
 *
 * An inference process keeps its KV cache in kvmmd: it connects, attaches a session of its
 * model's geometry, appends each token's K and V rows (written in place into shared memory) and
 * runs decode attention over the session's pages, in whatever format each page is in.
 *
 *     kvmm_client *client;
 *     kvmm_session *session;
 *     kvmm_geometry g = {0};
 *     g.layers = 30; g.kv_heads = 3; g.q_heads = 9; g.head_dim = 64; g.max_tokens = 8192;
 *     if (kvmm_connect(NULL, &client) != KVMM_OK ||
 *         kvmm_attach(client, &g, NULL, &session) != KVMM_OK) {
 *         fprintf(stderr, "kvmm: %s\n", kvmm_last_error());
 *         ...
 *     }
 *     kvmm_append(session, layer, k, v, 1);        // one token: kv_heads * head_dim floats each
 *     kvmm_attention(session, layer, q, out);      // q, out: q_heads * head_dim floats
 *     kvmm_detach(session, NULL);
 *     kvmm_client_free(client);
 *
 * Errors. Every function that can fail returns a kvmm_status: KVMM_OK (0) or the gRPC code that
 * describes the failure, whether kvmmd reported it or the library found it (a NULL pointer, a
 * layer out of range). kvmm_last_error() then returns a sentence that says what went wrong and
 * what to do, for the last failed call on the calling thread. Output parameters are written only
 * on success.
 *
 * Handles. A kvmm_client is one connection to kvmmd; it may be used from several threads at
 * once, and its sessions keep the connection alive after kvmm_client_free. A kvmm_session must
 * not be used by two threads at once (different sessions may). Freeing a session, or detaching
 * it, ends it: kvmmd wipes its pages. A session attached with a linger outlives a process that
 * exits or crashes without freeing it, and a new process of the same user takes it over with
 * kvmm_resume (kvmm_orphans lists what waits).
 *
 * The library is blocking and owns its own threads; it must not be called from a signal handler.
 * Link with -lkvmm (pkg-config kvmm), or statically with libkvmm.a and what it needs from the
 * system: -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc (pkg-config kvmm-static). The static library
 * carries the Rust standard library's symbols, so link at most one Rust static library into one
 * program.
 */
#ifndef KVMM_H
#define KVMM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this API; kvmm_api_version() returns the library's. Version 2 added
 * kvmm_append16, version 3 kvmm_truncate. */
#define KVMM_API_VERSION 3

/* Status codes: the gRPC codes. */
typedef enum kvmm_status {
    KVMM_OK = 0,
    KVMM_CANCELLED = 1,
    KVMM_UNKNOWN = 2,
    KVMM_INVALID_ARGUMENT = 3,      /* bad geometry, layer out of range, wrong lengths, NULL */
    KVMM_DEADLINE_EXCEEDED = 4,
    KVMM_NOT_FOUND = 5,             /* unknown session */
    KVMM_ALREADY_EXISTS = 6,
    KVMM_PERMISSION_DENIED = 7,     /* another user's session, or the socket's permissions */
    KVMM_RESOURCE_EXHAUSTED = 8,    /* the budget or a quota; the message names which */
    KVMM_FAILED_PRECONDITION = 9,   /* the session was wiped or revoked, or another shape */
    KVMM_ABORTED = 10,
    KVMM_OUT_OF_RANGE = 11,
    KVMM_UNIMPLEMENTED = 12,
    KVMM_INTERNAL = 13,
    KVMM_UNAVAILABLE = 14,          /* kvmmd is not running or went away: reconnect */
    KVMM_DATA_LOSS = 15,            /* a page failed its authentication tag */
    KVMM_UNAUTHENTICATED = 16
} kvmm_status;

/* Element type of uncompressed pages. */
typedef enum kvmm_element {
    KVMM_ELEMENT_F16 = 0,
    KVMM_ELEMENT_BF16 = 1
} kvmm_element;

/* Scheduling class of a session: foreground sessions are demoted last. */
typedef enum kvmm_priority {
    KVMM_PRIORITY_FOREGROUND = 0,
    KVMM_PRIORITY_BACKGROUND = 1,
    KVMM_PRIORITY_BATCH = 2
} kvmm_priority;

/* A session's shape. Zero-initialize, then set the fields; a zero block_tokens means the
 * default (32). */
typedef struct kvmm_geometry {
    uint32_t layers;        /* transformer layers, 1..=512 */
    uint32_t kv_heads;      /* KV heads per layer, 1..=256 */
    uint32_t q_heads;       /* query heads per layer, a multiple of kv_heads up to 1024 */
    uint32_t head_dim;      /* elements per head, a multiple of 16 in 16..=256 */
    uint32_t max_tokens;    /* the longest context the session may reach, up to 1 << 20 */
    uint32_t block_tokens;  /* tokens per page, a power of two in 8..=256; 0: 32 */
    uint32_t element;       /* kvmm_element */
} kvmm_geometry;

/* Options of kvmm_attach. A zero-initialized struct (or NULL) gives the defaults. */
typedef struct kvmm_attach_options {
    const char *model_id;   /* UTF-8 text shown in kvmmctl and used to find orphans; NULL: none */
    uint32_t priority;      /* kvmm_priority */
    uint32_t extend_batch;  /* pages per layer requested at a time; 0: 4 */
    uint32_t quota_tokens;  /* the most tokens per layer kept in kvmm; 0: no quota */
    uint32_t evict;         /* nonzero: past the quota, drop the least attended pages (lossy) */
    uint64_t linger_ms;     /* how long the session outlives this process, waiting for a
                               kvmm_resume; 0: it ends with the connection */
} kvmm_attach_options;

/* What kvmmd reports about a session (kvmm_stats). */
typedef struct kvmm_session_stats {
    uint64_t tokens;            /* tokens published (the minimum over layers) */
    uint32_t allocated_blocks;  /* pages allocated per layer */
    uint32_t quota_tokens;      /* the quota in force (0: none) */
    uint64_t device_bytes;      /* bytes in each tier */
    uint64_t dram_bytes;
    uint64_t flash_bytes;
    uint32_t device_pages;      /* pages in each tier */
    uint32_t dram_pages;
    uint32_t flash_pages;
    uint32_t reserved;
    uint64_t faults;            /* pages faulted back */
    uint64_t pages_moved;       /* pages kvmmd moved between frames */
    uint64_t dropped_pages;     /* pages eviction dropped */
} kvmm_session_stats;

/* A session of this user that waits to be resumed (kvmm_orphans). */
typedef struct kvmm_orphan {
    uint64_t session_id;
    uint64_t tokens;            /* tokens its process published */
    uint64_t expires_in_ms;     /* until kvmmd wipes it, unless it is resumed */
    uint64_t bytes;             /* bytes its pages hold in every tier */
    kvmm_geometry geometry;
    uint32_t reserved;
} kvmm_orphan;

typedef struct kvmm_client kvmm_client;
typedef struct kvmm_session kvmm_session;

/* The API version of the library (KVMM_API_VERSION of the header it was built with). */
uint32_t kvmm_api_version(void);

/* The upper-case name of a status ("INVALID_ARGUMENT"); "UNKNOWN" for a number that is none. */
const char *kvmm_status_name(int status);

/* The sentence of the last call on this thread that failed; "" when none has. Valid until the
 * next failing call on this thread. */
const char *kvmm_last_error(void);

/* Connects to kvmmd's session socket (the fd socket is expected beside it). NULL: the default,
 * $KVMM_SOCKET, else /run/kvmm/kvmm.sock if it exists, else $XDG_RUNTIME_DIR/kvmm/kvmm.sock. */
int kvmm_connect(const char *socket_path, kvmm_client **client);

/* Closes the client's handle (NULL: nothing). Sessions attached through it stay usable. */
void kvmm_client_free(kvmm_client *client);

/* Attaches a new session; options may be NULL. */
int kvmm_attach(kvmm_client *client, const kvmm_geometry *geometry, const kvmm_attach_options *options,
                kvmm_session **session);

/* Takes over a session of this user whose process left it lingering. With a non-NULL shape, a
 * session of another model shape (layers, kv_heads, q_heads, head_dim) is refused with
 * KVMM_FAILED_PRECONDITION and left as it was; the shape's other fields are not compared. */
int kvmm_resume(kvmm_client *client, uint64_t session_id, const kvmm_geometry *shape, kvmm_session **session);

/* Lists the sessions of this user that wait to be resumed, newest first, only those attached with
 * model_id unless it is NULL. Writes at most capacity of them to orphans (which may be NULL when
 * capacity is 0) and their total to *count. */
int kvmm_orphans(kvmm_client *client, const char *model_id, kvmm_orphan *orphans, size_t capacity, size_t *count);

/* Ends a lingering session without resuming it; *wiped_bytes (may be NULL) gets the bytes wiped. */
int kvmm_discard(kvmm_client *client, uint64_t session_id, uint64_t *wiped_bytes);

/* The session's id (0 for NULL). */
uint64_t kvmm_session_id(const kvmm_session *session);

/* Tokens appended to a layer (0 for NULL or a layer out of range). */
uint32_t kvmm_session_tokens(const kvmm_session *session, uint32_t layer);

/* The session's geometry (for a resumed session, the one it was attached with). */
int kvmm_session_geometry(const kvmm_session *session, kvmm_geometry *geometry);

/* Appends `tokens` tokens' K and V rows to a layer: k and v each hold tokens * kv_heads *
 * head_dim floats, token-major (k[(t * kv_heads + h) * head_dim + d]), stored as the session's
 * element type. On KVMM_RESOURCE_EXHAUSTED the tokens that fit stay appended
 * (kvmm_session_tokens says how many). */
int kvmm_append(kvmm_session *session, uint32_t layer, const float *k, const float *v, size_t tokens);

/* kvmm_append for an engine that keeps K/V in 16 bits: k and v hold tokens * kv_heads * head_dim
 * 16-bit values of type `element` (a kvmm_element: the bits of IEEE half floats, or of bfloat16),
 * token-major as for kvmm_append. Rows of the session's own element type are copied bit for bit;
 * rows of the other type are rounded once to nearest even (bfloat16 past half's range becomes
 * infinity). */
int kvmm_append16(kvmm_session *session, uint32_t layer, uint32_t element, const uint16_t *k, const uint16_t *v,
                  size_t tokens);

/* Takes tokens back: every layer keeps its first `tokens` tokens (a layer holding fewer keeps what it
 * holds) and the next append continues from there (rejected draft tokens, an answer to
 * regenerate). The pages past them go back to kvmmd; the page the kept tokens end inside is read
 * out and written again into a new page (16-bit pages bit for bit, a compressed page as its decoded
 * values). On KVMM_RESOURCE_EXHAUSTED a layer keeps the tokens before that page
 * (kvmm_session_tokens says how many). */
int kvmm_truncate(kvmm_session *session, uint32_t tokens);

/* Decode attention for one query token over every page of a layer (or the page budget's choice):
 * q and out hold q_heads * head_dim floats. */
int kvmm_attention(kvmm_session *session, uint32_t layer, const float *q, float *out);

/* The attention mass of each page the last kvmm_attention read (in block order; it sums to 1, and
 * pages the page budget left out have 0): writes at most capacity values to mass (which may be NULL
 * when capacity is 0) and the page count to *count. Before any attention the count is 0. */
int kvmm_last_mass(const kvmm_session *session, float *mass, size_t capacity, size_t *count);

/* The blocks of a layer that eviction dropped (kvmm_attach_options.evict), ascending: writes at most
 * capacity of them to blocks (which may be NULL when capacity is 0) and their total to *count. */
int kvmm_dropped_blocks(const kvmm_session *session, uint32_t layer, uint32_t *blocks, size_t capacity,
                        size_t *count);

/* Sets the softmax scale (default 1 / sqrt(head_dim)); it must be finite and positive. */
int kvmm_set_scale(kvmm_session *session, float scale);

/* Limits each kvmm_attention to `pages` pages (at least 3: the first, the two most recent and
 * those whose keys can matter most); 0 reads every page. */
int kvmm_set_page_budget(kvmm_session *session, size_t pages);

/* Hints that layers [first_layer, end_layer) x blocks [first_block, end_block) will be read
 * soon; kvmmd promotes what it holds below the device in the background. *resident and
 * *scheduled (either may be NULL) get the pages already resident and the promotions started. */
int kvmm_prefetch(kvmm_session *session, uint32_t first_layer, uint32_t end_layer, uint32_t first_block,
                  uint32_t end_block, uint32_t *resident, uint32_t *scheduled);

/* kvmmd's statistics of the session. */
int kvmm_stats(const kvmm_session *session, kvmm_session_stats *stats);

/* Wipes the session now: kvmmd zeroes every frame, punches its flash slots out and destroys its key.
 * wiped_bytes (may be NULL) gets the bytes wiped in the device, DRAM and flash tiers. Later calls on
 * the session fail with KVMM_FAILED_PRECONDITION; free it with kvmm_session_free. */
int kvmm_wipe(kvmm_session *session, uint64_t wiped_bytes[3]);

/* Ends the session and frees its handle, whatever the outcome; kvmmd wipes its pages.
 * *wiped_bytes (may be NULL) gets the bytes wiped. */
int kvmm_detach(kvmm_session *session, uint64_t *wiped_bytes);

/* Frees a session's handle (NULL: nothing), which ends the session as kvmm_detach does. */
void kvmm_session_free(kvmm_session *session);

#ifdef __cplusplus
}
#endif

#endif /* KVMM_H */

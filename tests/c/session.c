/*
 * A C client of kvmmd through libkvmm (capi/include/kvmm.h), driven by tests/tests/c_client.rs.
 *
 *   session SOCKET   attach, append, attention checked against a double-precision reference,
 *                    every kind of bad input, stats, tokens taken back, two threads on one client; prints
 *                    "ready ID", waits for a line on stdin, detaches
 *   leave SOCKET     attach a lingering session, append, print "left ID CHECKSUM" of an attention
 *                    output, exit without detaching
 *   resume SOCKET    find that session with kvmm_orphans, refuse it under another shape, resume it,
 *                    print "resumed ID CHECKSUM" of the same attention, detach
 *   layout -         print the size of each struct of the header and the offset of each field
 *
 * Every failure of an expected call prints "FAIL ..." and exits 1; every expected refusal prints
 * "refused FUNCTION STATUS_NAME: SENTENCE" for the test to check.
 */
#include <kvmm.h>

#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LAYERS = 2, KV_HEADS = 3, Q_HEADS = 9, HEAD_DIM = 64, MAX_TOKENS = 512 };
enum { ROW = KV_HEADS * HEAD_DIM, QROW = Q_HEADS * HEAD_DIM };

static void fail(const char *what, int status) {
    printf("FAIL %s: %s: %s\n", what, kvmm_status_name(status), kvmm_last_error());
    exit(1);
}

#define CHECK(call)                  \
    do {                             \
        int status_ = (call);        \
        if (status_ != KVMM_OK) {    \
            fail(#call, status_);    \
        }                            \
    } while (0)

/* A call that must be refused with `want`. */
static void refused(const char *function, int status, int want) {
    if (status != want) {
        printf("FAIL %s returned %s, not %s: %s\n", function, kvmm_status_name(status), kvmm_status_name(want),
               kvmm_last_error());
        exit(1);
    }
    printf("refused %s %s: %s\n", function, kvmm_status_name(status), kvmm_last_error());
}

static kvmm_geometry geometry(void) {
    kvmm_geometry g;
    memset(&g, 0, sizeof g);
    g.layers = LAYERS;
    g.kv_heads = KV_HEADS;
    g.q_heads = Q_HEADS;
    g.head_dim = HEAD_DIM;
    g.max_tokens = MAX_TOKENS;
    g.element = KVMM_ELEMENT_F16;
    return g;
}

/* A deterministic generator (xorshift64*). */
static uint64_t next(uint64_t *state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return *state * 2685821657736338717ull;
}

/* Values in [-2, 2] that f16 holds exactly (multiples of 1/64), so the reference sees what the
 * pages hold. */
static float exact(uint64_t *state) {
    return (float)((int)(next(state) % 257) - 128) / 64.0f;
}

/* K/V of `tokens` tokens of one layer. */
typedef struct {
    float k[MAX_TOKENS * ROW];
    float v[MAX_TOKENS * ROW];
    size_t tokens;
} layer_kv;

static void fill(layer_kv *kv, size_t tokens, uint64_t seed) {
    uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < tokens * ROW; i++) {
        kv->k[i] = exact(&state);
        kv->v[i] = exact(&state);
    }
    kv->tokens = tokens;
}

static void query(float *q, uint64_t seed) {
    uint64_t state = seed * 0x2545f4914f6cdd1dull + 7;
    for (size_t i = 0; i < QROW; i++) {
        q[i] = exact(&state) / 2.0f;
    }
}

/* Decode attention in double precision; returns the worst error of `got` relative to each head's
 * largest output. */
static double check_attention(const layer_kv *kv, const float *q, const float *got) {
    double worst = 0.0;
    const double scale = 1.0 / sqrt((double)HEAD_DIM);
    double scores[MAX_TOKENS]; /* per call: the two threads check at once */
    for (size_t h = 0; h < Q_HEADS; h++) {
        size_t kvh = h / (Q_HEADS / KV_HEADS);
        double top = -INFINITY;
        for (size_t t = 0; t < kv->tokens; t++) {
            double s = 0.0;
            for (size_t d = 0; d < HEAD_DIM; d++) {
                s += (double)q[h * HEAD_DIM + d] * kv->k[(t * KV_HEADS + kvh) * HEAD_DIM + d];
            }
            scores[t] = s * scale;
            top = scores[t] > top ? scores[t] : top;
        }
        double sum = 0.0;
        for (size_t t = 0; t < kv->tokens; t++) {
            scores[t] = exp(scores[t] - top);
            sum += scores[t];
        }
        double want[HEAD_DIM], largest = 0.0;
        for (size_t d = 0; d < HEAD_DIM; d++) {
            double o = 0.0;
            for (size_t t = 0; t < kv->tokens; t++) {
                o += scores[t] * kv->v[(t * KV_HEADS + kvh) * HEAD_DIM + d];
            }
            want[d] = o / sum;
            largest = fabs(want[d]) > largest ? fabs(want[d]) : largest;
        }
        for (size_t d = 0; d < HEAD_DIM; d++) {
            double err = fabs(got[h * HEAD_DIM + d] - want[d]) / (largest > 1e-30 ? largest : 1.0);
            worst = err > worst ? err : worst;
        }
    }
    return worst;
}

/* FNV-1a over the bits of an output. */
static uint64_t checksum(const float *out) {
    uint64_t h = 1469598103934665603ull;
    const unsigned char *bytes = (const unsigned char *)out;
    for (size_t i = 0; i < QROW * sizeof(float); i++) {
        h = (h ^ bytes[i]) * 1099511628211ull;
    }
    return h;
}

static layer_kv kvs[LAYERS];

/* Appends `kv` to a layer in three calls of different lengths. */
static void append_all(kvmm_session *s, uint32_t layer, const layer_kv *kv) {
    size_t first = kv->tokens > 32 ? 31 : 1, done = 0;
    size_t parts[3] = {1, first - 1, kv->tokens - first};
    for (int i = 0; i < 3; i++) {
        if (parts[i] == 0) {
            continue;
        }
        CHECK(kvmm_append(s, layer, kv->k + done * ROW, kv->v + done * ROW, parts[i]));
        done += parts[i];
    }
}

typedef struct {
    kvmm_client *client;
    int index;
    double worst;
    int status;
} worker;

/* One of two threads sharing a client: its own session, appended, attended, checked, detached. */
static void *work(void *arg) {
    worker *w = arg;
    static layer_kv thread_kvs[2];
    layer_kv *kv = &thread_kvs[w->index];
    fill(kv, 40 + 9 * (size_t)w->index, 100 + (uint64_t)w->index);
    kvmm_geometry g = geometry();
    kvmm_session *s = NULL;
    float q[QROW], out[QROW];
    if ((w->status = kvmm_attach(w->client, &g, NULL, &s)) != KVMM_OK) {
        return NULL;
    }
    for (uint32_t layer = 0; layer < LAYERS; layer++) {
        if ((w->status = kvmm_append(s, layer, kv->k, kv->v, kv->tokens)) != KVMM_OK) {
            return NULL;
        }
    }
    query(q, 200 + (uint64_t)w->index);
    if ((w->status = kvmm_attention(s, 1, q, out)) != KVMM_OK) {
        return NULL;
    }
    w->worst = check_attention(kv, q, out);
    w->status = kvmm_detach(s, NULL);
    return NULL;
}

static layer_kv kept;

/* A session over a quota with eviction: attention over exactly the pages kvmmd kept. */
static int evicting(kvmm_client *client) {
    enum { TOKENS = 400, QUOTA = 224 };
    kvmm_geometry g = geometry();
    kvmm_attach_options options;
    memset(&options, 0, sizeof options);
    options.model_id = "c-evict";
    options.quota_tokens = QUOTA;
    options.evict = 1;
    kvmm_session *s = NULL;
    CHECK(kvmm_attach(client, &g, &options, &s));
    static layer_kv all;
    fill(&all, TOKENS, 77);
    /* Every layer in step, as a model appends: kvmmd extends all layers together, so one layer
     * appended far ahead of the others finds no page it may drop. */
    for (size_t t = 0; t < TOKENS; t += 40) {
        for (uint32_t layer = 0; layer < LAYERS; layer++) {
            CHECK(kvmm_append(s, layer, all.k + t * ROW, all.v + t * ROW, 40));
        }
    }
    uint32_t dropped[16];
    size_t count = 0;
    CHECK(kvmm_dropped_blocks(s, 1, dropped, 16, &count));
    /* The reference over the tokens of the blocks kept. */
    kept.tokens = 0;
    for (size_t t = 0; t < TOKENS; t++) {
        int gone = 0;
        for (size_t i = 0; i < count && i < 16; i++) {
            gone |= dropped[i] == t / 32;
        }
        if (!gone) {
            memcpy(kept.k + kept.tokens * ROW, all.k + t * ROW, ROW * sizeof(float));
            memcpy(kept.v + kept.tokens * ROW, all.v + t * ROW, ROW * sizeof(float));
            kept.tokens++;
        }
    }
    float q[QROW], out[QROW];
    query(q, 9);
    CHECK(kvmm_attention(s, 1, q, out));
    printf("evicted dropped %zu first %u kept %zu worst %.3g\n", count, count ? dropped[0] : 0, kept.tokens,
           check_attention(&kept, q, out));
    CHECK(kvmm_detach(s, NULL));
    return 0;
}

/* A session this process wipes: its bytes gone from every tier, and every later call refused. */
static int wiping(kvmm_client *client) {
    kvmm_geometry g = geometry();
    kvmm_session *s = NULL;
    CHECK(kvmm_attach(client, &g, NULL, &s));
    static layer_kv few;
    fill(&few, 10, 5);
    CHECK(kvmm_append(s, 0, few.k, few.v, 10));
    uint64_t wiped[3] = {0, 0, 0};
    CHECK(kvmm_wipe(s, wiped));
    printf("wiped device %llu dram %llu flash %llu\n", (unsigned long long)wiped[0], (unsigned long long)wiped[1],
           (unsigned long long)wiped[2]);
    refused("kvmm_append", kvmm_append(s, 0, few.k, few.v, 1), KVMM_FAILED_PRECONDITION);
    kvmm_session_free(s);
    return 0;
}

/* A session that takes tokens back: 100 tokens, then 20 drafts it truncates away, then 10 more;
 * attention reads exactly the 110 kept. */
static int truncating(kvmm_client *client) {
    kvmm_geometry g = geometry();
    kvmm_session *s = NULL;
    CHECK(kvmm_attach(client, &g, NULL, &s));
    static layer_kv kept_kv, drafts;
    fill(&kept_kv, 110, 21);
    fill(&drafts, 20, 22);
    for (uint32_t layer = 0; layer < LAYERS; layer++) {
        CHECK(kvmm_append(s, layer, kept_kv.k, kept_kv.v, 100));
        CHECK(kvmm_append(s, layer, drafts.k, drafts.v, 20));
    }
    CHECK(kvmm_truncate(s, 100));
    float q[QROW], out[QROW];
    double worst = 0.0;
    for (uint32_t layer = 0; layer < LAYERS; layer++) {
        if (kvmm_session_tokens(s, layer) != 100) {
            printf("FAIL layer %u holds %u tokens after truncating to 100\n", layer, kvmm_session_tokens(s, layer));
            return 1;
        }
        CHECK(kvmm_append(s, layer, kept_kv.k + 100 * ROW, kept_kv.v + 100 * ROW, 10));
        query(q, layer + 30);
        CHECK(kvmm_attention(s, layer, q, out));
        double err = check_attention(&kept_kv, q, out);
        worst = err > worst ? err : worst;
    }
    printf("truncated tokens %u worst %.3g\n", kvmm_session_tokens(s, 1), worst);
    refused("kvmm_truncate", kvmm_truncate(NULL, 1), KVMM_INVALID_ARGUMENT);
    CHECK(kvmm_detach(s, NULL));
    return 0;
}

/* The bits of an f16 that holds x exactly (x is 0 or a normal f16 value, as exact() makes). */
static uint16_t f16_bits(float x) {
    if (x == 0.0f) {
        return signbit(x) ? 0x8000 : 0;
    }
    int e;
    double m = frexp(fabs((double)x), &e); /* |x| = m * 2^e, m in [0.5, 1) */
    uint16_t exponent = (uint16_t)(e - 1 + 15), fraction = (uint16_t)((m * 2.0 - 1.0) * 1024.0);
    return (uint16_t)((x < 0 ? 0x8000 : 0) | exponent << 10 | fraction);
}

/* The bits of a bfloat16 that holds x exactly: the top half of its float. */
static uint16_t bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)(bits >> 16);
}

static uint16_t k16[2][100 * ROW], v16[2][100 * ROW];

/* The attention output over layer 0 of a session of `element` appended with `kv` as floats
 * (how < 0) or as 16-bit values of element type `how`. */
static void attend16(kvmm_client *client, uint32_t element, int how, const layer_kv *kv, const float *q, float *out) {
    kvmm_geometry g = geometry();
    g.element = element;
    kvmm_session *s = NULL;
    CHECK(kvmm_attach(client, &g, NULL, &s));
    if (how < 0) {
        CHECK(kvmm_append(s, 0, kv->k, kv->v, kv->tokens));
    } else {
        /* In two calls, so the second starts inside a page. */
        CHECK(kvmm_append16(s, 0, (uint32_t)how, k16[how], v16[how], 45));
        CHECK(kvmm_append16(s, 0, (uint32_t)how, k16[how] + 45 * ROW, v16[how] + 45 * ROW, kv->tokens - 45));
    }
    CHECK(kvmm_attention(s, 0, q, out));
    CHECK(kvmm_detach(s, NULL));
}

/* Rows appended as f16 or bf16 bits give the pages f32 rows of the same values give: the same
 * attention output, bit for bit, in sessions of either element type. */
static int sixteen_bit(kvmm_client *client) {
    static layer_kv kv;
    fill(&kv, 100, 16);
    for (size_t i = 0; i < kv.tokens * ROW; i++) {
        k16[KVMM_ELEMENT_F16][i] = f16_bits(kv.k[i]);
        v16[KVMM_ELEMENT_F16][i] = f16_bits(kv.v[i]);
        k16[KVMM_ELEMENT_BF16][i] = bf16_bits(kv.k[i]);
        v16[KVMM_ELEMENT_BF16][i] = bf16_bits(kv.v[i]);
    }
    float q[QROW];
    query(q, 77);
    int same = 0;
    double worst = 0.0;
    for (uint32_t element = KVMM_ELEMENT_F16; element <= KVMM_ELEMENT_BF16; element++) {
        float want[QROW], got[QROW];
        attend16(client, element, -1, &kv, q, want);
        double err = check_attention(&kv, q, want);
        worst = err > worst ? err : worst;
        for (int how = KVMM_ELEMENT_F16; how <= KVMM_ELEMENT_BF16; how++) {
            attend16(client, element, how, &kv, q, got);
            same += memcmp(want, got, sizeof want) == 0;
        }
    }
    printf("append16 same outputs %d of 4, worst %.3g\n", same, worst);

    kvmm_geometry g = geometry();
    kvmm_session *s = NULL;
    CHECK(kvmm_attach(client, &g, NULL, &s));
    refused("kvmm_append16", kvmm_append16(s, 0, 7, k16[0], v16[0], 1), KVMM_INVALID_ARGUMENT);
    refused("kvmm_append16", kvmm_append16(s, 0, KVMM_ELEMENT_F16, NULL, v16[0], 1), KVMM_INVALID_ARGUMENT);
    CHECK(kvmm_detach(s, NULL));
    return 0;
}

static int session_mode(const char *socket) {
    /* The socket comes through $KVMM_SOCKET, for kvmm_connect(NULL). */
    (void)socket;
    if (kvmm_api_version() != KVMM_API_VERSION) {
        printf("FAIL the library's API version is %u, the header's %d\n", kvmm_api_version(), KVMM_API_VERSION);
        return 1;
    }
    kvmm_client *client = NULL;
    refused("kvmm_connect", kvmm_connect("/nonexistent/kvmm.sock", &client), KVMM_UNAVAILABLE);
    /* NULL: $KVMM_SOCKET, which the test sets to the daemon's socket. */
    CHECK(kvmm_connect(NULL, &client));

    kvmm_geometry bad = geometry();
    kvmm_session *s = NULL;
    bad.head_dim = 20;
    refused("kvmm_attach", kvmm_attach(client, &bad, NULL, &s), KVMM_INVALID_ARGUMENT);
    bad = geometry();
    bad.element = 7;
    refused("kvmm_attach", kvmm_attach(client, &bad, NULL, &s), KVMM_INVALID_ARGUMENT);

    kvmm_geometry g = geometry();
    kvmm_attach_options options;
    memset(&options, 0, sizeof options);
    options.model_id = "c-client";
    options.priority = KVMM_PRIORITY_BACKGROUND;
    CHECK(kvmm_attach(client, &g, &options, &s));
    uint64_t id = kvmm_session_id(s);

    float q[QROW], out[QROW];
    double worst = 0.0;
    for (uint32_t layer = 0; layer < LAYERS; layer++) {
        fill(&kvs[layer], 100, layer);
        append_all(s, layer, &kvs[layer]);
        if (kvmm_session_tokens(s, layer) != 100) {
            printf("FAIL layer %u holds %u tokens, not 100\n", layer, kvmm_session_tokens(s, layer));
            return 1;
        }
        query(q, layer);
        CHECK(kvmm_attention(s, layer, q, out));
        double err = check_attention(&kvs[layer], q, out);
        worst = err > worst ? err : worst;
    }
    printf("attention worst %.3g\n", worst);

    /* The last call read layer 1's 4 pages; their mass sums to 1. */
    float mass[8];
    size_t pages = 0;
    CHECK(kvmm_last_mass(s, mass, 8, &pages));
    double total = 0.0;
    for (size_t p = 0; p < pages && p < 8; p++) {
        total += mass[p];
    }
    printf("mass pages %zu sum %.6f\n", pages, total);

    refused("kvmm_append", kvmm_append(s, LAYERS, kvs[0].k, kvs[0].v, 1), KVMM_INVALID_ARGUMENT);
    refused("kvmm_append", kvmm_append(s, 0, kvs[0].k, NULL, 1), KVMM_INVALID_ARGUMENT);
    refused("kvmm_append", kvmm_append(s, 0, kvs[0].k, kvs[0].v, 0), KVMM_INVALID_ARGUMENT);
    static float many_k[(MAX_TOKENS + 1) * ROW], many_v[(MAX_TOKENS + 1) * ROW];
    refused("kvmm_append", kvmm_append(s, 0, many_k, many_v, MAX_TOKENS), KVMM_INVALID_ARGUMENT);
    refused("kvmm_attention", kvmm_attention(s, 0, NULL, out), KVMM_INVALID_ARGUMENT);
    refused("kvmm_set_page_budget", kvmm_set_page_budget(s, 2), KVMM_INVALID_ARGUMENT);
    refused("kvmm_set_scale", kvmm_set_scale(s, NAN), KVMM_INVALID_ARGUMENT);
    refused("kvmm_prefetch", kvmm_prefetch(s, 1, 1, 0, 4, NULL, NULL), KVMM_INVALID_ARGUMENT);
    kvmm_session *other = NULL;
    refused("kvmm_resume", kvmm_resume(client, 999999, NULL, &other), KVMM_NOT_FOUND);
    size_t count = 0;
    refused("kvmm_orphans", kvmm_orphans(client, NULL, NULL, 1, &count), KVMM_INVALID_ARGUMENT);
    refused("kvmm_last_mass", kvmm_last_mass(s, NULL, 4, &count), KVMM_INVALID_ARGUMENT);
    kvmm_attach_options evict_only;
    memset(&evict_only, 0, sizeof evict_only);
    evict_only.evict = 1;
    refused("kvmm_attach", kvmm_attach(client, &g, &evict_only, &other), KVMM_INVALID_ARGUMENT);

    /* A page budget covering the layer is exact; one of 3 of its 4 pages still answers. */
    CHECK(kvmm_set_page_budget(s, 4));
    query(q, 1);
    CHECK(kvmm_attention(s, 1, q, out));
    double budgeted = check_attention(&kvs[1], q, out);
    CHECK(kvmm_set_page_budget(s, 3));
    CHECK(kvmm_attention(s, 1, q, out));
    CHECK(kvmm_set_page_budget(s, 0));
    printf("budget of every page worst %.3g\n", budgeted);

    uint32_t resident = 0, scheduled = 0;
    CHECK(kvmm_prefetch(s, 0, LAYERS, 0, 4, &resident, &scheduled));
    kvmm_session_stats stats;
    CHECK(kvmm_stats(s, &stats));
    printf("stats tokens %llu device_pages %u device_bytes %llu resident %u\n", (unsigned long long)stats.tokens,
           stats.device_pages, (unsigned long long)stats.device_bytes, resident);

    if (evicting(client) != 0 || wiping(client) != 0 || sixteen_bit(client) != 0 || truncating(client) != 0) {
        return 1;
    }

    worker workers[2] = {{client, 0, 0.0, -1}, {client, 1, 0.0, -1}};
    pthread_t threads[2];
    for (int i = 0; i < 2; i++) {
        if (pthread_create(&threads[i], NULL, work, &workers[i]) != 0) {
            printf("FAIL pthread_create\n");
            return 1;
        }
    }
    for (int i = 0; i < 2; i++) {
        pthread_join(threads[i], NULL);
        if (workers[i].status != KVMM_OK) {
            printf("FAIL thread %d: %s\n", i, kvmm_status_name(workers[i].status));
            return 1;
        }
        printf("thread %d worst %.3g\n", i, workers[i].worst);
    }

    printf("ready %llu\n", (unsigned long long)id);
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) {
        printf("FAIL no line on stdin\n");
        return 1;
    }
    uint64_t wiped = 0;
    CHECK(kvmm_detach(s, &wiped));
    printf("detached %llu\n", (unsigned long long)wiped);
    kvmm_client_free(client);
    return 0;
}

static int leave_mode(const char *socket) {
    kvmm_client *client = NULL;
    kvmm_session *s = NULL;
    CHECK(kvmm_connect(socket, &client));
    kvmm_geometry g = geometry();
    kvmm_attach_options options;
    memset(&options, 0, sizeof options);
    options.model_id = "c-linger";
    options.linger_ms = 30000;
    CHECK(kvmm_attach(client, &g, &options, &s));
    for (uint32_t layer = 0; layer < LAYERS; layer++) {
        fill(&kvs[layer], 70, 10 + layer);
        append_all(s, layer, &kvs[layer]);
    }
    /* A second one, which the next process discards rather than resumes. */
    kvmm_session *spare = NULL;
    options.model_id = "c-discard";
    CHECK(kvmm_attach(client, &g, &options, &spare));
    CHECK(kvmm_append(spare, 0, kvs[0].k, kvs[0].v, 3));
    float q[QROW], out[QROW];
    query(q, 5);
    CHECK(kvmm_attention(s, 1, q, out));
    printf("left %llu %016llx worst %.3g\n", (unsigned long long)kvmm_session_id(s),
           (unsigned long long)checksum(out), check_attention(&kvs[1], q, out));
    fflush(stdout);
    /* Exit as a crash would: the session outlives the process, lingering. */
    _Exit(0);
}

static int resume_mode(const char *socket) {
    kvmm_client *client = NULL;
    CHECK(kvmm_connect(socket, &client));
    kvmm_orphan orphans[4];
    size_t count = 0;
    /* Both sessions the last process left; the one of model c-discard goes without a resume. */
    CHECK(kvmm_orphans(client, NULL, orphans, 1, &count));
    if (count != 2) {
        printf("FAIL %zu orphans, not 2\n", count);
        return 1;
    }
    CHECK(kvmm_orphans(client, "c-discard", orphans, 4, &count));
    uint64_t wiped = 0;
    CHECK(kvmm_discard(client, orphans[0].session_id, &wiped));
    printf("discarded %llu bytes %llu\n", (unsigned long long)orphans[0].session_id, (unsigned long long)wiped);
    CHECK(kvmm_orphans(client, "c-linger", orphans, 4, &count));
    if (count != 1 || orphans[0].tokens != 70 || orphans[0].geometry.head_dim != HEAD_DIM) {
        printf("FAIL %zu orphans of c-linger, the first with %llu tokens\n", count,
               count ? (unsigned long long)orphans[0].tokens : 0ull);
        return 1;
    }
    uint64_t id = orphans[0].session_id;
    kvmm_geometry other = geometry();
    other.head_dim = 128;
    kvmm_session *s = NULL;
    refused("kvmm_resume", kvmm_resume(client, id, &other, &s), KVMM_FAILED_PRECONDITION);
    kvmm_geometry g = geometry();
    CHECK(kvmm_resume(client, id, &g, &s));
    kvmm_geometry resumed;
    CHECK(kvmm_session_geometry(s, &resumed));
    kvmm_geometry expected = g;
    expected.block_tokens = 32; /* the default that 0 asked for */
    if (memcmp(&resumed, &expected, sizeof expected) != 0) {
        printf("FAIL the resumed session's geometry differs from the one it was attached with\n");
        return 1;
    }
    if (kvmm_session_tokens(s, 0) != 70 || kvmm_session_tokens(s, 1) != 70) {
        printf("FAIL the resumed session holds %u and %u tokens\n", kvmm_session_tokens(s, 0), kvmm_session_tokens(s, 1));
        return 1;
    }
    float q[QROW], out[QROW];
    query(q, 5);
    CHECK(kvmm_attention(s, 1, q, out));
    printf("resumed %llu %016llx\n", (unsigned long long)id, (unsigned long long)checksum(out));
    CHECK(kvmm_detach(s, NULL));
    kvmm_client_free(client);
    return 0;
}

#define FIELD(type, field) printf(#type " " #field " %zu\n", offsetof(type, field))
#define SIZE(type) printf(#type " size %zu\n", sizeof(type))

static int layout_mode(void) {
    SIZE(kvmm_geometry);
    FIELD(kvmm_geometry, layers);
    FIELD(kvmm_geometry, kv_heads);
    FIELD(kvmm_geometry, q_heads);
    FIELD(kvmm_geometry, head_dim);
    FIELD(kvmm_geometry, max_tokens);
    FIELD(kvmm_geometry, block_tokens);
    FIELD(kvmm_geometry, element);
    SIZE(kvmm_attach_options);
    FIELD(kvmm_attach_options, model_id);
    FIELD(kvmm_attach_options, priority);
    FIELD(kvmm_attach_options, extend_batch);
    FIELD(kvmm_attach_options, quota_tokens);
    FIELD(kvmm_attach_options, evict);
    FIELD(kvmm_attach_options, linger_ms);
    SIZE(kvmm_session_stats);
    FIELD(kvmm_session_stats, tokens);
    FIELD(kvmm_session_stats, allocated_blocks);
    FIELD(kvmm_session_stats, quota_tokens);
    FIELD(kvmm_session_stats, device_bytes);
    FIELD(kvmm_session_stats, dram_bytes);
    FIELD(kvmm_session_stats, flash_bytes);
    FIELD(kvmm_session_stats, device_pages);
    FIELD(kvmm_session_stats, dram_pages);
    FIELD(kvmm_session_stats, flash_pages);
    FIELD(kvmm_session_stats, reserved);
    FIELD(kvmm_session_stats, faults);
    FIELD(kvmm_session_stats, pages_moved);
    FIELD(kvmm_session_stats, dropped_pages);
    SIZE(kvmm_orphan);
    FIELD(kvmm_orphan, session_id);
    FIELD(kvmm_orphan, tokens);
    FIELD(kvmm_orphan, expires_in_ms);
    FIELD(kvmm_orphan, bytes);
    FIELD(kvmm_orphan, geometry);
    FIELD(kvmm_orphan, reserved);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s session|leave|resume SOCKET\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (strcmp(argv[1], "session") == 0) {
        return session_mode(argv[2]);
    }
    if (strcmp(argv[1], "layout") == 0) {
        return layout_mode();
    }
    if (strcmp(argv[1], "leave") == 0) {
        return leave_mode(argv[2]);
    }
    if (strcmp(argv[1], "resume") == 0) {
        return resume_mode(argv[2]);
    }
    fprintf(stderr, "unknown mode %s\n", argv[1]);
    return 2;
}

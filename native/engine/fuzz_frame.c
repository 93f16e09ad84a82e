/*
 * libFuzzer target over the wire frame's parser and packer (frame.c), built and run by
 * scripts/fuzz:
 *
 *   clang-14 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
 *       -Inative/engine native/engine/fuzz_frame.c native/engine/frame.c
 *
 * An input is a byte stream as a socket would carry it: 40-byte headers, each followed by the
 * payload its irdm_payload_size() names (at most MAX_FRAMES frames; a refused header or a payload
 * cut short ends the stream, as it ends a connection). Every header is checked against the rules
 * written out again below (reference(), from transport/protocol.py, not from frame.c):
 *
 *   - the same decision and the same irdm_parse code, with a known text;
 *   - *f untouched when refused;
 *   - accepted: the same fields, re-packed to the identical 40 bytes, length <= IRDM_MAX_IO,
 *     irdm_payload_size() <= the frame's limit (1 GiB for data, 16 MiB for the rest);
 *   - any length but 40 refused as truncated (39 and 41 bytes at every header, the rest of the
 *     stream, the whole input);
 *   - fields taken from the input, packed, parse back to themselves or are refused as oversized.
 *
 * Each header is parsed from a heap copy of exactly the bytes given, so AddressSanitizer sees
 * any read past them; UndefinedBehaviorSanitizer aborts on the first undefined operation. A
 * failed check abort()s, which libFuzzer reports as a crash and saves the input.
 * The differential against protocol.py itself, through irdmafs._engine, is
 * tests/transport/test_engine_frame.py.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"

#define MAX_FRAMES 64

static void failed(const char *what, int line) {
    fprintf(stderr, "fuzz_frame.c:%d: check failed: %s\n", line, what);
    abort();
}
#define CHECK(cond) ((cond) ? (void)0 : failed(#cond, __LINE__))

static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* The frame's limit, from protocol.py's unpack: 1 GiB for the data operations that carry bulk
 * data (READ, WRITE, WRITE_IMM, request or response, status OK; a WRITE_IMM response carries a
 * JSON document), 16 MiB for everything else. */
static uint64_t limit_of(uint8_t opcode, uint16_t status) {
    unsigned op = opcode & 0x7fu;
    int response = opcode >= 0x80;
    int data = op == 3 || op == 4 || op == 6;
    if (data && status == 0 && !(response && op == 6)) return UINT64_C(1) << 30;
    return UINT64_C(16) << 20;
}

/* protocol.py's payload_size: a READ request (opcode exactly 3) carries no payload. */
static uint64_t size_of(uint8_t opcode, uint64_t length) { return opcode == 3 ? 0 : length; }

/* protocol.py's unpack, written again: the code frame.c must return, and the fields. */
static int reference(const uint8_t *b, size_t n, struct irdm_frame *f) {
    if (n != 40) return IRDM_PARSE_TRUNCATED;
    if (b[0] != 'I' || b[1] != 'R' || b[2] != 'D' || b[3] != 'M') return IRDM_PARSE_MAGIC;
    if (b[4] != 1) return IRDM_PARSE_VERSION;
    f->opcode = b[5];
    f->status = (uint16_t)le(b + 6, 2);
    f->req_id = le(b + 8, 8);
    f->rkey = (uint32_t)le(b + 16, 4);
    f->imm = (uint32_t)le(b + 20, 4);
    f->offset = le(b + 24, 8);
    f->length = le(b + 32, 8);
    if (size_of(f->opcode, f->length) > limit_of(f->opcode, f->status) || f->length > (UINT64_C(1) << 30))
        return IRDM_PARSE_OVERSIZED;
    return IRDM_PARSE_OK;
}

static int same_fields(const struct irdm_frame *a, const struct irdm_frame *b) {
    return a->opcode == b->opcode && a->status == b->status && a->req_id == b->req_id && a->rkey == b->rkey &&
           a->imm == b->imm && a->offset == b->offset && a->length == b->length;
}

/* Parse n bytes (from an exact heap copy) and check everything; the code, *out when OK. */
static int check_header(const uint8_t *src, size_t n, struct irdm_frame *out) {
    uint8_t *buf = malloc(n ? n : 1);
    CHECK(buf != NULL);
    if (n) memcpy(buf, src, n);

    union {
        struct irdm_frame f;
        unsigned char bytes[sizeof(struct irdm_frame)];
    } got, sentinel;
    memset(sentinel.bytes, 0xA5, sizeof sentinel.bytes);
    memcpy(got.bytes, sentinel.bytes, sizeof got.bytes);
    struct irdm_frame want;

    int rc = irdm_parse(buf, n, &got.f);
    int ref = reference(buf, n, &want);
    CHECK(rc == ref);
    const char *why = irdm_parse_error(rc);
    CHECK(why != NULL && strcmp(why, "unknown parse error") != 0);
    if (rc != IRDM_PARSE_OK) {
        CHECK(memcmp(got.bytes, sentinel.bytes, sizeof got.bytes) == 0); /* *f written only on OK */
        free(buf);
        return rc;
    }
    CHECK(n == IRDM_HEADER);
    CHECK(same_fields(&got.f, &want));
    uint8_t again[IRDM_HEADER];
    irdm_pack(again, &got.f);
    CHECK(memcmp(again, buf, IRDM_HEADER) == 0);
    CHECK(got.f.length <= IRDM_MAX_IO);
    uint64_t size = irdm_payload_size(&got.f);
    CHECK(size == size_of(got.f.opcode, got.f.length));
    CHECK(size <= limit_of(got.f.opcode, got.f.status));
    CHECK(size <= IRDM_MAX_IO);
    free(buf);
    *out = got.f;
    return rc;
}

/* Fields from the input's first 35 bytes: packed, they parse back to themselves or are refused
 * as oversized (the only rule a packed header can break). */
static void check_pack(const uint8_t *d, size_t n) {
    if (n < 35) return;
    struct irdm_frame f = {
        .opcode = d[0],
        .status = (uint16_t)le(d + 1, 2),
        .req_id = le(d + 3, 8),
        .rkey = (uint32_t)le(d + 11, 4),
        .imm = (uint32_t)le(d + 15, 4),
        .offset = le(d + 19, 8),
        .length = le(d + 27, 8),
    };
    uint8_t raw[IRDM_HEADER];
    irdm_pack(raw, &f);
    CHECK(memcmp(raw, "IRDM", 4) == 0 && raw[4] == IRDM_VERSION);
    struct irdm_frame back;
    int rc = check_header(raw, sizeof raw, &back);
    CHECK(rc == IRDM_PARSE_OK || rc == IRDM_PARSE_OVERSIZED);
    if (rc == IRDM_PARSE_OK) CHECK(same_fields(&back, &f));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct irdm_frame f;
    if (size != IRDM_HEADER) CHECK(check_header(data, size, &f) == IRDM_PARSE_TRUNCATED);

    size_t pos = 0;
    for (int i = 0; i < MAX_FRAMES; i++) {
        size_t left = size - pos;
        if (left < IRDM_HEADER) {
            CHECK(check_header(data + pos, left, &f) == IRDM_PARSE_TRUNCATED);
            break;
        }
        CHECK(check_header(data + pos, IRDM_HEADER - 1, &f) == IRDM_PARSE_TRUNCATED);
        if (left > IRDM_HEADER) CHECK(check_header(data + pos, IRDM_HEADER + 1, &f) == IRDM_PARSE_TRUNCATED);
        if (check_header(data + pos, IRDM_HEADER, &f) != IRDM_PARSE_OK) break; /* the connection would close */
        pos += IRDM_HEADER;
        uint64_t payload = irdm_payload_size(&f);
        if (payload > size - pos) break; /* cut short mid-payload */
        pos += (size_t)payload;
    }

    check_pack(data, size);
    for (int code = -2; code < 8; code++) CHECK(irdm_parse_error(code) != NULL);
    return 0;
}

/* The wire frame's parser and packer: frame.h says the layout; protocol.py is the reference. */
#include "frame.h"

#include <string.h>

static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | ((uint64_t)get32(p + 4) << 32); }
static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

uint64_t irdm_payload_size(const struct irdm_frame *f) {
    if (f->opcode == IRDM_READ) return 0; /* a READ request names the bytes it wants; it carries none */
    return f->length;
}

/* What one frame's payload may be at most: bulk data (1 GiB) for the data operations that
 * carry it, a control document (16 MiB) for everything else. */
static uint64_t payload_limit(const struct irdm_frame *f) {
    int op = f->opcode & ~IRDM_RESPONSE;
    int response = (f->opcode & IRDM_RESPONSE) != 0;
    int data = op == IRDM_READ || op == IRDM_WRITE || op == IRDM_WRITE_IMM;
    if (data && f->status == IRDM_OK && !(response && op == IRDM_WRITE_IMM)) return IRDM_MAX_IO;
    return IRDM_MAX_CONTROL;
}

int irdm_parse(const uint8_t *buf, size_t n, struct irdm_frame *out) {
    if (n != IRDM_HEADER) return IRDM_PARSE_TRUNCATED;
    if (memcmp(buf, "IRDM", 4) != 0) return IRDM_PARSE_MAGIC;
    if (buf[4] != IRDM_VERSION) return IRDM_PARSE_VERSION;
    struct irdm_frame f;
    f.opcode = buf[5];
    f.status = get16(buf + 6);
    f.req_id = get64(buf + 8);
    f.rkey = get32(buf + 16);
    f.imm = get32(buf + 20);
    f.offset = get64(buf + 24);
    f.length = get64(buf + 32);
    if (f.length > IRDM_MAX_IO || irdm_payload_size(&f) > payload_limit(&f)) return IRDM_PARSE_OVERSIZED;
    *out = f;
    return IRDM_PARSE_OK;
}

void irdm_pack(uint8_t out[IRDM_HEADER], const struct irdm_frame *f) {
    memcpy(out, "IRDM", 4);
    out[4] = IRDM_VERSION;
    out[5] = f->opcode;
    put16(out + 6, f->status);
    put64(out + 8, f->req_id);
    put32(out + 16, f->rkey);
    put32(out + 20, f->imm);
    put64(out + 24, f->offset);
    put64(out + 32, f->length);
}

const char *irdm_parse_error(int code) {
    switch (code) {
    case IRDM_PARSE_OK: return "ok";
    case IRDM_PARSE_TRUNCATED: return "truncated header";
    case IRDM_PARSE_MAGIC: return "bad magic";
    case IRDM_PARSE_VERSION: return "unsupported protocol version";
    case IRDM_PARSE_OVERSIZED: return "oversized frame";
    default: return "unknown parse error";
    }
}

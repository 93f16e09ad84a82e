/*
 * The wire frame of the socket transports, in C: parse and pack the 40-byte header.
 *
 * The layout and every rule are transport/protocol.py's (the reference; tests check the two
 * agree on every input, tests/transport/test_engine_frame.py, and a fuzzer runs this parser):
 *
 *   0  4 magic "IRDM"   4 1 version (1)   5 1 opcode (0x80 = response)   6 2 status
 *   8  8 req_id        16 4 rkey          20 4 imm                       24 8 offset
 *   32 8 length   (little-endian; a READ request's length is the bytes wanted, every other
 *                  frame's is the payload that follows)
 *
 * Pure: no allocation, no I/O, no global state; safe from any thread.
 */
#ifndef IRDM_FRAME_H
#define IRDM_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define IRDM_HEADER 40
#define IRDM_VERSION 1
#define IRDM_MAX_IO (UINT64_C(1) << 30)      /* one READ/WRITE moves at most 1 GiB */
#define IRDM_MAX_CONTROL (UINT64_C(16) << 20) /* a control document, error message or auth payload */
#define IRDM_CALL_PROBE 1 /* a CALL header's imm: a liveness probe (protocol.CALL_PROBE) */

enum irdm_op {
    IRDM_CHALLENGE = 1,
    IRDM_AUTH = 2,
    IRDM_READ = 3,
    IRDM_WRITE = 4,
    IRDM_CALL = 5,
    IRDM_WRITE_IMM = 6,
    IRDM_RESPONSE = 0x80,
};

enum irdm_status {
    IRDM_OK = 0,
    IRDM_ST_ACCESS = 1,
    IRDM_ST_BAD_REQUEST = 2,
    IRDM_ST_REMOTE = 3,
    IRDM_ST_AUTH = 4,
    IRDM_ST_PROTOCOL = 5,
};

/* why a header was refused (0: it was not) */
enum irdm_parse {
    IRDM_PARSE_OK = 0,
    IRDM_PARSE_TRUNCATED = 1,
    IRDM_PARSE_MAGIC = 2,
    IRDM_PARSE_VERSION = 3,
    IRDM_PARSE_OVERSIZED = 4,
};

struct irdm_frame {
    uint8_t opcode;
    uint16_t status;
    uint64_t req_id;
    uint32_t rkey;
    uint32_t imm;
    uint64_t offset;
    uint64_t length;
};

/* Parse and check n bytes (must be IRDM_HEADER) into *f; an irdm_parse code. *f is written
 * only when the result is IRDM_PARSE_OK. */
int irdm_parse(const uint8_t *buf, size_t n, struct irdm_frame *f);

/* The 40 bytes of f (magic and version filled in). */
void irdm_pack(uint8_t out[IRDM_HEADER], const struct irdm_frame *f);

/* Bytes of payload that follow this header on the wire. */
uint64_t irdm_payload_size(const struct irdm_frame *f);

/* A short text for an irdm_parse code. */
const char *irdm_parse_error(int code);

#endif

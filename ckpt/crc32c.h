/*
 * ckpt/crc32c.h - CRC-32C (Castagnoli, the iSCSI / ext4 / RocksDB checksum) of checkpoint
 * files. The SSE4.2 crc32 instruction is used when the CPU has it (chosen once, at run time),
 * a slice-by-8 table otherwise; both give the same value. Incremental: pass the previous
 * result as crc (0 to start).
 */
#ifndef EMBD_CKPT_CRC32C_H
#define EMBD_CKPT_CRC32C_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* CRC-32C of len bytes continuing from crc (0 for a fresh checksum). */
uint32_t embd_crc32c(uint32_t crc, const void *data, size_t len);

/* The same with the table code, whatever the CPU (tests compare both). */
uint32_t embd_crc32c_table(uint32_t crc, const void *data, size_t len);

/* Whether embd_crc32c uses the SSE4.2 instruction on this CPU. */
bool embd_crc32c_hw(void);

#endif /* EMBD_CKPT_CRC32C_H */

// The int4 and int5 weights' held layouts (model/int4_rows.py, model/int5_rows.py): what linear.cpp multiplies and
// dequantize.cpp unpacks.
#pragma once

#include <cstdint>

namespace {

// int4 rows (weights "int4", model/int4_rows.py): q4_1 groups of 32 laid out as a row: in / 2 bytes of levels (group
// g's 16 bytes: byte j = q[j] | q[j + 16] << 4), then the groups' float16 scales d, then their float16 minimums m; a
// weight is d q + m with q in [0, 15]. Decode products: the activations quantized once a call to int8 in groups of
// 32 (scale sx = absmax / 127, as llama.cpp's q8_1), with each group's sum sx sum(xq); a group's dot product is then
// d sx sum(q xq) + m sx sum(xq). The 32 products u8 x s8 are summed exactly in int32: VNNI's dpbusd where the CPU
// has it, else maddubs (pairs at most 2 x 15 x 127: no saturation) and madd, the same integers either way.
constexpr int64_t Q4_GROUP = 32;
inline int64_t q4_width(int64_t in) { return in / 2 + 4 * (in / Q4_GROUP); }

// int4 tiles: the held form keeps its first 16 floor(out / 16) rows as tiles of 16 rows (model/int4_rows.py), the rest
// as rows. A tile's group g (of ng) takes 320 bytes: four 64-byte chunks (chunk c: bytes 4o..4o+3 hold row o's levels
// q[4c..4c+3] in their low nibbles and q[16+4c..16+4c+3] in their high ones), then the 16 rows' float16 scales d, then
// their minimums m. A 512-bit dpbusd of a chunk's nibbles with four activations broadcast is then one step of 16 rows'
// dot products, lane by lane: no lanes summed across, each group's scale one vector of 16 rows, the levels unpacked
// once for every row of x (in rows, each (row, group) paid a conversion, a permute and a multiply-add).
// int5 tiles (model/int5_rows.py): the same chunks of low nibbles, then 64 bytes of fifth bits (row o's dword at 4o:
// q[4c+j]'s bit at bit c of byte j, q[16+4c+j]'s at bit 4+c), then the scales and minimums: 384 bytes a group. Chunk
// c's fifth bits are that dword shifted by 4 - c (low nibbles) or c (high ones) and masked with 0x10 a byte.
constexpr int64_t Q4_TILE = 16, Q4_TILE_GROUP = 320, Q5_TILE_GROUP = 384;
template <int BITS>
constexpr int64_t tile_group_bytes() { return BITS == 5 ? Q5_TILE_GROUP : Q4_TILE_GROUP; }
template <int BITS>
constexpr int64_t tile_scales_at() { return BITS == 5 ? 320 : 256; }  // a group's scales; its minimums 32 bytes on
inline int64_t q5_width(int64_t in) { return in * 3 / 4; }

// int8 tiles (model/int8_tiles.py): int8 rows (q8_0 groups, kv_width(in) bytes a row) whose first 16 floor(out / 16)
// rows are held in tiles of 16, the rest as rows. A tile's group g (of in / 32) takes 544 bytes: eight 64-byte chunks
// (chunk c: bytes 4o..4o+3 hold row o's values 4c..4c+3, signed, as the row holds them), then the 16 rows' float16
// scales: a row's bytes moved, none changed. A 512-bit dpbusd of a chunk with four activations broadcast is then one
// step of 16 rows' dot products, one row a lane, as int4 tiles'.
constexpr int64_t Q8_TILE_GROUP = 8 * 64 + 32;

// int6 tiles (model/int6_tiles.py): a GGUF's Q6_K rows (210 bytes per 256 values: value d sc (q - 32), q in [0, 63],
// an int8 scale sc per 16 values, a float16 d per 256) in tiles of 16 rows. Per super-block of 256: the 16 rows'
// float16 d (32 bytes), then its 8 groups of 32, Q6_GROUP bytes each: int4 tiles' four chunks of low nibbles, two
// 64-byte vectors of high bits (row o's dword: byte j, bits 2c, 2c + 1: the high bits of q[4c + j], then in the second
// of q[16 + 4c + j]), then the rows' int8 scales of values 0-15 (16 bytes) and of 16-31 (16 bytes).
constexpr int64_t Q6_GROUP = 256 + 128 + 32, Q6_BLOCK = 32 + 8 * Q6_GROUP;  // a tile's group, its super-block
inline int64_t q6_width(int64_t in) { return in / 256 * 210; }

}  // namespace

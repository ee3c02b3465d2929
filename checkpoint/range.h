// The HTTP Range header of shard reads: one byte range of a file, parsed from bytes a peer sent.
// Pure: no I/O. Thread-safety: a plain function.
#pragma once

#include <cstdint>
#include <string_view>

#include <lightkeeper/status.h>

namespace lk::ckpt {

// Parses a single-range "bytes=A-B" / "bytes=A-" / "bytes=-N" against a file of `size` bytes into
// [begin, end), with begin < end <= size. Fails with a reason (the caller answers 416) when it is
// malformed, multi-range, starts outside the file, or holds a number that does not fit 64 bits;
// an end past the file is clipped to it, as RFC 9110 asks.
Status ParseRange(std::string_view header, uint64_t size, uint64_t* begin, uint64_t* end);

}  // namespace lk::ckpt

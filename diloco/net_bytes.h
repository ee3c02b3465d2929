// Bytes this process has sent on its TCP connections, read from the kernel (TCP_INFO's
// tcpi_bytes_sent of every TCP socket among the process's file descriptors). The trainer's only
// TCP connections are its communicators' (its agent is a Unix socket), so the difference across
// a collective is what that collective put on the wire, framing included: a measurement of the
// communicator, not a formula. Loopback never retransmits, so nothing is counted twice here.
// Thread-safety: any thread; it only reads the kernel's counters.
#pragma once

#include <cstdint>
#include <map>

namespace lk::diloco {

// Per socket (by inode, which a reused fd number does not share) the bytes sent so far.
using TcpSent = std::map<uint64_t, uint64_t>;

TcpSent SnapshotTcpSent();

// Bytes sent between two snapshots. A socket opened in between counts from zero; one closed in
// between is not counted (its last bytes are lost to the measurement, a small undercount when a
// communicator is rebuilt or aborted).
uint64_t TcpSentBetween(const TcpSent& before, const TcpSent& after);

}  // namespace lk::diloco

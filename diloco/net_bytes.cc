#include "diloco/net_bytes.h"

#include <dirent.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstddef>
#include <cstdlib>
#include <string>

namespace lk::diloco {

TcpSent SnapshotTcpSent() {
  TcpSent out;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return out;
  const int own = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == own) continue;
    struct stat st{};
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    tcp_info info{};
    socklen_t len = sizeof(info);
    // Unix sockets (the agent's) answer ENOPROTOOPT/EOPNOTSUPP: not counted.
    if (getsockopt(static_cast<int>(fd), IPPROTO_TCP, TCP_INFO, &info, &len) != 0) continue;
    // A kernel older than 4.19 returns a shorter struct without the field.
    if (len < offsetof(tcp_info, tcpi_bytes_sent) + sizeof(info.tcpi_bytes_sent)) continue;
    out[st.st_ino] = info.tcpi_bytes_sent;
  }
  closedir(dir);
  return out;
}

uint64_t TcpSentBetween(const TcpSent& before, const TcpSent& after) {
  uint64_t sum = 0;
  for (const auto& [inode, sent] : after) {
    auto it = before.find(inode);
    uint64_t base = it == before.end() ? 0 : it->second;
    if (sent > base) sum += sent - base;
  }
  return sum;
}

}  // namespace lk::diloco

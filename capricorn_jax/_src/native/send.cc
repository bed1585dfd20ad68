// The deadline sender's window loop without Python: frames of a window's
// byte range handed to the chunk channel's socket, with the stop rule of
// ``ThreadedSender._send_until`` (the same decisions, tested against it):
//
//   * stop as soon as every local device stamped a collective's start edge
//     after the window opened (the mark table the native marks write);
//   * stop before a frame the link could not carry by the window's planned
//     close: now + (bytes ahead on the link + the frame) / rate > close;
//   * hand a frame over only while at most ``queue_bound`` bytes are ahead on
//     the link (a model at the link's rate, capped by SIOCOUTQ).
//
// Each frame is the chunk channel's format (chunk_channel._HEADER: version,
// offset, length per row, rows, CRC32 of the rows' bytes in order; zlib's
// CRC-32), sent with one gathered sendmsg (partial sends go on; the socket
// is non-blocking under Python's timeout, so each wait is a bounded poll).
// Runs with the GIL released (ctypes), one call per window.
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

namespace {

uint32_t g_crc[8][256];

bool crc_init() {
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    g_crc[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int t = 1; t < 8; ++t)
      g_crc[t][i] = (g_crc[t - 1][i] >> 8) ^ g_crc[0][g_crc[t - 1][i] & 0xFF];
  return true;
}

void crc_ready() { static const bool ready = crc_init(); (void)ready; }

// zlib's crc32(crc, data, n): slicing by 8.
uint32_t crc32(uint32_t crc, const uint8_t* p, int64_t n) {
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = g_crc[7][lo & 0xFF] ^ g_crc[6][(lo >> 8) & 0xFF] ^ g_crc[5][(lo >> 16) & 0xFF] ^
        g_crc[4][lo >> 24] ^ g_crc[3][hi & 0xFF] ^ g_crc[2][(hi >> 8) & 0xFF] ^
        g_crc[1][(hi >> 16) & 0xFF] ^ g_crc[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = g_crc[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return ~c;
}

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

#pragma pack(push, 1)
struct Header {
  int64_t version, offset, length, rows;
  uint32_t crc;
};
#pragma pack(pop)
static_assert(sizeof(Header) == 36, "the chunk channel's header is <qqqqI");

// Sends every byte of iov[0..n) (modified), each wait bounded by timeout_ms.
int send_all(int fd, iovec* iov, int n, int timeout_ms) {
  int first = 0;
  while (first < n) {
    msghdr msg{};
    msg.msg_iov = iov + first;
    msg.msg_iovlen = n - first;
    ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
      pollfd p{fd, POLLOUT, 0};
      int ready = poll(&p, 1, timeout_ms);
      if (ready == 0) return -ETIMEDOUT;
      if (ready < 0 && errno != EINTR) return -errno;
      continue;
    }
    while (sent > 0 && first < n) {
      if (static_cast<size_t>(sent) >= iov[first].iov_len) {
        sent -= iov[first].iov_len;
        ++first;
      } else {
        iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + sent;
        iov[first].iov_len -= sent;
        sent = 0;
      }
    }
  }
  return 0;
}

bool collective_started(const int64_t* stamps, const int64_t* slots, int nslots, int columns,
                        int local_devices, int64_t floor_ns) {
  for (int s = 0; s < nslots; ++s) {
    const int64_t* row = stamps + slots[s] * columns;
    int stamped = 0;
    for (int d = 0; d < columns; ++d)
      if (__atomic_load_n(&row[d], __ATOMIC_ACQUIRE) > floor_ns) ++stamped;
    if (stamped >= local_devices) return true;
  }
  return false;
}

}  // namespace

// Sends [*lo, hi) of every row as frames of at most per_row bytes per row
// while the stop rule allows; *lo advances past what was handed over.
// link[0..1]: bytes modelled ahead on the link and when (ns), updated.
// log: 3 int64 per frame (handed from, to: ns; bytes), at most max_frames.
// Returns the frames sent (>= 0), or -errno (-ETIMEDOUT: a wait past
// timeout_ms), with *lo and the log up to date either way.
extern "C" int64_t CapricornSendWindow(int fd, const uint8_t* const* rows, int nrows,
                                       int64_t version, int64_t* lo, int64_t hi, int64_t per_row,
                                       int64_t close_ns, double rate, int64_t queue_bound,
                                       double* link, const int64_t* stamps, const int64_t* slots,
                                       int nslots, int columns, int local_devices,
                                       int64_t floor_ns, int64_t* log, int64_t max_frames,
                                       int timeout_ms) {
  crc_ready();
  if (nrows < 1 || nrows > 64 || per_row < 1) return -EINVAL;
  int64_t frames = 0;
  iovec iov[65];
  while (*lo < hi && frames < max_frames) {
    const int64_t stop = hi - *lo < per_row ? hi : *lo + per_row;
    const int64_t nbytes = (stop - *lo) * nrows;
    int64_t now;
    for (;;) {
      if (stamps != nullptr && collective_started(stamps, slots, nslots, columns, local_devices,
                                                  floor_ns))
        return frames;
      now = now_ns();
      double ahead = link[0] - rate * (now - link[1]) * 1e-9;
      if (ahead < 0) ahead = 0;
      int kernel = 0;
      if (ioctl(fd, SIOCOUTQ, &kernel) == 0 && kernel < ahead) ahead = kernel;
      if (now + (ahead + nbytes) / rate * 1e9 > close_ns) return frames;
      if (ahead <= queue_bound) {
        link[0] = ahead + nbytes;
        link[1] = static_cast<double>(now);
        break;
      }
      double wait_ns = (ahead - queue_bound) / rate * 1e9;
      if (wait_ns > 1e6) wait_ns = 1e6;  // look at the marks at least every millisecond
      timespec t{0, static_cast<long>(wait_ns)};
      nanosleep(&t, nullptr);
    }
    Header header{version, *lo, stop - *lo, nrows, 0};
    uint32_t crc = 0;
    for (int r = 0; r < nrows; ++r) crc = crc32(crc, rows[r] + *lo, stop - *lo);
    header.crc = crc;
    iov[0] = {&header, sizeof(header)};
    for (int r = 0; r < nrows; ++r)
      iov[r + 1] = {const_cast<uint8_t*>(rows[r] + *lo), static_cast<size_t>(stop - *lo)};
    const int failed = send_all(fd, iov, nrows + 1, timeout_ms);
    if (failed != 0) return failed;
    log[3 * frames] = now;
    log[3 * frames + 1] = now_ns();
    log[3 * frames + 2] = nbytes;
    ++frames;
    *lo = stop;
  }
  return frames;
}

// zlib's CRC-32 of n bytes, continuing crc (tests compare it with zlib.crc32).
extern "C" uint32_t CapricornCrc32(uint32_t crc, const uint8_t* data, int64_t n) {
  crc_ready();
  return crc32(crc, data, n);
}

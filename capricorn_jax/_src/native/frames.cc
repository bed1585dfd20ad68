// The chunk channel's frames without Python, both ends, each call with the
// GIL released (ctypes). Compiled after the prelude of ``native.integrity``
// (``native_prelude``), which defines ``Header`` (version, offset, length per
// row, rows, the frame's CRC32C over the header's first kFieldBytes and then
// the rows, the header's own CRC32C) and ``capricorn_integrity::crc32c``:
// the one definition of the header and the checksum.
//
// CapricornSendWindow, the deadline sender's window loop, with the stop rule
// of ``ThreadedSender._send_until`` (the same decisions, tested against it):
//
//   * stop as soon as every local device stamped a collective's start edge
//     after the window opened (the mark table the native marks write);
//   * stop before a frame the link could not carry by the window's planned
//     close: now + (bytes ahead on the link + the frame) / rate > close;
//   * hand a frame over only while at most ``queue_bound`` bytes are ahead on
//     the link (a model at the link's rate, capped by SIOCOUTQ).
//
// While a frame waits for the link to drain to the bound, the loop sleeps on
// the mark table's eventfd (every mark writes it), so a collective's start
// ends the wait at once and nothing else wakes it.
//
// Each frame is sent with one gathered sendmsg (partial sends go on; the
// socket is non-blocking under Python's timeout, so each wait is a bounded
// poll); one call per window.
//
// CapricornReceiveFrames, the receive loop's: the frames of one version read
// straight into its buffer and checked, one call per run of them (see there).
// A header's offset, length and rows are checked against the buffer without
// overflow (frame_rejection, ``integrity.frame_rejection``'s rule: the
// bounds come from the prelude) before a byte of its body is placed; a frame
// that fails is refused with its reason in status[1], nothing written.
//
// Built with -Wall -Wextra -Werror (``native.build``), and in CI once more
// under AddressSanitizer and UndefinedBehaviorSanitizer (tests/test_sanitizers.py).
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <vector>

namespace {

using capricorn_integrity::crc32c;

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// After a call on fd said EAGAIN (or EINTR): waits for `events`, at most
// timeout_ms (-1: none). 0: try again; -ETIMEDOUT or -errno otherwise.
int wait_for(int fd, short events, int timeout_ms) {
  if (errno == EINTR) return 0;
  if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
  pollfd p{fd, events, 0};
  int ready = poll(&p, 1, timeout_ms);
  if (ready == 0) return -ETIMEDOUT;
  if (ready < 0 && errno != EINTR) return -errno;
  return 0;
}

// Sends every byte of iov[0..n) (modified), each wait bounded by timeout_ms.
int send_all(int fd, iovec* iov, int n, int timeout_ms) {
  int first = 0;
  while (first < n) {
    msghdr msg{};
    msg.msg_iov = iov + first;
    msg.msg_iovlen = n - first;
    ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      const int failed = wait_for(fd, POLLOUT, timeout_ms);
      if (failed != 0) return failed;
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

// Until wake_fd (the mark table's eventfd) is readable or wait_ns passed;
// then drains it (non-blocking: a wake that found it empty is no failure).
// The caller looks at the marks again either way. 0, or -EBADF for a
// descriptor that is not open (it would wake every poll at once: a spin).
int wait_for_mark(int wake_fd, int64_t wait_ns) {
  if (wait_ns < 0) wait_ns = 0;
  timespec t{static_cast<time_t>(wait_ns / 1000000000), static_cast<long>(wait_ns % 1000000000)};
  pollfd p{wake_fd, POLLIN, 0};
  const int ready = ppoll(&p, 1, &t, nullptr);
  if (ready < 0) return errno == EINTR ? 0 : -errno;
  if (ready > 0 && (p.revents & POLLNVAL)) return -EBADF;
  if (ready > 0) {
    uint64_t count = 0;
    const ssize_t got = read(wake_fd, &count, sizeof(count));
    (void)got;
  }
  return 0;
}

// How many of a site's `columns` stamps are above floor_ns (the devices that
// passed it since), the last of them in *last (0: none).
int stamped_since(const int64_t* row, int columns, int64_t floor_ns, int64_t* last) {
  int stamped = 0;
  *last = 0;
  for (int d = 0; d < columns; ++d) {
    const int64_t stamp = __atomic_load_n(&row[d], __ATOMIC_ACQUIRE);
    if (stamp > floor_ns) {
      ++stamped;
      if (stamp > *last) *last = stamp;
    }
  }
  return stamped;
}

bool collective_started(const int64_t* stamps, const int64_t* slots, int nslots, int columns,
                        int local_devices, int64_t floor_ns) {
  int64_t last = 0;
  for (int s = 0; s < nslots; ++s)
    if (stamped_since(stamps + slots[s] * columns, columns, floor_ns, &last) >= local_devices)
      return true;
  return false;
}

// The stop rule's one decision before a frame (``scheduling.threaded.stop_rule.decide``,
// the same in seconds; tested side by side): with `ahead` the bytes modelled
// on the link (link_bytes handed over at link_ns, drained at `rate` since),
// at most what the kernel holds (`kernel`; < 0: unknown).
enum Decision : int { kSend = 0, kStarted = 1, kClose = 2, kWait = 3 };

Decision stop_rule(bool started, int64_t now, double link_bytes, double link_ns, double kernel,
                   double nbytes, double rate, int64_t close_ns, double queue_bound,
                   double* ahead_out) {
  *ahead_out = 0;
  if (started) return kStarted;
  double ahead = link_bytes - rate * (static_cast<double>(now) - link_ns) * 1e-9;
  if (ahead < 0) ahead = 0;
  if (kernel >= 0 && kernel < ahead) ahead = kernel;
  *ahead_out = ahead;
  if (static_cast<double>(now) + (ahead + nbytes) / rate * 1e9 > static_cast<double>(close_ns))
    return kClose;
  if (ahead <= queue_bound) return kSend;
  return kWait;
}

}  // namespace

// The stop rule alone (tests hold it to the Python one): the Decision, the
// bytes ahead in *ahead.
extern "C" int CapricornStopRule(int started, int64_t now, double link_bytes, double link_ns,
                                 double kernel, double nbytes, double rate, int64_t close_ns,
                                 double queue_bound, double* ahead) {
  return stop_rule(started != 0, now, link_bytes, link_ns, kernel, nbytes, rate, close_ns,
                   queue_bound, ahead);
}

// Sends [*lo, hi) of every row as frames of at most per_row bytes per row
// while the stop rule allows; *lo advances past what was handed over.
// link[0..1]: bytes modelled ahead on the link and when (ns), updated.
// log: 3 int64 per frame (handed from, to: ns; bytes), at most max_frames.
// wake_fd: the mark table's eventfd, waited on while the link drains (-1:
// none; the wait then looks at the marks every millisecond; not open: -EBADF).
// flip = 1 (fault injection, ``ChunkChannel.flip_version``): the first
// frame's row 0 leaves with its middle byte flipped after its checksum, from
// a copy (the rows are the caller's and stay as they are).
// Returns the frames sent (>= 0), or -errno (-ETIMEDOUT: a wait past
// timeout_ms; -EINVAL: arguments out of range), with *lo and the log up to
// date either way.
extern "C" int64_t CapricornSendWindow(int fd, const uint8_t* const* rows, int nrows,
                                       int64_t version, int64_t* lo, int64_t hi, int64_t per_row,
                                       int64_t close_ns, double rate, int64_t queue_bound,
                                       double* link, const int64_t* stamps, const int64_t* slots,
                                       int nslots, int columns, int local_devices,
                                       int64_t floor_ns, int wake_fd, int64_t* log,
                                       int64_t max_frames, int timeout_ms, int flip) {
  if (nrows < 1 || nrows > 64 || per_row < 1 || *lo < 0 || hi < *lo || !(rate > 0) ||
      (stamps != nullptr && (nslots < 0 || columns < 1 || slots == nullptr)))
    return -EINVAL;
  int64_t frames = 0;
  iovec iov[65];
  std::vector<uint8_t> flipped;
  while (*lo < hi && frames < max_frames) {
    const int64_t stop = hi - *lo < per_row ? hi : *lo + per_row;
    const int64_t nbytes = (stop - *lo) * nrows;
    int64_t now;
    for (;;) {
      const bool started = stamps != nullptr && collective_started(stamps, slots, nslots,
                                                                   columns, local_devices,
                                                                   floor_ns);
      now = now_ns();
      int queued = 0;
      const double kernel = ioctl(fd, SIOCOUTQ, &queued) == 0 ? queued : -1.0;
      double ahead = 0;
      const Decision decision = stop_rule(started, now, link[0], link[1], kernel,
                                          static_cast<double>(nbytes), rate, close_ns,
                                          static_cast<double>(queue_bound), &ahead);
      if (decision == kStarted || decision == kClose) return frames;
      if (decision == kSend) {
        link[0] = ahead + static_cast<double>(nbytes);
        link[1] = static_cast<double>(now);
        break;
      }
      double wait_ns = (ahead - queue_bound) / rate * 1e9;
      if (wait_ns > 6e10) wait_ns = 6e10;  // one sleep at most a minute: decided again after
      if (wake_fd >= 0) {  // until the link drained to the bound, or a mark
        const int failed = wait_for_mark(wake_fd, static_cast<int64_t>(wait_ns));
        if (failed != 0) return failed;
        continue;
      }
      if (stamps != nullptr && wait_ns > 1e6) wait_ns = 1e6;  // look at the marks every ms
      const int64_t wait = static_cast<int64_t>(wait_ns);
      timespec t{static_cast<time_t>(wait / 1000000000), static_cast<long>(wait % 1000000000)};
      nanosleep(&t, nullptr);
    }
    Header header{version, *lo, stop - *lo, nrows, 0, 0};
    const uint8_t* head = reinterpret_cast<const uint8_t*>(&header);
    uint32_t crc = crc32c(0, head, kFieldBytes);
    for (int r = 0; r < nrows; ++r) crc = crc32c(crc, rows[r] + *lo, stop - *lo);
    header.crc = crc;
    header.head_crc = crc32c(0, head, sizeof(Header) - 4);
    iov[0] = {&header, sizeof(header)};
    for (int r = 0; r < nrows; ++r)
      iov[r + 1] = {const_cast<uint8_t*>(rows[r] + *lo), static_cast<size_t>(stop - *lo)};
    if (flip != 0 && frames == 0) {  // fault injection: corrupted after the checksum
      flipped.assign(rows[0] + *lo, rows[0] + stop);
      flipped[flipped.size() / 2] ^= 0xFF;
      iov[1] = {flipped.data(), flipped.size()};
    }
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

// The sender's wait for a window's mark (``WindowMarks.wait_opened``), the
// GIL released: until `local` columns of `row` hold a stamp > floor_ns (1,
// the last of them in *opened_ns), the step moved on (*epoch_cell no longer
// `epoch`: 2), or the monotonic clock reached deadline_ns (0), waking on
// wake_fd (every mark writes it). -EINVAL: arguments out of range; -EBADF:
// wake_fd is not open.
extern "C" int CapricornWaitStamped(int wake_fd, const int64_t* row, int columns, int local,
                                    int64_t floor_ns, const int64_t* epoch_cell, int64_t epoch,
                                    int64_t deadline_ns, int64_t* opened_ns) {
  if (wake_fd < 0 || row == nullptr || epoch_cell == nullptr || opened_ns == nullptr ||
      columns < 1 || local < 1)
    return -EINVAL;
  for (;;) {
    if (__atomic_load_n(epoch_cell, __ATOMIC_ACQUIRE) != epoch) return 2;
    int64_t last = 0;
    if (stamped_since(row, columns, floor_ns, &last) >= local) {
      // of this step only if the step did not move on meanwhile
      if (__atomic_load_n(epoch_cell, __ATOMIC_ACQUIRE) != epoch) return 2;
      *opened_ns = last;
      return 1;
    }
    const int64_t left = deadline_ns - now_ns();
    if (left <= 0) return 0;
    const int failed = wait_for_mark(wake_fd, left);
    if (failed != 0) return failed;
  }
}

// CRC32C of n bytes, continuing crc (tests compare it with the crc32c package's).
extern "C" uint32_t CapricornCrc32c(uint32_t crc, const uint8_t* data, int64_t n) {
  return crc32c(crc, data, n);
}

// The same by the tables alone (the path of a CPU without SSE4.2; tested).
extern "C" uint32_t CapricornCrc32cTables(uint32_t crc, const uint8_t* data, int64_t n) {
  return ~capricorn_integrity::update_tables(~crc, data, n);
}

namespace {

// What CapricornReceiveFrames ended on (status[0]).
enum Status : int64_t {
  kCovered = 0,   // the frames read cover `remaining`: the caller's turn
  kHeader = 1,    // a header of another version (or for no buffer): in `header`, body unread
  kIdle = 2,      // no byte of a frame within idle_ms
  kCorrupt = 3,   // the last frame (read whole, header in `header`) fails its checksum
  kDiscarded = 4, // the frame of `header` was read and dropped (no buffer given)
  kFull = 5,      // the log is full
};

// Why a frame of h cannot go into a buffer of nrows x cols (kFits: it can),
// ``integrity.frame_rejection``'s checks in its order, none of which can
// overflow: every bound is checked before a sum or product uses it.
// nrows < 0: a frame to discard (only the bounds every frame keeps).
int64_t frame_rejection(const Header& h, int64_t nrows, int64_t cols) {
  if (h.rows < 1 || h.rows > kMaxRows) return kReject_rows;
  if (h.offset < 0) return kReject_negative_offset;
  if (h.length < 0) return kReject_negative_length;
  if (h.length == 0) return kReject_empty;
  if (h.offset > kMaxRowBytes || h.length > kMaxRowBytes) return kReject_too_long;
  if (nrows < 0) return kFits;
  if (h.rows != nrows) return kReject_rows;
  if (h.length > cols - h.offset) return kReject_past_end;
  return kFits;
}

// Sets SO_RCVLOWAT to `want` unless *mark already holds it (the channel's
// record of the mark last set: ``ChunkChannel._mark``).
void low_water(int fd, int64_t want, int64_t* mark) {
  if (*mark == want) return;
  int value = static_cast<int>(want);
  if (setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &value, sizeof(value)) == 0) *mark = want;
}

// Fills p[0..n) from fd. Each wait asks the kernel to wake the reader only
// once the rest (at most 64 KiB) is queued, and is bounded by wait_ms (-1:
// none). Returns 0, -ETIMEDOUT when a wait ran out before the first byte
// (*got tells how far it came), -EPIPE when the peer closed, or -errno.
int64_t recv_exact(int fd, uint8_t* p, int64_t n, int wait_ms, int64_t* mark, int64_t* got) {
  *got = 0;
  while (*got < n) {
    const int64_t left = n - *got;
    low_water(fd, left < (1 << 16) ? left : (1 << 16), mark);
    ssize_t r = recv(fd, p + *got, static_cast<size_t>(left), MSG_DONTWAIT);
    if (r > 0) {
      *got += r;
      continue;
    }
    if (r == 0) return -EPIPE;
    const int failed = wait_for(fd, POLLIN, wait_ms);
    if (failed != 0) return failed;
  }
  return 0;
}

}  // namespace

// Receives frames from fd into `version`'s buffer (row r at base + r * stride,
// `cols` bytes each) until their per-row bytes cover `remaining`, or a header
// of another version arrives, or no byte of a next frame within idle_ms.
// header[sizeof(Header)]: in, with have_header = 1, a header already read (its body is
// next on the socket); out, the header the call ended on. discard = 1: the
// frame of the given header is read and dropped (kDiscarded); base == nullptr:
// the call ends at the first header (kHeader). Each wait
// once a frame began is bounded by timeout_ms. log: 2 int64 per frame read
// into the buffer and checked (offset, length per row), at most max_frames.
// status[2]: [0] the Status it ended on; [1] with -EBADMSG, the Reject code.
// Returns the frames logged (>= 0) or -errno (-ETIMEDOUT: a frame stalled
// past timeout_ms; -EPIPE: the peer closed; -EPROTO: a header that fails its
// own checksum (the stream's framing is lost); -EBADMSG: a frame refused by
// frame_rejection, its header in `header`, none of its body read; -EINVAL:
// arguments out of range), the log up to date either way.
extern "C" int64_t CapricornReceiveFrames(int fd, int64_t version, uint8_t* base, int nrows,
                                          int64_t stride, int64_t cols, int64_t remaining,
                                          uint8_t* header, int have_header, int discard,
                                          int idle_ms,
                                          int timeout_ms, int64_t* mark, int64_t* log,
                                          int64_t max_frames, int64_t* status) {
  int64_t frames = 0, got = 0;
  status[0] = kIdle;
  status[1] = kFits;
  if (max_frames < 1 || (base != nullptr && (nrows < 1 || cols < 0 ||
                                              (nrows > 1 && stride < cols))))
    return -EINVAL;
  bool pending = have_header != 0;
  static thread_local uint8_t scratch[1 << 16];
  for (;;) {
    Header h;
    if (!pending) {
      if (frames >= max_frames) { status[0] = kFull; return frames; }
      // The header: within idle_ms (an idle link is no failure), or once its
      // first byte came, the rest within the bound.
      int64_t r = recv_exact(fd, header, sizeof(Header), idle_ms, mark, &got);
      if (r == -ETIMEDOUT && got == 0) { status[0] = kIdle; return frames; }
      if (r == -ETIMEDOUT) {
        int64_t more = 0;
        r = recv_exact(fd, header + got, sizeof(Header) - got, timeout_ms, mark, &more);
      }
      if (r < 0) return r;
    }
    pending = false;
    std::memcpy(&h, header, sizeof(h));
    // The header first: its length and offset are trusted only once it passes.
    if (crc32c(0, header, sizeof(Header) - 4) != h.head_crc) return -EPROTO;
    // Checked against the buffer only where it would be placed there.
    const bool place = discard == 0 && base != nullptr && h.version == version;
    const int64_t refused = frame_rejection(h, place ? nrows : -1, cols);
    if (refused != kFits) { status[1] = refused; return -EBADMSG; }
    if (discard) {  // dropped: read whole, checked by nobody
      int64_t left = h.length * h.rows;  // both bounded: no overflow
      while (left > 0) {
        const int64_t n = left < static_cast<int64_t>(sizeof(scratch)) ? left : sizeof(scratch);
        int64_t r = recv_exact(fd, scratch, n, timeout_ms, mark, &got);
        if (r < 0) return r;
        left -= n;
      }
      status[0] = kDiscarded;
      return frames;
    }
    if (h.version != version || base == nullptr) { status[0] = kHeader; return frames; }
    uint32_t crc = crc32c(0, header, kFieldBytes);
    for (int r = 0; r < nrows; ++r) {
      uint8_t* row = base + static_cast<int64_t>(r) * stride + h.offset;
      int64_t failed = recv_exact(fd, row, h.length, timeout_ms, mark, &got);
      if (failed < 0) return failed;
      crc = crc32c(crc, row, h.length);
    }
    if (crc != h.crc) { status[0] = kCorrupt; return frames; }
    log[2 * frames] = h.offset;
    log[2 * frames + 1] = h.length;
    ++frames;
    remaining -= h.length;
    if (remaining <= 0) { status[0] = kCovered; return frames; }
  }
}

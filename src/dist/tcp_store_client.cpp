// The TCPStore client of torchrun launches that share the agent's store (see tcp_store_client.h for the contract and
// the wire format). Sockets are non-blocking; every connect, send and receive waits in poll() for at most what is
// left of the caller's time limit.
#include "dist/tcp_store_client.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace nopad::dist {
namespace {

enum Query : uint8_t { kValidate = 0, kSet = 1, kGet = 3, kCheck = 5, kWait = 6 };
constexpr uint32_t kValidationMagic = 0x3C85F7CE;
constexpr uint8_t kReady = 0, kNotReady = 1, kStopWaiting = 0;
constexpr uint64_t kMaxValueBytes = 1 << 20;  // nopad stores an address: anything larger is not ours
constexpr const char* kProbeKey = "nopad/probe";  // checked once after the handshake: is this a TCPStore?

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Milliseconds left until the deadline for poll(), at least 0.
int ms_left(double deadline) {
  const double left = deadline - now_s();
  return left <= 0 ? 0 : static_cast<int>(std::min(left * 1000 + 1, 1e9));
}

void put_u64(std::string& out, uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }
void put_str(std::string& out, std::string_view s) {
  put_u64(out, s.size());
  out.append(s);
}
// Keys on the wire carry PyTorch's client prefix "/".
std::string wire_key(std::string_view key) {
  std::string k(1, '/');
  k.append(key);
  return k;
}

}  // namespace

int connect_within(const addrinfo* a, double timeout_s, std::string& error) {
  const double deadline = now_s() + timeout_s;
  const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
  if (fd < 0) {
    error = std::string("socket(): ") + std::strerror(errno);
    return -1;
  }
  if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) return fd;
  if (errno != EINPROGRESS) {
    error = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  int ready;
  do {
    ready = ::poll(&p, 1, ms_left(deadline));
  } while (ready < 0 && errno == EINTR);
  int so_error = 0;
  socklen_t len = sizeof so_error;
  if (ready <= 0) {
    error = "connection attempt timed out";
  } else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0 || so_error != 0) {
    error = std::strerror(so_error != 0 ? so_error : errno);
  } else {
    return fd;
  }
  ::close(fd);
  return -1;
}

TcpStoreClient::TcpStoreClient(const std::string& host, int port, double timeout_s, std::string role)
    : endpoint_(host + ":" + std::to_string(port)), role_(std::move(role)) {
  NOPAD_CHECK(port > 0 && port < 65536, role_, ": port ", port, " is not a TCP port (1..65535)");
  const double deadline = now_s() + timeout_s;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port_text = std::to_string(port);
  std::string last_error = "not tried";
  while (fd_ < 0) {
    addrinfo* res = nullptr;
    const int gai = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res);
    if (gai != 0) {
      last_error = std::string("cannot resolve '") + host + "': " + ::gai_strerror(gai);
    } else {
      // At most 5 s per address, so that one which drops packets leaves time for the next.
      for (addrinfo* a = res; a != nullptr && fd_ < 0; a = a->ai_next)
        fd_ = connect_within(a, std::clamp(deadline - now_s(), 0.0, 5.0), last_error);
      ::freeaddrinfo(res);
    }
    if (fd_ >= 0) break;
    if (now_s() >= deadline)
      fail("cannot reach ", role_, " (", endpoint_, ") within ", timeout_s, " s: ", last_error,
           ". Check that the job was started by torchrun and that this host can reach ", endpoint_);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(100, std::max(1, ms_left(deadline)))));
  }
  int one = 1;
  (void)::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

  // The handshake has no reply; one CHECK round trip then shows that the server speaks the protocol.
  try {
    std::string hello(1, static_cast<char>(kValidate));
    hello.append(reinterpret_cast<const char*>(&kValidationMagic), sizeof kValidationMagic);
    send_all(hello, deadline, "the handshake (VALIDATE)");
    (void)check(kProbeKey, std::max(0.0, deadline - now_s()) + 5);
  } catch (...) {
    ::close(fd_);  // the destructor does not run for a constructor that throws
    fd_ = -1;
    throw;
  }
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

void TcpStoreClient::set(std::string_view key, std::string_view value, double timeout_s) {
  std::string q(1, static_cast<char>(kSet));
  put_str(q, wire_key(key));
  put_str(q, value);
  send_all(q, now_s() + timeout_s, "SET");
}

std::optional<uint8_t> TcpStoreClient::key_query(uint8_t type, std::string_view key, double deadline,
                                                 const char* what) {
  std::string q(1, static_cast<char>(type));
  put_u64(q, 1);
  put_str(q, wire_key(key));
  send_all(q, deadline, what);
  uint8_t reply = 0xff;
  if (!recv_all(&reply, 1, deadline, what)) return std::nullopt;
  return reply;
}

bool TcpStoreClient::check(std::string_view key, double timeout_s) {
  const std::optional<uint8_t> answer = key_query(kCheck, key, now_s() + timeout_s, "CHECK");
  if (!answer)
    fail(role_, " (", endpoint_, ") did not answer a CHECK query within ", timeout_s,
         " s: is it a PyTorch c10d TCPStore (torchrun of PyTorch 2.4 or later)?");
  const uint8_t reply = *answer;
  NOPAD_CHECK(reply == kReady || reply == kNotReady, role_, " (", endpoint_, ") answered a CHECK query with ",
              static_cast<int>(reply), " instead of 0 or 1: it does not speak the c10d TCPStore protocol nopad "
              "knows (torchrun of PyTorch 2.4 or later)");
  return reply == kReady;
}

std::optional<std::string> TcpStoreClient::wait_get(std::string_view key, double timeout_s) {
  const double deadline = now_s() + timeout_s;
  const std::optional<uint8_t> reply = key_query(kWait, key, deadline, "WAIT");
  if (!reply) {
    ::close(fd_);  // the server drops a closed connection's wait; this client is done
    fd_ = -1;
    return std::nullopt;
  }
  NOPAD_CHECK(*reply == kStopWaiting, role_, " (", endpoint_, ") answered a WAIT query with ",
              static_cast<int>(*reply), " instead of 0 (STOP_WAITING)");
  std::string g(1, static_cast<char>(kGet));
  put_str(g, wire_key(key));
  const double get_deadline = std::max(deadline, now_s() + 5);  // the key exists: the reply is immediate
  send_all(g, get_deadline, "GET");
  uint64_t len = 0;
  if (!recv_all(&len, sizeof len, get_deadline, "GET"))
    fail(role_, " (", endpoint_, ") did not answer a GET query for a key that exists");
  NOPAD_CHECK(len <= kMaxValueBytes, role_, " (", endpoint_, "): the value of '", key, "' is ", len,
              " bytes long, not an address nopad wrote");
  std::string value(static_cast<size_t>(len), '\0');
  if (len > 0 && !recv_all(value.data(), value.size(), get_deadline, "GET"))
    fail(role_, " (", endpoint_, ") did not send the whole value of '", key, "'");
  return value;
}

std::string TcpStoreClient::local_address() const {
  NOPAD_CHECK(fd_ >= 0, "TcpStoreClient: the connection to ", endpoint_, " is closed");
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  NOPAD_CHECK(::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0, "getsockname() on the connection to ",
              role_, ": ", std::strerror(errno));
  char host[NI_MAXHOST] = {0};
  const int rc = ::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof host, nullptr, 0, NI_NUMERICHOST);
  NOPAD_CHECK(rc == 0, "the local address of the connection to ", role_, ": ", ::gai_strerror(rc));
  return host;
}

int TcpStoreClient::local_family() const {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (fd_ < 0 || ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) return AF_UNSPEC;
  return a.ss_family;
}

void TcpStoreClient::send_all(const std::string& bytes, double deadline, const char* what) {
  NOPAD_CHECK(fd_ >= 0, "TcpStoreClient: the connection to ", endpoint_, " is closed");
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t k = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (k > 0) {
      sent += static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_, POLLOUT, 0};
      const int ready = ::poll(&p, 1, ms_left(deadline));
      if (ready == 0)
        fail("sending ", what, " to ", role_, " (", endpoint_, ") did not complete in time: the store is not "
             "reading; check the torchrun agent");
      continue;
    }
    fail("sending ", what, " to ", role_, " (", endpoint_, ") failed: ", k < 0 ? std::strerror(errno) : "closed",
         ". The torchrun agent (the store's owner) may have exited");
  }
}

bool TcpStoreClient::recv_all(void* p, size_t n, double deadline, const char* what) {
  NOPAD_CHECK(fd_ >= 0, "TcpStoreClient: the connection to ", endpoint_, " is closed");
  auto* b = static_cast<uint8_t*>(p);
  while (n > 0) {
    const ssize_t k = ::recv(fd_, b, n, 0);
    if (k > 0) {
      b += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k == 0 || (k < 0 && (errno == ECONNRESET || errno == EPIPE)))
      fail(role_, " (", endpoint_, ") closed the connection during ", what, ": the torchrun agent exited, or the "
           "server is not a PyTorch c10d TCPStore that nopad can talk to (torchrun of PyTorch 2.4 or later)");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      fail("receiving the reply to ", what, " from ", role_, " (", endpoint_, ") failed: ", std::strerror(errno));
    pollfd q{fd_, POLLIN, 0};
    const int ready = ::poll(&q, 1, ms_left(deadline));
    if (ready == 0) return false;
    if (ready < 0 && errno != EINTR)
      fail("waiting for ", role_, " (", endpoint_, ") failed: ", std::strerror(errno));
  }
  return true;
}

}  // namespace nopad::dist

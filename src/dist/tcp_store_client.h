// A minimal client of PyTorch's c10d TCPStore, the key-value server that torchrun's agent runs for its rendezvous.
// nopad uses it for one thing: under a torchrun launch with TORCHELASTIC_USE_AGENT_STORE=True, MASTER_ADDR:MASTER_PORT
// is that server (already bound by the agent), so the ranks meet through it instead of listening on MASTER_PORT:
// rank 0 publishes the address of its own listening socket under a job-unique key, the other ranks wait for the key
// and read it (dist/comm_tcp.cpp).
//
// What it computes: a connection to host:port that has passed the store's handshake; set(key, value); whether keys
// exist (check); the value of a key once some client has set it (wait_get); and the numeric address of this end of
// the connection (the address of this host on the network the store is reachable through).
//
// Contract:
//  - Every call has a time limit: connecting retries refused or unreachable connections until the limit, and every
//    send and receive is bounded by the caller's deadline, so nothing here hangs. A failure (name resolution, a
//    connection that cannot be made or is closed, an unexpected reply) throws nopad::Error naming the store's
//    host:port, what was being done and what to check. wait_get() returns nothing when the key did not appear in
//    time; the caller says what that means.
//  - Keys are sent as PyTorch's own TCPStore client sends them: with a leading "/" (a Python TCPStore.get("k") on
//    the same server reads what set("k", ...) wrote here).
//  - Not thread-safe; one request at a time on one connection.
//
// The protocol spoken (PyTorch's c10d TCPStore wire format, the one with a per-connection VALIDATE handshake: torchrun
// of PyTorch 2.4 and later, checked against 2.15; both the libuv server, the default, and the classic server): every
// request is one byte of query type followed by its arguments, all integers in the host's (little-endian) byte order;
// a string or byte vector is a uint64 length and the bytes; a list of keys is a uint64 count and the strings.
//   VALIDATE (0) + uint32 0x3C85F7CE   first message of every connection; no reply
//   SET (1) + key + value              no reply
//   GET (3) + key                      reply: uint64 length + bytes
//   CHECK (5) + count + keys           reply: one byte, READY (0) when all exist, else NOT_READY (1)
//   WAIT (6) + count + keys            reply when all exist: one byte, STOP_WAITING (0)
// A WAIT given up on is abandoned by closing the connection (the server then drops the wait).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

struct addrinfo;

namespace nopad::dist {

// One connection attempt to `addr` (from getaddrinfo) that gives up after timeout_s, so that a host which drops
// packets cannot hold a caller past its own time limit: the connected socket (non-blocking, close-on-exec), or -1
// with `error` set. Also used by the TCP communicator's bootstrap (comm_tcp.cpp).
int connect_within(const addrinfo* addr, double timeout_s, std::string& error);

class TcpStoreClient {
 public:
  // Connects to host:port (a name or a numeric address) and sends the handshake, retrying refused or unreachable
  // connections for up to timeout_s seconds. `role` names the server in error messages (e.g. "torchrun's agent store
  // at MASTER_ADDR:MASTER_PORT").
  TcpStoreClient(const std::string& host, int port, double timeout_s, std::string role);
  ~TcpStoreClient();
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  void set(std::string_view key, std::string_view value, double timeout_s);
  // True when the key exists on the server.
  bool check(std::string_view key, double timeout_s);
  // The key's value once it exists; nothing when it does not exist within timeout_s.
  std::optional<std::string> wait_get(std::string_view key, double timeout_s);

  // This end of the connection: its numeric address ("10.1.2.3", "fd00::5", "127.0.0.1") and address family.
  std::string local_address() const;
  int local_family() const;
  // "host:port" as given to the constructor, for messages.
  const std::string& endpoint() const { return endpoint_; }

 private:
  // Sends a query of one key (CHECK or WAIT) and receives its one-byte reply; nothing when none came in time.
  std::optional<uint8_t> key_query(uint8_t type, std::string_view key, double deadline, const char* what);
  void send_all(const std::string& bytes, double deadline, const char* what);
  // Receives exactly n bytes before the deadline; false when the deadline passed first.
  bool recv_all(void* p, size_t n, double deadline, const char* what);

  int fd_ = -1;
  std::string endpoint_, role_;
};

}  // namespace nopad::dist

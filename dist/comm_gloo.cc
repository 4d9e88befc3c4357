/*
 * dist/comm_gloo.cc - the Gloo engine of dist/comm.h (one Gloo rank per node, TCP), and
 * the only C++ in embd: a thin shim that builds Gloo's option objects on the caller's buffers.
 *
 * Rendezvous goes through embd's store (dist/store.h) via StoreAdapter, a
 * gloo::rendezvous::Store whose keys carry options.prefix. Every collective gets a fresh tag
 * and the context's timeout. No exception leaves this file: guarded() catches each one at
 * the extern "C" boundary and turns it into an EMBD_E* code with Gloo's message, naming the
 * peer rank when the message holds a peer address that rendezvous recorded.
 */
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

extern "C" {
#include "embd/types.h"
#include "dist/store.h"
}
#include "dist/comm_internal.h"

namespace {

/* A store failure inside Gloo's rendezvous, carried out through Gloo as an exception. */
struct StoreError : public std::runtime_error {
	int rc;
	StoreError(int rc, const std::string &msg) : std::runtime_error(msg), rc(rc) {}
};

/* A peer's listening address as Gloo prints it: "[ip]:port". */
struct PeerAddress {
	std::string ip;
	unsigned port = 0;
};

PeerAddress peer_address(const struct sockaddr_storage &ss)
{
	PeerAddress a;
	char ip[INET6_ADDRSTRLEN] = "";
	if (ss.ss_family == AF_INET) {
		const auto *in = reinterpret_cast<const struct sockaddr_in *>(&ss);
		inet_ntop(AF_INET, &in->sin_addr, ip, sizeof(ip));
		a.port = ntohs(in->sin_port);
	} else if (ss.ss_family == AF_INET6) {
		const auto *in6 = reinterpret_cast<const struct sockaddr_in6 *>(&ss);
		inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof(ip));
		a.port = ntohs(in6->sin6_port);
	}
	a.ip = ip;
	return a;
}

/* The first "[ip]:port" in a Gloo message; ip empty when there is none. */
PeerAddress address_in(const std::string &msg)
{
	PeerAddress a;
	/* "[./gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.3]:33705" */
	size_t close = msg.find("]:");
	while (close != std::string::npos && !isdigit((unsigned char)msg[close + 2]))
		close = msg.find("]:", close + 1);
	size_t open = close == std::string::npos ? close : msg.rfind('[', close);
	if (open == std::string::npos)
		return a;
	a.ip = msg.substr(open + 1, close - open - 1);
	a.port = static_cast<unsigned>(strtoul(msg.c_str() + close + 2, nullptr, 10));
	return a;
}

/*
 * gloo::rendezvous::Store over an embd_store. Gloo's connectFullMesh sets key "<rank>" to the
 * addresses of its pairs (each a tcp::Address: a sockaddr_storage first) and reads every
 * other rank's; the adapter remembers those addresses per rank so that an error naming an
 * address can name the rank.
 */
class StoreAdapter : public gloo::rendezvous::Store {
public:
	StoreAdapter(struct embd_store *store, std::string prefix, int timeout_ms, uint32_t size)
		: store_(store), prefix_(std::move(prefix)), timeout_ms_(timeout_ms), peers_(size)
	{
	}

	void set(const std::string &key, const std::vector<char> &data) override
	{
		check(embd_store_set(store_, full(key).c_str(), data.data(), data.size()), key);
	}

	std::vector<char> get(const std::string &key) override
	{
		void *value = nullptr;
		size_t len = 0;
		embd_store_set_timeout(store_, timeout_ms_);
		check(embd_store_get(store_, full(key).c_str(), &value, &len), key);
		std::vector<char> out(static_cast<char *>(value), static_cast<char *>(value) + len);
		free(value);
		remember(key, out);
		return out;
	}

	void wait(const std::vector<std::string> &keys) override
	{
		wait(keys, std::chrono::milliseconds(timeout_ms_));
	}

	void wait(const std::vector<std::string> &keys,
		  const std::chrono::milliseconds &timeout) override
	{
		std::vector<std::string> names;
		std::vector<const char *> ptrs;
		for (const auto &k : keys)
			names.push_back(full(k));
		for (const auto &n : names)
			ptrs.push_back(n.c_str());
		auto ms = timeout.count() > 0 ? timeout.count() : timeout_ms_;
		embd_store_set_timeout(store_, static_cast<int>(ms));
		check(embd_store_wait(store_, ptrs.data(), ptrs.size()),
		      keys.empty() ? std::string() : keys[0]);
	}

	/*
	 * The rank whose listening address is in a Gloo message, or -1. Gloo prints a pair's
	 * peer_: the listening address it connected to (this version prints the port in network
	 * byte order, so both orders are tried), or, on the side that accepted, the far end of
	 * the socket, whose ephemeral port and source ip name nobody: that case stays unnamed
	 * rather than guessed (a multi-homed node connects from another ip than it listens on).
	 */
	int peer_in(const std::string &msg) const
	{
		PeerAddress a = address_in(msg);
		if (a.ip.empty())
			return -1;
		unsigned swapped = ((a.port & 0xffu) << 8) | ((a.port >> 8) & 0xffu);
		for (size_t r = 0; r < peers_.size(); r++)
			if (peers_[r].ip == a.ip &&
			    (peers_[r].port == a.port || peers_[r].port == swapped))
				return static_cast<int>(r);
		return -1;
	}

private:
	std::string full(const std::string &key) const { return prefix_ + key; }

	/* key "<r>" of Gloo's full mesh: addresses of rank r's pairs, sockaddr_storage first. */
	void remember(const std::string &key, const std::vector<char> &value)
	{
		char *end = nullptr;
		unsigned long r = strtoul(key.c_str(), &end, 10);
		if (key.empty() || *end || r >= peers_.size() ||
		    value.size() < sizeof(struct sockaddr_storage))
			return;
		struct sockaddr_storage ss;
		memcpy(&ss, value.data(), sizeof(ss));
		peers_[r] = peer_address(ss);
	}

	void check(int rc, const std::string &key) const
	{
		if (rc == 0)
			return;
		std::string msg = embd_store_error(store_);
		/* "<r>" and "rank_<r>" are rank r's rendezvous keys */
		const char *digits = key.c_str() + (key.rfind("rank_", 0) == 0 ? 5 : 0);
		char *end = nullptr;
		unsigned long r = strtoul(digits, &end, 10);
		if (*digits && !*end && rc == EMBD_ETIMEDOUT)
			msg = "rank " + std::to_string(r) + " did not join the rendezvous: " + msg;
		throw StoreError(rc, msg);
	}

	struct embd_store *store_;
	std::string prefix_;
	int timeout_ms_;
	std::vector<PeerAddress> peers_;        /* rank r's listening address, once seen */
};

struct GlooComm {
	std::shared_ptr<gloo::transport::Device> device;
	std::shared_ptr<gloo::rendezvous::Context> context;
	std::unique_ptr<StoreAdapter> store;    /* kept for peer_in() after rendezvous */
	std::chrono::milliseconds timeout{0};
	uint32_t tag = 0;
};

GlooComm *impl(struct embd_comm *comm)
{
	return static_cast<GlooComm *>(comm->impl);
}

bool contains(const std::string &s, const char *what)
{
	return s.find(what) != std::string::npos;
}

/* Gloo's message -> an EMBD_E* code: timeouts, then lost peers, then the default. */
int classify(const std::string &msg, int otherwise)
{
	if (contains(msg, "Timed out") || contains(msg, "timed out") ||
	    contains(msg, "Connect timeout") || contains(msg, "timeout"))
		return EMBD_ETIMEDOUT;
	if (contains(msg, "closed by peer") || contains(msg, "reset by peer") ||
	    contains(msg, "Broken pipe") || contains(msg, "Connection refused") ||
	    contains(msg, "EOF"))
		return EMBD_ECONNRESET;
	return otherwise;
}

int gloo_failure(struct embd_comm *comm, const char *op, int rc, const std::string &msg)
{
	GlooComm *g = impl(comm);
	int peer = g && g->store ? g->store->peer_in(msg) : -1;
	if (peer >= 0)
		return embd_comm_fail(comm, rc, "%s: peer rank %d: %s", op, peer, msg.c_str());
	return embd_comm_fail(comm, rc, "%s: %s", op, msg.c_str());
}

/* Runs fn, turning every exception into an EMBD_E* code and comm->err. */
template <typename Fn> int guarded(struct embd_comm *comm, const char *op, Fn fn)
{
	try {
		fn();
		return 0;
	} catch (const StoreError &e) {
		return embd_comm_fail(comm, e.rc, "%s: %s", op, e.what());
	} catch (const gloo::IoException &e) {
		return gloo_failure(comm, op, classify(e.what(), EMBD_ECONNRESET), e.what());
	} catch (const gloo::Exception &e) {
		return gloo_failure(comm, op, classify(e.what(), EMBD_EIO), e.what());
	} catch (const gloo::EnforceNotMet &e) {
		return gloo_failure(comm, op, classify(e.what(), EMBD_EIO), e.what());
	} catch (const std::bad_alloc &) {
		return embd_comm_fail(comm, EMBD_ENOMEM, "%s: out of memory", op);
	} catch (const std::exception &e) {
		return gloo_failure(comm, op, classify(e.what(), EMBD_EIO), e.what());
	} catch (...) {
		return embd_comm_fail(comm, EMBD_EIO, "%s: unknown C++ exception", op);
	}
}

int gloo_create(struct embd_comm *comm, const struct embd_comm_options *o,
		struct embd_store *store)
{
	GlooComm *g = new (std::nothrow) GlooComm;
	if (!g)
		return embd_comm_fail(comm, EMBD_ENOMEM, "out of memory");
	comm->impl = g;
	int rc = guarded(comm, "rendezvous", [&] {
		gloo::transport::tcp::attr attr;
		attr.hostname = o->hostname && *o->hostname ? o->hostname : "127.0.0.1";
		g->timeout = std::chrono::milliseconds(o->timeout_ms);
		g->device = gloo::transport::tcp::CreateDevice(attr);
		g->store.reset(new StoreAdapter(store, o->prefix ? o->prefix : "", o->timeout_ms,
						o->size));
		g->context = std::make_shared<gloo::rendezvous::Context>(
			static_cast<int>(o->rank), static_cast<int>(o->size));
		g->context->setTimeout(g->timeout);
		g->context->connectFullMesh(*g->store, g->device);
	});
	if (rc < 0) {
		delete g;
		comm->impl = nullptr;
	}
	return rc;
}

void gloo_destroy(void *p)
{
	try {
		delete static_cast<GlooComm *>(p);
	} catch (...) {
		/* a destructor that throws has nothing left to tell: the memory is gone either way */
	}
}

int gloo_alltoallv(struct embd_comm *comm, const void *send, const uint64_t *send_bytes,
		   void *recv, const uint64_t *recv_bytes)
{
	static uint8_t none;    /* Gloo wants a buffer even when nothing moves */
	GlooComm *g = impl(comm);
	return guarded(comm, "alltoallv", [&] {
		std::vector<int64_t> in(send_bytes, send_bytes + comm->size);
		std::vector<int64_t> out(recv_bytes, recv_bytes + comm->size);
		gloo::AlltoallvOptions opts(g->context);
		opts.setInput(send ? static_cast<uint8_t *>(const_cast<void *>(send)) : &none, in);
		opts.setOutput(recv ? static_cast<uint8_t *>(recv) : &none, out);
		opts.setTag(g->tag++);
		opts.setTimeout(g->timeout);
		gloo::alltoallv(opts);
	});
}

int gloo_allreduce(struct embd_comm *comm, void *data, size_t count, enum embd_comm_dtype dtype)
{
	GlooComm *g = impl(comm);
	return guarded(comm, "allreduce", [&] {
		gloo::AllreduceOptions opts(g->context);
		if (dtype == EMBD_COMM_F32) {
			opts.setOutput(static_cast<float *>(data), count);
			opts.setReduceFunction(
				static_cast<void (*)(void *, const void *, const void *, size_t)>(
					&gloo::sum<float>));
		} else {
			opts.setOutput(static_cast<uint64_t *>(data), count);
			opts.setReduceFunction(
				static_cast<void (*)(void *, const void *, const void *, size_t)>(
					&gloo::sum<uint64_t>));
		}
		opts.setTag(g->tag++);
		opts.setTimeout(g->timeout);
		gloo::allreduce(opts);
	});
}

int gloo_broadcast(struct embd_comm *comm, void *data, size_t bytes, uint32_t root)
{
	GlooComm *g = impl(comm);
	return guarded(comm, "broadcast", [&] {
		gloo::BroadcastOptions opts(g->context);
		opts.setOutput(static_cast<uint8_t *>(data), bytes);
		opts.setRoot(static_cast<int>(root));
		opts.setTag(g->tag++);
		opts.setTimeout(g->timeout);
		gloo::broadcast(opts);
	});
}

int gloo_barrier(struct embd_comm *comm)
{
	GlooComm *g = impl(comm);
	return guarded(comm, "barrier", [&] {
		gloo::BarrierOptions opts(g->context);
		opts.setTag(g->tag++);
		opts.setTimeout(g->timeout);
		gloo::barrier(opts);
	});
}

/* Every lane between two nodes is one slot of the call's tag: all transfers of a call are in
 * flight at once on the node's one context, each matched by (peer, slot). */
int gloo_sendrecv(struct embd_comm *comm, const struct embd_comm_xfer *sends, size_t ns,
		  const struct embd_comm_xfer *recvs, size_t nr)
{
	GlooComm *g = impl(comm);
	return guarded(comm, "sendrecv", [&] {
		const gloo::Slot slot = gloo::Slot::build(gloo::kAlltoallSlotPrefix, g->tag++);
		const auto deadline = std::chrono::steady_clock::now() + g->timeout;
		std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> out, in;
		for (size_t i = 0; i < ns; i++) {
			out.push_back(g->context->createUnboundBuffer(sends[i].buf, sends[i].bytes));
			out.back()->send(static_cast<int>(sends[i].peer),
					 slot + static_cast<uint8_t>(sends[i].lane));
		}
		for (size_t i = 0; i < nr; i++) {
			in.push_back(g->context->createUnboundBuffer(recvs[i].buf, recvs[i].bytes));
			in.back()->recv(static_cast<int>(recvs[i].peer),
					slot + static_cast<uint8_t>(recvs[i].lane));
		}
		/* one deadline for the whole call, as the step's collectives have */
		auto left = [&] {
			auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
				deadline - std::chrono::steady_clock::now());
			return ms.count() > 0 ? ms : std::chrono::milliseconds(1);
		};
		for (size_t i = 0; i < nr; i++)
			if (!in[i]->waitRecv(left()))
				throw gloo::IoException("peer rank " +
							std::to_string(recvs[i].peer) +
							": receive aborted");
		for (size_t i = 0; i < ns; i++)
			if (!out[i]->waitSend(left()))
				throw gloo::IoException("peer rank " +
							std::to_string(sends[i].peer) +
							": send aborted");
	});
}

} // namespace

extern "C" const struct embd_comm_engine embd_comm_gloo_engine = {
	"gloo", gloo_create, gloo_destroy, gloo_alltoallv, gloo_allreduce, gloo_broadcast,
	gloo_barrier, gloo_sendrecv, false,
};

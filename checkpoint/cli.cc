#include "checkpoint/cli.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <cstdio>
#include <iostream>
#include <thread>

#include "checkpoint/format.h"
#include "checkpoint/manifest_proto.h"
#include "checkpoint/restore.h"
#include "checkpoint/shard_server.h"
#include "checkpoint/store.h"
#include "checkpoint/writer.h"
#include "common/flags.h"
#include "common/http/server.h"

namespace lk::ckpt {
namespace {

constexpr char kUsage[] =
    "usage: checkpoint inspect DIR [--json]\n"
    "       checkpoint verify DIR\n"
    "       checkpoint reshard DIR --ranks N --out ROOT2\n"
    "       checkpoint serve DIR [--listen HOST:PORT] [--prefix /v1/shards]\n"
    "DIR is a checkpoint directory or a root holding step-* checkpoints.\n";

// A checkpoint directory as given, or the newest complete one of a root.
Result<std::string> ResolveDir(Env* env, const std::string& dir) {
  if (env->Exists(JoinPath(dir, kManifestFile))) return dir;
  if (!env->IsDir(dir)) return Error(Code::kNotFound, "{}: no such directory", dir);
  std::vector<std::string> skipped;
  auto ref = FindLatest(env, dir, &skipped);
  if (!ref.ok()) {
    std::string why;
    for (const auto& s : skipped) why += "; " + s;
    return Error(Code::kNotFound, "{}: no MANIFEST and no complete checkpoint{}", dir, why);
  }
  return ref->dir;
}

int Fail(const Status& st) {
  std::cerr << "checkpoint: " << st.ToString() << "\n";
  return 1;
}

// Parses flags after the command; returns 2 (usage) or -1 to go on.
int ParseFlags(Flags& flags, int argc, const char* const* argv, size_t positional) {
  Status st = flags.Parse(argc, argv, 2);
  if (flags.help_requested()) {
    std::cout << flags.Help();
    return 0;
  }
  if (!st.ok() || flags.positional().size() != positional) {
    std::cerr << (st.ok() ? std::string("wrong arguments") : st.ToString()) << "\n" << kUsage;
    return 2;
  }
  return -1;
}

int Inspect(int argc, const char* const* argv) {
  bool json = false;
  Flags flags("checkpoint inspect", "Print a checkpoint's manifest.");
  flags.Add("json", &json, "print the manifest as JSON", "LK_CHECKPOINT_JSON");
  if (int rc = ParseFlags(flags, argc, argv, 1); rc >= 0) return rc;
  Env* env = Env::Default();
  auto dir = ResolveDir(env, flags.positional()[0]);
  if (!dir.ok()) return Fail(dir.status());
  auto m = LoadManifest(env, *dir);
  if (!m.ok()) return Fail(m.status());
  if (json) {
    std::cout << ManifestToJson(*m) << "\n";
    return 0;
  }
  std::cout << fmt::format("checkpoint {}\nstep {}\nwriter ranks {}\ncreated_unix_ms {}\n"
                           "chunk_bytes {}\nbytes {}\npartial {}\n",
                           *dir, m->step, m->ranks, m->created_unix_ms, m->chunk_bytes,
                           m->data_bytes(), m->partial ? "yes" : "no");
  for (const auto& [k, v] : m->metadata) std::cout << fmt::format("metadata {}={}\n", k, v);
  for (const auto& f : m->files) {
    std::cout << fmt::format("file {} rank={} bytes={} header_bytes={}\n", f.name, f.rank,
                             f.size_bytes, f.header_bytes);
  }
  for (const auto& t : m->tensors) {
    std::string slices;
    for (const auto& s : t.slices) {
      slices += fmt::format(" [{},{})@{}:{}", s.rows.begin, s.rows.end, m->files[s.file].name, s.offset);
    }
    std::cout << fmt::format("tensor {} {} [{}]{}\n", t.name, DTypeName(t.dtype),
                             fmt::join(t.shape, ","), slices);
  }
  return 0;
}

int Verify(int argc, const char* const* argv) {
  Flags flags("checkpoint verify", "Check every checksum and every shard's layout.");
  if (int rc = ParseFlags(flags, argc, argv, 1); rc >= 0) return rc;
  Env* env = Env::Default();
  auto dir = ResolveDir(env, flags.positional()[0]);
  if (!dir.ok()) return Fail(dir.status());
  VerifyOptions o;
  o.on_file = [](const std::string& file, const Status& st) {
    if (st.ok()) std::cout << "ok " << file << "\n";
  };
  Status st = VerifyCheckpoint(env, *dir, o);
  if (!st.ok()) return Fail(st);
  std::cout << "verified " << *dir << "\n";
  return 0;
}

int Reshard(int argc, const char* const* argv) {
  uint32_t ranks = 0;
  std::string out;
  Flags flags("checkpoint reshard", "Rewrite a checkpoint for another number of ranks.");
  flags.Add("ranks", &ranks, "ranks of the new checkpoint", "LK_CHECKPOINT_RANKS");
  flags.Add("out", &out, "root to write the new checkpoint into (ROOT/step-S)", "LK_CHECKPOINT_OUT");
  if (int rc = ParseFlags(flags, argc, argv, 1); rc >= 0) return rc;
  if (ranks == 0 || out.empty()) {
    std::cerr << "--ranks and --out are required\n" << kUsage;
    return 2;
  }
  Env* env = Env::Default();
  auto dir = ResolveDir(env, flags.positional()[0]);
  if (!dir.ok()) return Fail(dir.status());
  WriterOptions w;
  w.root = out;
  w.keep = 0;
  CheckpointWriter writer(w);
  // One rank at a time, so memory holds one rank's share, not the whole state.
  for (uint32_t r = 0; r < ranks; ++r) {
    RestoreOptions ro;
    ro.layout = TargetLayout{ranks, r};
    auto state = RestoreFromDir(*dir, ro);
    if (!state.ok()) return Fail(state.status());
    Snapshot s;
    s.step = state->step;
    s.rank = r;
    s.ranks = ranks;
    s.attempt = "reshard";
    s.metadata = state->metadata;
    for (auto& t : state->tensors) {
      // No rows for this rank, or a replicated 0-d tensor that rank 0 stores.
      if (t.rows.empty() || t.rows != WriterRows(t.shape, ranks, r)) continue;
      auto bytes = ConstBytes::Own(std::move(t.data));
      s.tensors.push_back(SnapshotTensor{t.name, t.dtype, t.shape, t.rows, std::move(bytes)});
    }
    auto saved = writer.Save(s);
    if (!saved.ok()) return Fail(saved.status());
    if (saved->committed) std::cout << "wrote " << saved->dir << "\n";
  }
  return 0;
}

int Serve(int argc, const char* const* argv) {
  std::string listen = "127.0.0.1:0", prefix = "/v1/shards";
  uint32_t threads = 4;
  Flags flags("checkpoint serve", "Serve checkpoints to peers over HTTP Range requests.");
  flags.Add("listen", &listen, "HOST:PORT or unix:/path (port 0 picks one)", "LK_CHECKPOINT_LISTEN");
  flags.Add("prefix", &prefix, "URL prefix of the shard routes", "LK_CHECKPOINT_PREFIX");
  flags.Add("threads", &threads, "io threads", "LK_CHECKPOINT_THREADS");
  if (int rc = ParseFlags(flags, argc, argv, 1); rc >= 0) return rc;
  ShardServerOptions so;
  so.base_dir = flags.positional()[0];
  so.prefix = prefix;
  ShardServer shards(so);
  boost::asio::io_context ioc;
  http::ServerOptions ho;
  ho.write_timeout = Millis(120'000);
  http::Server server(ioc, ho, shards.AsHandler());
  Status st = server.Listen(listen);
  if (!st.ok()) return Fail(st);
  boost::asio::signal_set signals(ioc, SIGINT, SIGTERM);
  signals.async_wait([&](const boost::system::error_code&, int) {
    server.Stop();
    ioc.stop();
  });
  std::cout << "listening " << server.LocalAddress() << std::endl;
  std::vector<std::thread> pool;
  for (uint32_t i = 1; i < std::max<uint32_t>(1, threads); ++i) pool.emplace_back([&] { ioc.run(); });
  ioc.run();
  for (auto& t : pool) t.join();
  return 0;
}

}  // namespace

int RunCheckpointCli(int argc, const char* const* argv) {
  if (argc < 2) {
    std::cerr << kUsage;
    return 2;
  }
  std::string cmd = argv[1];
  if (cmd == "inspect") return Inspect(argc, argv);
  if (cmd == "verify") return Verify(argc, argv);
  if (cmd == "reshard") return Reshard(argc, argv);
  if (cmd == "serve") return Serve(argc, argv);
  if (cmd == "--help" || cmd == "help") {
    std::cout << kUsage;
    return 0;
  }
  std::cerr << "unknown command '" << cmd << "'\n" << kUsage;
  return 2;
}

}  // namespace lk::ckpt

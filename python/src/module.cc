// lightkeeper._native: the compiled part of the Python package, a thin binding of NativeManager.
// It links no torch: tensors arrive as (data address, element count, dtype name, device index),
// which the pure-Python layer takes from tensor.data_ptr(). Every call that may block (poll,
// commit, KV waits, allreduce) releases the GIL, so the notice thread and other Python threads
// run meanwhile. Errors raise lightkeeper.errors.Error (or QuorumLost for an allreduce that a
// failure notice cut short) with the library's reason code.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "python/src/native_manager.h"

namespace py = pybind11;

namespace lk::py_binding {

namespace {

using lk::python::ManagerOptions;
using lk::python::NativeManager;

// The exception types of lightkeeper.errors, looked up once at import.
py::object& ErrorType() {
  static py::object* type = new py::object();  // lives as long as the interpreter
  return *type;
}
py::object& QuorumLostType() {
  static py::object* type = new py::object();
  return *type;
}

[[noreturn]] void Raise(const Status& st, bool quorum_lost = false) {
  py::object type = quorum_lost ? QuorumLostType() : ErrorType();
  py::object exc = type(std::string(CodeName(st.code())), st.message());
  PyErr_SetObject(type.ptr(), exc.ptr());
  throw py::error_already_set();
}

void Check(const Status& st) {
  if (!st.ok()) Raise(st);
}

template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(*r);
}

comm::DType ParseDType(const std::string& name) {
  if (name == "float32") return comm::DType::kFloat32;
  if (name == "bfloat16") return comm::DType::kBFloat16;
  Raise(InvalidArgument("allreduce takes float32 or bfloat16, not {}", name));
}

comm::ReduceOp ParseOp(const std::string& name) {
  if (name == "avg") return comm::ReduceOp::kAvg;
  if (name == "sum") return comm::ReduceOp::kSum;
  Raise(InvalidArgument("allreduce op is \"avg\" or \"sum\", not \"{}\"", name));
}

std::unique_ptr<NativeManager> Open(const std::string& socket, uint32_t group_rank,
                                    uint32_t group_size, uint32_t init_timeout_ms,
                                    uint32_t op_timeout_ms, const std::string& bind_host) {
  ManagerOptions o;
  o.socket = socket;
  o.group_rank = group_rank;
  o.group_size = group_size;
  o.init_timeout = Millis(init_timeout_ms);
  o.op_timeout = Millis(op_timeout_ms);
  o.bind_host = bind_host;
  Result<std::unique_ptr<NativeManager>> m = [&] {
    py::gil_scoped_release release;
    return NativeManager::Create(std::move(o));
  }();
  return Take(std::move(m));
}

}  // namespace

}  // namespace lk::py_binding

using namespace lk;               // NOLINT: the binding names many library types
using namespace lk::py_binding;  // NOLINT

PYBIND11_MODULE(_native, m) {
  m.doc() = "Lightkeeper's trainer client (compiled part; use the lightkeeper package)";
  py::module_ errors = py::module_::import("lightkeeper.errors");
  ErrorType() = errors.attr("Error");
  QuorumLostType() = errors.attr("QuorumLost");
  m.attr("nccl_built") = comm::BackendBuilt(comm::Backend::kNccl);

  py::class_<client::PollResult>(m, "Quorum",
                                 "The agent's answer to a poll: the quorum this outer step runs "
                                 "on and what the trainer must do before it.")
      .def_readonly("quorum_id", &client::PollResult::quorum_id)
      .def_readonly("replica_rank", &client::PollResult::replica_rank)
      .def_readonly("replica_world_size", &client::PollResult::replica_world_size)
      .def_readonly("max_step", &client::PollResult::max_step)
      .def_readonly("reconfigure", &client::PollResult::reconfigure)
      .def_readonly("heal", &client::PollResult::heal)
      .def_readonly("drain", &client::PollResult::drain)
      .def_readonly("checkpoint_now", &client::PollResult::checkpoint_now)
      .def_readonly("initial", &client::PollResult::initial)
      .def_readonly("heal_sources", &client::PollResult::heal_sources)
      .def_readonly("restore_location", &client::PollResult::restore_location)
      .def_readonly("restore_step", &client::PollResult::restore_step)
      .def_readonly("reason", &client::PollResult::reason)
      .def_readonly("from_board", &client::PollResult::from_board)
      .def("__repr__", [](const client::PollResult& r) {
        return fmt::format(
            "Quorum(quorum_id={}, replica_rank={}, replica_world_size={}, max_step={}, "
            "reconfigure={}, heal={}, drain={}, checkpoint_now={}, initial={}, "
            "heal_sources={}, restore_location='{}')",
            r.quorum_id, r.replica_rank, r.replica_world_size, r.max_step, r.reconfigure,
            r.heal, r.drain, r.checkpoint_now, r.initial, r.heal_sources.size(),
            r.restore_location);
      });

  py::class_<NativeManager>(m, "NativeManager")
      .def(py::init(&Open), py::arg("socket"), py::arg("group_rank"), py::arg("group_size"),
           py::arg("init_timeout_ms"), py::arg("op_timeout_ms"), py::arg("bind_host"))
      .def("poll",
           [](NativeManager& self, uint32_t step, uint32_t timeout_ms) {
             Result<client::PollResult> r = [&] {
               py::gil_scoped_release release;
               return self.Poll(step, Millis(timeout_ms));
             }();
             return Take(std::move(r));
           })
      .def("commit",
           [](NativeManager& self, uint32_t step, bool ok, const std::string& state_hash) {
             Status st = [&] {
               py::gil_scoped_release release;
               return self.Commit(step, ok, state_hash);
             }();
             Check(st);
           })
      .def("finish",
           [](NativeManager& self) {
             Status st = [&] {
               py::gil_scoped_release release;
               return self.Finish();
             }();
             Check(st);
           })
      .def("set_peer_wait",
           [](NativeManager& self, bool waiting) {
             Status st = [&] {
               py::gil_scoped_release release;
               return self.SetPeerWait(waiting);
             }();
             Check(st);
           })
      .def("register_checkpoint",
           [](NativeManager& self, uint32_t step, const std::string& location,
              const std::string& digest) {
             Status st = [&] {
               py::gil_scoped_release release;
               return self.RegisterCheckpoint(step, location, digest);
             }();
             Check(st);
           })
      .def("kv_put",
           [](NativeManager& self, uint32_t quorum_id, const std::string& key, py::bytes value) {
             std::string v = value;
             Status st = [&] {
               py::gil_scoped_release release;
               return self.KvPut(quorum_id, key, v);
             }();
             Check(st);
           })
      .def("kv_get",
           [](NativeManager& self, uint32_t quorum_id, const std::string& key,
              uint32_t timeout_ms) {
             Result<std::string> r = [&] {
               py::gil_scoped_release release;
               return self.KvGet(quorum_id, key, Millis(timeout_ms));
             }();
             return py::bytes(Take(std::move(r)));
           })
      .def("allreduce",
           [](NativeManager& self, uintptr_t data, size_t count, const std::string& dtype,
              const std::string& op, int device) {
             comm::DType dt = ParseDType(dtype);
             comm::ReduceOp ro = ParseOp(op);
             Status st = [&] {
               py::gil_scoped_release release;
               return self.AllReduce(data, count, dt, ro, device);
             }();
             // A collective that a notice, a dead peer or its deadline cut short means the
             // quorum is gone: the trainer polls for the next one and retries.
             const bool lost = st.code() == Code::kAborted ||
                               st.code() == Code::kDeadlineExceeded ||
                               st.code() == Code::kUnavailable;
             if (!st.ok()) Raise(st, lost);
           })
      .def("abort", [](NativeManager& self, const std::string& reason) { self.Abort(reason); })
      .def("notices",
           [](const NativeManager& self) {
             lk::python::NoticeRecord n = self.notices();
             py::dict d;
             d["lost_quorum_id"] = n.lost_quorum_id;
             d["drain"] = n.drain;
             d["checkpoint_now"] = n.checkpoint_now;
             d["reason"] = n.reason;
             return d;
           })
      .def_property_readonly("quorum_id", &NativeManager::quorum_id)
      .def_property_readonly("group_rank", &NativeManager::group_rank)
      .def_property_readonly("group_size", &NativeManager::group_size)
      .def_property_readonly("socket", &NativeManager::socket);
}

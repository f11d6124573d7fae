// kvtier._inproc: the worker engine (worker::Engine) inside a Python process,
// its rounds in a remote kvtier-store (client/store_segments.h). The Python
// side is kvtier/inproc.py; this module only moves arrays and statuses.
// Every engine call releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/store_client.h"
#include "client/store_segments.h"
#include "encoded/encode.h"
#include "kvtier/v1/worker.pb.h"
#include "rpc/policy_proto.h"
#include "worker/engine.h"

namespace py = pybind11;

namespace kvtier {
namespace {

using Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

// Raises kvtier._inproc.Error("CODE_NAME", message) for a failed status.
PyObject* g_error = nullptr;

[[noreturn]] void Raise(const absl::Status& s) {
  py::tuple args = py::make_tuple(absl::StatusCodeToString(s.code()), std::string(s.message()));
  PyErr_SetObject(g_error, args.ptr());
  throw py::error_already_set();
}

template <typename T>
T Check(absl::StatusOr<T> s) {
  if (!s.ok()) Raise(s.status());
  return *std::move(s);
}

void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}

const float* Rows(const Array& a, int64_t n, int heads, int d, const char* what) {
  if (a.ndim() != 3 || a.shape(0) != n || a.shape(1) != heads || a.shape(2) != d) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat(what, ": expected shape [", n, ", ", heads, ", ", d, "]")));
  }
  return a.data();
}

class InProcessEngine {
 public:
  InProcessEngine(const std::string& store, const std::string& token, bool host_only) {
    StoreClientOptions so;
    so.target = store;
    so.token = token;
    auto client = Check(StoreClient::Connect(so));
    segments_ = std::make_unique<StoreSegments>(std::move(client));
    worker::EngineOptions o;
    if (host_only) o.placement = worker::EngineOptions::Placement::kHost;
    engine_ = std::make_unique<worker::Engine>(segments_.get(), o);
  }

  std::string PutSkew(const py::bytes& data) {
    std::string bytes = data;
    py::gil_scoped_release nogil;
    return Check(engine_->skews().Put(bytes));
  }

  // Opens a session from a serialized ModelSpec and Policy; returns the
  // serialized effective Policy.
  py::bytes Open(const std::string& id, const py::bytes& spec_bytes,
                 const py::bytes& policy_bytes) {
    v1::ModelSpec spec;
    v1::Policy policy;
    if (!spec.ParseFromString(std::string(spec_bytes)) ||
        !policy.ParseFromString(std::string(policy_bytes))) {
      Raise(absl::InvalidArgumentError("a ModelSpec or Policy that does not parse"));
    }
    const worker::ModelShape shape = Check(ShapeFromProto(spec));
    const worker::SessionPolicy p = Check(PolicyFromProto(policy, FromProto(spec.dtype())));
    worker::SessionPolicy eff;
    {
      py::gil_scoped_release nogil;
      Check(engine_->OpenSession(worker::SessionKey(id), shape, p));
      eff = Check(engine_->Stats(worker::SessionKey(id))).policy;
    }
    return py::bytes(EffectivePolicy(policy, eff).SerializeAsString());
  }

  // (out [n, q_heads, d], serialized RecallDecision or None).
  py::tuple Prefill(const std::string& id, int layer, const Array& q, const Array& k,
                    const Array& v, int64_t question_tokens) {
    const worker::ModelShape shape = Check(engine_->Shape(worker::SessionKey(id)));
    const int64_t n = q.ndim() == 3 ? q.shape(0) : 0;
    const float* qp = Rows(q, n, shape.q_heads, shape.head_dim, "q");
    const float* kp = Rows(k, n, shape.kv_heads, shape.head_dim, "k");
    const float* vp = Rows(v, n, shape.kv_heads, shape.head_dim, "v");
    Array out({n, static_cast<int64_t>(shape.q_heads), static_cast<int64_t>(shape.head_dim)});
    float* op = out.mutable_data();
    std::optional<worker::RecallReport> r;
    {
      py::gil_scoped_release nogil;
      r = Check(
          engine_->PrefillLayer(worker::SessionKey(id), layer, n, question_tokens, qp, kp, vp, op));
    }
    if (!r.has_value()) return py::make_tuple(out, py::none());
    return py::make_tuple(out, py::bytes(RecallToProto(*r).SerializeAsString()));
  }

  Array Decode(const std::string& id, int layer, const Array& q, const Array& k, const Array& v,
               const std::optional<Array>& q_next) {
    const worker::ModelShape shape = Check(engine_->Shape(worker::SessionKey(id)));
    const float* qp = Rows(q, 1, shape.q_heads, shape.head_dim, "q");
    const float* kp = Rows(k, 1, shape.kv_heads, shape.head_dim, "k");
    const float* vp = Rows(v, 1, shape.kv_heads, shape.head_dim, "v");
    const float* qn =
        q_next.has_value() ? Rows(*q_next, 1, shape.q_heads, shape.head_dim, "q_next") : nullptr;
    Array out(
        {int64_t{1}, static_cast<int64_t>(shape.q_heads), static_cast<int64_t>(shape.head_dim)});
    float* op = out.mutable_data();
    {
      py::gil_scoped_release nogil;
      Check(engine_->DecodeLayer(worker::SessionKey(id), layer, qp, kp, vp, op, qn));
    }
    return out;
  }

  void AbortStep(const std::string& id) {
    py::gil_scoped_release nogil;
    Check(engine_->AbortStep(worker::SessionKey(id)));
  }

  // A serialized EndRoundResponse, as kvtier-worker answers it.
  py::bytes EndRound(const std::string& id) {
    worker::EndRoundReport r;
    {
      py::gil_scoped_release nogil;
      r = Check(engine_->EndRound(worker::SessionKey(id)));
    }
    return py::bytes(EndRoundToProto(r).SerializeAsString());
  }

  void Close(const std::string& id, bool delete_from_store) {
    py::gil_scoped_release nogil;
    Check(engine_->CloseSession(worker::SessionKey(id), delete_from_store));
  }

 private:
  std::unique_ptr<StoreSegments> segments_;
  std::unique_ptr<worker::Engine> engine_;
};

}  // namespace
}  // namespace kvtier

PYBIND11_MODULE(_inproc, m) {
  m.doc() = "The kvtier worker engine in process (use kvtier.inproc).";
  static py::exception<std::exception> error(m, "Error");
  kvtier::g_error = error.ptr();
  py::class_<kvtier::InProcessEngine>(m, "Engine")
      .def(py::init<const std::string&, const std::string&, bool>(), py::arg("store"),
           py::arg("token") = "", py::arg("host_only") = true)
      .def("put_skew", &kvtier::InProcessEngine::PutSkew)
      .def("open", &kvtier::InProcessEngine::Open)
      .def("prefill", &kvtier::InProcessEngine::Prefill)
      .def("decode", &kvtier::InProcessEngine::Decode, py::arg("id"), py::arg("layer"),
           py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_next") = py::none())
      .def("abort_step", &kvtier::InProcessEngine::AbortStep)
      .def("end_round", &kvtier::InProcessEngine::EndRound)
      .def("close", &kvtier::InProcessEngine::Close);
}

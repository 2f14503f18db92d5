// slots_dense: the check that lets a fused optimizer's step pass its per-param tensors to an op as
// they are (mp_wrappers/optim/base.py, Note [collect in one pass]). Its pure-Python twin, with the
// same answers, is mp_wrappers/ops/reference/slots.py.
//
// Why C++: reading one attribute of a tensor from Python costs 50-90 ns (a descriptor call and an
// object for .device or .shape); a param of Adam has four tensors with four properties each, which
// made the per-param Python of a step cost ~1.4x torch's own on an H100's host. Here each check is
// a field read.
#include "mp_wrappers/slot_check.h"

#include <stdexcept>
#include <vector>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace mp_wrappers {
namespace {

// The borrowed items of a Python list (valid while the caller's lists live: nothing here runs Python
// that could change them); std::invalid_argument, a ValueError in Python, for anything else.
std::vector<PyObject*> items(PyObject* list, const char* what) {
  if (!PyList_Check(list)) {
    throw std::invalid_argument(std::string("slots_dense: ") + what + " must be a list");
  }
  const Py_ssize_t n = PyList_GET_SIZE(list);
  std::vector<PyObject*> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = PyList_GET_ITEM(list, i);
  return out;
}

// A plain strided, contiguous tensor (a sparse or nested one, or a non-tensor, is not).
const at::Tensor* dense(PyObject* obj) {
  if (!THPVariable_Check(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.layout() != at::kStrided || !t.is_contiguous()) return nullptr;
  return &t;
}

// Every tensor of a list is dense, of its row's target's sizes, on the targets' device and of one
// dtype, a floating-point one when `floating`.
bool column(const std::vector<PyObject*>& objs, const std::vector<const at::Tensor*>& refs,
            bool floating) {
  const at::Tensor* first = nullptr;
  for (size_t i = 0; i < objs.size(); ++i) {
    const at::Tensor* t = dense(objs[i]);
    if (t == nullptr || t->sizes() != refs[i]->sizes() || t->device() != refs[0]->device()) {
      return false;
    }
    if (first == nullptr) {
      first = t;
      if (floating && !at::isFloatingType(t->scalar_type())) return false;
    } else if (t->scalar_type() != first->scalar_type()) {
      return false;
    }
  }
  return true;
}

}  // namespace

// True when, for n slots:
//   * targets: n dense tensors of one device and one dtype;
//   * grads: n dense floating-point tensors of one dtype, on that device, each of its target's sizes;
//   * models: empty, or as grads (one floating-point dtype, the targets' device and sizes);
//   * states[k]: n dense tensors, each of its target's sizes, of a dtype in allowed[k] (a state that
//     is None, missing, or of another dtype fails: the caller then asks about it exactly).
// False otherwise; the caller then collects the slots one by one, which raises the errors that name
// a param. State tensors' devices are left to the op's own checks, as in the one-by-one collection.
bool slots_dense(PyObject* targets, PyObject* grads, PyObject* models, PyObject* states,
                 PyObject* allowed) {
  // Every argument is checked before any answer, as the reference does.
  const std::vector<PyObject*> ts = items(targets, "targets");
  const std::vector<PyObject*> gs = items(grads, "grads");
  const std::vector<PyObject*> ms = items(models, "models");
  const std::vector<PyObject*> ss = items(states, "states");
  if (!PyTuple_Check(allowed) || PyTuple_GET_SIZE(allowed) != static_cast<Py_ssize_t>(ss.size())) {
    throw std::invalid_argument("slots_dense: allowed must be a tuple with one entry per state list");
  }
  std::vector<std::vector<at::ScalarType>> ok(ss.size());
  for (size_t k = 0; k < ss.size(); ++k) {
    PyObject* dtypes = PyTuple_GET_ITEM(allowed, static_cast<Py_ssize_t>(k));
    if (!PyTuple_Check(dtypes)) {
      throw std::invalid_argument("slots_dense: allowed[k] must be a tuple of torch.dtype");
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(dtypes); ++j) {
      PyObject* d = PyTuple_GET_ITEM(dtypes, j);
      if (!THPDtype_Check(d)) {
        throw std::invalid_argument("slots_dense: allowed[k] must be a tuple of torch.dtype");
      }
      ok[k].push_back(reinterpret_cast<THPDtype*>(d)->scalar_type);
    }
  }
  std::vector<std::vector<PyObject*>> cols;
  for (PyObject* col : ss) cols.push_back(items(col, "states[k]"));

  const size_t n = ts.size();
  if (gs.size() != n || (!ms.empty() && ms.size() != n)) return false;
  if (n == 0) return true;
  std::vector<const at::Tensor*> refs(n);
  for (size_t i = 0; i < n; ++i) {
    refs[i] = dense(ts[i]);
    if (refs[i] == nullptr || refs[i]->device() != refs[0]->device() ||
        refs[i]->scalar_type() != refs[0]->scalar_type()) {
      return false;
    }
  }
  if (!column(gs, refs, true)) return false;
  if (!ms.empty() && !column(ms, refs, true)) return false;
  for (size_t k = 0; k < cols.size(); ++k) {
    if (cols[k].size() != n) return false;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor* t = dense(cols[k][i]);
      if (t == nullptr || t->sizes() != refs[i]->sizes()) return false;
      bool found = false;
      for (at::ScalarType s : ok[k]) found = found || s == t->scalar_type();
      if (!found) return false;
    }
  }
  return true;
}

}  // namespace mp_wrappers

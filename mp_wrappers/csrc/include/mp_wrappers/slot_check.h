// The one host-side check of a fused optimizer step's lists, done in C++ so that the Python
// collecting them per param (mp_wrappers/optim/base.py, Note [collect in one pass]) need not read
// each tensor's attributes itself.
#pragma once

#include <Python.h>

namespace mp_wrappers {

// Whether the lists of one op call can be passed as they are: see slots_dense in slot_check.cpp.
// Arguments are Python objects (borrowed): lists of tensors, a list of lists of state tensors (or
// None), and a tuple holding, for each state list, a tuple of the torch.dtype objects it may hold.
// It answers for any tensors; it raises (std::invalid_argument, a ValueError in Python) only for
// arguments of other Python types.
bool slots_dense(PyObject* targets, PyObject* grads, PyObject* models, PyObject* states,
                 PyObject* allowed);

}  // namespace mp_wrappers

// cgcompile._address_check: are these tensors' data pointers the ones a captured graph recorded?
//
// A replay reads its parameters, borrowed and in-place inputs at the addresses recorded at capture, so every
// replay checks them. One Python-level data_ptr() per tensor costs more than the rest of a replay for a partition
// taking a hundred parameters; CUDA builds of torch have one call for it (torch._C._tensors_data_ptrs_at_indices_equal,
// pybind casts per argument), CPU builds none. This module is that one call for any build. It needs no torch
// headers: the data pointer of a plain Tensor or Parameter is read through the C function torch exports for
// Inductor's own C++ kernel bindings (its address is handed over by cgcompile/_compat/__init__.py, which checks it
// exists); any other object (a tensor subclass) is asked through its Python data_ptr() method.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

namespace {

using DataPtrReader = void* (*)(PyObject*);

DataPtrReader read_data_ptr = nullptr;
PyTypeObject* plain_types[2] = {nullptr, nullptr};  // torch.Tensor, torch.nn.Parameter: what the reader takes

// setup(reader_address: int, tensor_type: type, parameter_type: type) -> None
PyObject* setup(PyObject*, PyObject* args) {
    unsigned long long address = 0;
    PyObject* tensor_type = nullptr;
    PyObject* parameter_type = nullptr;
    if (!PyArg_ParseTuple(args, "KO!O!", &address, &PyType_Type, &tensor_type, &PyType_Type, &parameter_type)) {
        return nullptr;
    }
    Py_INCREF(tensor_type);
    Py_INCREF(parameter_type);
    plain_types[0] = reinterpret_cast<PyTypeObject*>(tensor_type);
    plain_types[1] = reinterpret_cast<PyTypeObject*>(parameter_type);
    read_data_ptr = reinterpret_cast<DataPtrReader>(static_cast<uintptr_t>(address));
    Py_RETURN_NONE;
}

// The data pointer of obj in *out; false with a Python error set when it has none.
bool data_ptr_of(PyObject* obj, uintptr_t* out) {
    PyTypeObject* type = Py_TYPE(obj);
    if (read_data_ptr != nullptr && (type == plain_types[0] || type == plain_types[1])) {
        try {
            *out = reinterpret_cast<uintptr_t>(read_data_ptr(obj));
            return true;
        } catch (...) {
            // e.g. a tensor without storage: the Python method raises the proper error below
        }
    }
    PyObject* ptr = PyObject_CallMethod(obj, "data_ptr", nullptr);
    if (ptr == nullptr) {
        return false;
    }
    *out = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(ptr));
    Py_DECREF(ptr);
    return !PyErr_Occurred();
}

// The addresses one graph expects: n pairs (argument position, data pointer), held in a capsule.
struct Expected {
    Py_ssize_t count;
    Py_ssize_t* indices;
    uintptr_t* ptrs;
};

void release(Expected* expected) {
    PyMem_Free(expected->indices);
    PyMem_Free(expected->ptrs);
    PyMem_Free(expected);
}

void free_expected(PyObject* capsule) {
    auto* expected = static_cast<Expected*>(PyCapsule_GetPointer(capsule, nullptr));
    if (expected != nullptr) {
        release(expected);
    }
}

// prepare(indices: tuple[int, ...], ptrs: tuple[int, ...]) -> capsule: converted once, not on every check
PyObject* prepare(PyObject*, PyObject* args) {
    PyObject* indices = nullptr;
    PyObject* ptrs = nullptr;
    if (!PyArg_ParseTuple(args, "O!O!", &PyTuple_Type, &indices, &PyTuple_Type, &ptrs)) {
        return nullptr;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(indices);
    if (PyTuple_GET_SIZE(ptrs) != count) {
        PyErr_SetString(PyExc_ValueError, "prepare: indices and ptrs differ in length");
        return nullptr;
    }
    auto* expected = static_cast<Expected*>(PyMem_Malloc(sizeof(Expected)));
    if (expected == nullptr) {
        return PyErr_NoMemory();
    }
    expected->count = count;
    expected->indices = static_cast<Py_ssize_t*>(PyMem_Malloc(sizeof(Py_ssize_t) * (count ? count : 1)));
    expected->ptrs = static_cast<uintptr_t*>(PyMem_Malloc(sizeof(uintptr_t) * (count ? count : 1)));
    if (expected->indices == nullptr || expected->ptrs == nullptr) {
        release(expected);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < count; ++k) {
        expected->indices[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(indices, k));
        expected->ptrs[k] = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ptrs, k)));
        if (PyErr_Occurred() || expected->indices[k] < 0) {
            release(expected);
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "prepare: a negative index");
            }
            return nullptr;
        }
    }
    PyObject* capsule = PyCapsule_New(expected, nullptr, free_expected);
    if (capsule == nullptr) {
        release(expected);
    }
    return capsule;
}

// equal(prepared: capsule, args: list | tuple) -> bool (prepared first, so functools.partial can bind it)
// Is args[indices[k]].data_ptr() == ptrs[k] for every k? False as soon as one differs.
PyObject* equal(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
    if (nargs != 2 || !PyCapsule_CheckExact(argv[0]) || !(PyList_Check(argv[1]) || PyTuple_Check(argv[1]))) {
        PyErr_SetString(PyExc_TypeError, "equal(prepared: the capsule prepare() made, args: list | tuple)");
        return nullptr;
    }
    auto* expected = static_cast<Expected*>(PyCapsule_GetPointer(argv[0], nullptr));
    if (expected == nullptr) {
        return nullptr;
    }
    PyObject* sequence = argv[1];
    Py_ssize_t size = PySequence_Fast_GET_SIZE(sequence);
    PyObject** items = PySequence_Fast_ITEMS(sequence);
    for (Py_ssize_t k = 0; k < expected->count; ++k) {
        Py_ssize_t index = expected->indices[k];
        if (index >= size) {
            Py_RETURN_FALSE;
        }
        uintptr_t found = 0;
        if (!data_ptr_of(items[index], &found)) {
            return nullptr;
        }
        if (found != expected->ptrs[k]) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, "setup(reader_address, tensor_type, parameter_type): where to read data pointers"},
    {"prepare", prepare, METH_VARARGS, "prepare(indices, ptrs) -> capsule: the addresses a graph expects"},
    {"equal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(equal)), METH_FASTCALL,
     "equal(prepared, args) -> bool: args[indices[k]].data_ptr() == ptrs[k] for every k"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_address_check", "One call that checks many tensors' data pointers.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__address_check(void) { return PyModule_Create(&module); }

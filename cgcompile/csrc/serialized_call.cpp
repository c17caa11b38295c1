// cgcompile._serialized_call: a compiled frame's calls, one at a time, in C.
//
// A frame's graphs, their static buffers and the runtime's bookkeeping are one model's state: two threads calling
// the same compiled frame at once would replay a graph while another thread's replay is still reading or copying
// out of its memory. `SerializedCall(call, lock, runtime)` calls `call` holding `lock` (the runtime's
// threading.RLock, which its backward graphs take too), released however the call ends. It is C so that a steady
// decode step, a frame Dynamo calls and one C replay (steady_replay.cpp), stays free of cgcompile's Python:
// RLock's acquire and release are C as well, and acquire waits with the GIL released.
#include "callable_type.h"

namespace {

struct SerializedCall {
    PyObject_HEAD
    PyObject* call;     // the frame's function
    PyObject* acquire;  // lock.acquire, lock.release: bound once
    PyObject* release;
    PyObject* runtime;  // its ModelRuntime, for tests and tools (`.runtime`, as on an unwrapped frame function)
};

// release(), keeping the error the call raised (if any) as the one raised
PyObject* released(SerializedCall* self, PyObject* result) {
    PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
    if (result == nullptr) {
        PyErr_Fetch(&type, &value, &traceback);
    }
    PyObject* done = PyObject_CallNoArgs(self->release);
    if (done == nullptr) {
        Py_XDECREF(result);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return nullptr;
    }
    Py_DECREF(done);
    if (result == nullptr) {
        PyErr_Restore(type, value, traceback);
    }
    return result;
}

PyObject* call(PyObject* object, PyObject* args, PyObject* kwargs) {
    auto* self = reinterpret_cast<SerializedCall*>(object);
    if (self->call == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "SerializedCall: not initialised");
        return nullptr;
    }
    PyObject* taken = PyObject_CallNoArgs(self->acquire);
    if (taken == nullptr) {
        return nullptr;
    }
    Py_DECREF(taken);
    PyObject* held = self->call;
    Py_INCREF(held);  // the call may drop the last other reference to the frame
    PyObject* result = PyObject_Call(held, args, kwargs);
    Py_DECREF(held);
    return released(self, result);
}

int init(PyObject* object, PyObject* args, PyObject* kwargs) {
    auto* self = reinterpret_cast<SerializedCall*>(object);
    static const char* keywords[] = {"call", "lock", "runtime", nullptr};
    PyObject *function = nullptr, *lock = nullptr, *runtime = nullptr;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO", const_cast<char**>(keywords), &function, &lock,
                                     &runtime)) {
        return -1;
    }
    if (!PyCallable_Check(function)) {
        PyErr_SetString(PyExc_TypeError, "SerializedCall: call must be callable");
        return -1;
    }
    PyObject* acquire = PyObject_GetAttrString(lock, "acquire");
    if (acquire == nullptr) {
        return -1;
    }
    PyObject* release = PyObject_GetAttrString(lock, "release");
    if (release == nullptr) {
        Py_DECREF(acquire);
        return -1;
    }
    Py_INCREF(function);
    Py_INCREF(runtime);
    Py_XSETREF(self->call, function);
    Py_XSETREF(self->acquire, acquire);
    Py_XSETREF(self->release, release);
    Py_XSETREF(self->runtime, runtime);
    return 0;
}

PyObject* make(PyTypeObject* type, PyObject*, PyObject*) {
    return type->tp_alloc(type, 0);
}

int traverse(PyObject* object, visitproc visit, void* arg) {
    auto* self = reinterpret_cast<SerializedCall*>(object);
    Py_VISIT(self->call);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->runtime);
    return 0;
}

int clear(PyObject* object) {
    auto* self = reinterpret_cast<SerializedCall*>(object);
    Py_CLEAR(self->call);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->runtime);
    return 0;
}

void dealloc(PyObject* object) {
    PyObject_GC_UnTrack(object);
    clear(object);
    Py_TYPE(object)->tp_free(object);
}

PyObject* get_call(PyObject* object, void*) {
    return new_reference(reinterpret_cast<SerializedCall*>(object)->call);
}

PyObject* get_runtime(PyObject* object, void*) {
    return new_reference(reinterpret_cast<SerializedCall*>(object)->runtime);
}

PyMethodDef type_methods[] = {{nullptr, nullptr, 0, nullptr}};

PyGetSetDef type_getset[] = {
    {"call", get_call, nullptr, "the frame's function it calls holding the lock", nullptr},
    {"runtime", get_runtime, nullptr, "the frame's ModelRuntime", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject serialized_call_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_serialized_call", "A compiled frame's calls, one at a time, in C.",
                      -1, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__serialized_call(void) {
    CallableSlots type = {"cgcompile._serialized_call.SerializedCall",
                          "SerializedCall(call, lock, runtime): call it as the frame's function",
                          sizeof(SerializedCall), make, init, dealloc, traverse, clear, call, type_methods,
                          type_getset};
    return module_with_callable(&module, &serialized_call_type, type, "SerializedCall");
}

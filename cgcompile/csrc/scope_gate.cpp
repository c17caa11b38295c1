// cgcompile._scope_gate: a compiled frame's scope look-up (cgcompile/scope.py's ScopedFrame), in C.
//
// Dynamo calls a frame's function on every step. ScopedFrame, that function for a model whose layers may switch
// capture scope (transition_cudagraph_scope), picks the compiled frame of the scope its parameters are in: while no
// transition happened since its last look-up (the scopes' generation) and the probed parameter is the same object,
// that is the frame it found last. `ScopeGate(frame, scopes, probe)` is that check in one C call: the frame it
// calls is the one ScopedFrame last found (`follow`, which ScopedFrame calls after each look-up); any other call
// goes to ScopedFrame itself, which looks the scope up and tells the gate.
#include "callable_type.h"

#include <cstdint>

namespace {

PyObject* name_generation = nullptr;

struct ScopeGate {
    PyObject_HEAD
    PyObject* frame;    // the ScopedFrame: its Python look-up
    PyObject* scopes;   // .generation: bumped by every scope transition
    Py_ssize_t probe;   // the argument whose identity picks the scope; -1: none
    PyObject* current;  // the frame ScopedFrame found last, or nullptr before its first look-up
    long long generation;
    uintptr_t probed;   // id() of the probed argument at that look-up (0 without a probe)
};

PyObject* call(PyObject* object, PyObject* args, PyObject* kwargs) {
    auto* self = reinterpret_cast<ScopeGate*>(object);
    PyObject* current = self->current;
    if (current == nullptr || self->frame == nullptr) {
        return self->frame == nullptr ? nullptr : PyObject_Call(self->frame, args, kwargs);
    }
    uintptr_t probed = 0;
    if (self->probe >= 0) {
        if (self->probe >= PyTuple_GET_SIZE(args)) {
            return PyObject_Call(self->frame, args, kwargs);  // raises what the look-up raises
        }
        probed = reinterpret_cast<uintptr_t>(PyTuple_GET_ITEM(args, self->probe));
    }
    if (probed != self->probed) {
        return PyObject_Call(self->frame, args, kwargs);
    }
    long long now = 0;
    if (long_attribute(self->scopes, name_generation, &now) < 0) {
        return nullptr;
    }
    if (now != self->generation) {
        return PyObject_Call(self->frame, args, kwargs);
    }
    Py_INCREF(current);  // held while it runs: a look-up it triggers may make the gate follow another frame
    PyObject* result = PyObject_Call(current, args, kwargs);
    Py_DECREF(current);
    return result;
}

// follow(generation, probed, current) -> None: what ScopedFrame's last look-up found
PyObject* follow(PyObject* object, PyObject* args) {
    auto* self = reinterpret_cast<ScopeGate*>(object);
    long long generation = 0;
    unsigned long long probed = 0;
    PyObject* current = nullptr;
    if (!PyArg_ParseTuple(args, "LKO", &generation, &probed, &current)) {
        return nullptr;
    }
    if (!PyCallable_Check(current)) {
        PyErr_SetString(PyExc_TypeError, "follow: the frame must be callable");
        return nullptr;
    }
    Py_INCREF(current);
    Py_XSETREF(self->current, current);
    self->generation = generation;
    self->probed = static_cast<uintptr_t>(probed);
    Py_RETURN_NONE;
}

int init(PyObject* object, PyObject* args, PyObject* kwargs) {
    auto* self = reinterpret_cast<ScopeGate*>(object);
    static const char* keywords[] = {"frame", "scopes", "probe", nullptr};
    PyObject *frame = nullptr, *scopes = nullptr;
    Py_ssize_t probe = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOn", const_cast<char**>(keywords), &frame, &scopes, &probe)) {
        return -1;
    }
    Py_INCREF(frame);
    Py_INCREF(scopes);
    Py_XSETREF(self->frame, frame);
    Py_XSETREF(self->scopes, scopes);
    Py_CLEAR(self->current);
    self->probe = probe;
    return 0;
}

PyObject* make(PyTypeObject* type, PyObject*, PyObject*) {
    auto* self = reinterpret_cast<ScopeGate*>(type->tp_alloc(type, 0));
    if (self != nullptr) {
        self->probe = -1;
    }
    return reinterpret_cast<PyObject*>(self);
}

int traverse(PyObject* object, visitproc visit, void* arg) {
    auto* self = reinterpret_cast<ScopeGate*>(object);
    Py_VISIT(self->frame);
    Py_VISIT(self->scopes);
    Py_VISIT(self->current);
    return 0;
}

int clear(PyObject* object) {
    auto* self = reinterpret_cast<ScopeGate*>(object);
    Py_CLEAR(self->frame);
    Py_CLEAR(self->scopes);
    Py_CLEAR(self->current);
    return 0;
}

void dealloc(PyObject* object) {
    PyObject_GC_UnTrack(object);
    clear(object);
    Py_TYPE(object)->tp_free(object);
}

PyObject* get_current(PyObject* object, void*) {
    return new_reference(reinterpret_cast<ScopeGate*>(object)->current);
}

PyObject* get_frame(PyObject* object, void*) {
    return new_reference(reinterpret_cast<ScopeGate*>(object)->frame);
}

PyMethodDef type_methods[] = {
    {"follow", follow, METH_VARARGS,
     "follow(generation, probed, current): the frame ScopedFrame's last look-up found, at that generation, for the "
     "probed argument's id()"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef type_getset[] = {
    {"current", get_current, nullptr, "the frame the gate calls while nothing changed", nullptr},
    {"frame", get_frame, nullptr, "the ScopedFrame it stands in front of", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject scope_gate_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scope_gate", "A compiled frame's scope look-up, in C.", -1,
                      nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__scope_gate(void) {
    name_generation = PyUnicode_InternFromString("generation");
    if (name_generation == nullptr) {
        return nullptr;
    }
    CallableSlots type = {"cgcompile._scope_gate.ScopeGate",
                          "ScopeGate(frame, scopes, probe): call it as the frame's function", sizeof(ScopeGate),
                          make, init, dealloc, traverse, clear, call, type_methods, type_getset};
    return module_with_callable(&module, &scope_gate_type, type, "ScopeGate");
}

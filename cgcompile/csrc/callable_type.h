// The one Python type each of cgcompile's compiled host-path helpers defines (steady_replay.cpp, scope_gate.cpp):
// a callable object that holds Python references (so the cycle collector must see them), made into a module; and
// the per-call read of a Python object's integer counter that both compare with the one they were given.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

struct CallableSlots {
    const char* name;  // qualified: "cgcompile._module.Type"
    const char* doc;
    Py_ssize_t size;
    newfunc make;
    initproc init;
    destructor dealloc;
    traverseproc traverse;
    inquiry clear;
    ternaryfunc call;
    PyMethodDef* methods;
    PyGetSetDef* getset;
};

// A new reference to a field the object holds, for its getters: None while it holds nothing.
inline PyObject* new_reference(PyObject* held) {
    if (held == nullptr) {
        Py_RETURN_NONE;
    }
    Py_INCREF(held);
    return held;
}

// `object.<name>`, an int, into *value: 0, or -1 with the error set (the attribute missing or not an int).
inline int long_attribute(PyObject* object, PyObject* name, long long* value) {
    PyObject* found = PyObject_GetAttr(object, name);
    if (found == nullptr) {
        return -1;
    }
    *value = PyLong_AsLongLong(found);
    Py_DECREF(found);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

// `module` with `type`, filled from `slots` and readied, added under `attribute`: the module, or nullptr with the
// error set.
inline PyObject* module_with_callable(PyModuleDef* module, PyTypeObject* type, const CallableSlots& slots,
                                      const char* attribute) {
    type->tp_name = slots.name;
    type->tp_doc = slots.doc;
    type->tp_basicsize = slots.size;
    type->tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
    type->tp_new = slots.make;
    type->tp_init = slots.init;
    type->tp_dealloc = slots.dealloc;
    type->tp_traverse = slots.traverse;
    type->tp_clear = slots.clear;
    type->tp_call = slots.call;
    type->tp_methods = slots.methods;
    type->tp_getset = slots.getset;
    if (PyType_Ready(type) < 0) {
        return nullptr;
    }
    PyObject* made = PyModule_Create(module);
    if (made == nullptr) {
        return nullptr;
    }
    Py_INCREF(type);
    if (PyModule_AddObject(made, attribute, reinterpret_cast<PyObject*>(type)) < 0) {
        Py_DECREF(type);
        Py_DECREF(made);
        return nullptr;
    }
    return made;
}

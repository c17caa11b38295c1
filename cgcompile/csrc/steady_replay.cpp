// cgcompile._steady_replay: the steady copy-out replay of a frame that is one partition call, in one C call.
//
// A decode loop in block scope calls, step after step, a frame whose only work is one captured partition, and the
// frame's one output is copied out of graph memory as it leaves (PartitionRunner.leaving). The Python steady path
// (runtime/local/steady.py, runner.py) spends most of its host time running Python between a handful of calls into
// torch. This type makes that path one C call: `SteadyLeaving(args)` replays the entry armed for the call's
// parameter set when every condition the Python path would check holds, and otherwise calls the Python path
// (`runner.leaving(args)`), which then arms the entry again. It needs no torch headers: torch is reached through
// the Python callables `setup` is given (the mode reads, the input copy and the version bump cgcompile uses).
//
// An entry is armed by steady.py right after a Python steady copy-out replay of its record, with the memory
// registry's change count at that moment. A replay that copies its one output out hands nothing of the graph's
// memory out, so until anything else of that runtime replays, captures or discards a graph (each bumps the count),
// the graph's memory claim and the pool rule answer as they did then: the count stands for both. What can change
// between two steady calls with the count unchanged is checked on every call, as Python checks it: grad mode off,
// the inference mode armed, autocast off, no freed parameter pending, the fixed inputs' addresses. An entry may
// replay `limit` times before the Python path must count its replays (the bank policy's next judgement).
#include "callable_type.h"

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace {

// The callables every call reads: set once by setup().
PyObject* is_grad_enabled = nullptr;
PyObject* is_inference_mode_enabled = nullptr;
PyObject* any_autocast = nullptr;
PyObject* copy_all = nullptr;            // copy_all(destinations: list, sources: list)
PyObject* increment_versions = nullptr;  // increment_versions(tensors: tuple)
PyObject* clone = nullptr;               // torch.Tensor.clone, called unbound
PyObject* name_replay = nullptr;         // interned attribute and method names
PyObject* name_changes = nullptr;
PyObject* name_dead = nullptr;
PyObject* name_leaving = nullptr;

struct Entry {
    bool inference = false;            // the inference mode the record replays under (grad mode is always off)
    long long changes = 0;             // the memory registry's change count when armed
    Py_ssize_t replays = 0;            // replays since armed
    Py_ssize_t limit = 0;              // how many it may make before the Python path counts them
    Py_ssize_t needs = 0;              // the call must have more arguments than the highest position read
    PyObject* addresses_match = nullptr;  // addresses_match(args) -> bool
    PyObject* buffers = nullptr;       // the graph's copied-in input buffers (a list), or nullptr
    std::vector<Py_ssize_t> copied;    // the argument positions copied into them
    PyObject* captured = nullptr;      // the captured graph: replay() -> its static outputs
    std::vector<Py_ssize_t> bumped;    // argument positions whose version counters a call bumps

    Entry() = default;
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    ~Entry() {  // the GIL is held: entries are made and dropped by calls from Python
        Py_XDECREF(addresses_match);
        Py_XDECREF(buffers);
        Py_XDECREF(captured);
    }
};

// Shared: a call keeps its entry alive while the Python it calls (a replay) may disarm or arm it again.
using Entries = std::unordered_map<uintptr_t, std::shared_ptr<Entry>>;

struct SteadyLeaving {
    PyObject_HEAD
    PyObject* runner;    // the Python path: runner.leaving(args), looked up at each fall back
    PyObject* registry;  // .changes: the memory registry's change count
    PyObject* runtime;   // .dead: graphs whose parameters were freed, released at the next Python call
    Py_ssize_t index;    // the parameter set's argument position; -1: the partition has one set (key 0)
    unsigned long long fast_replays;  // every replay made here (for tests and benchmarks)
    Entries* entries;  // by parameter set key
};

PyObject* fall_back(SteadyLeaving* self, PyObject* args) {
    PyObject* leaving = PyObject_GetAttr(self->runner, name_leaving);
    if (leaving == nullptr) {
        return nullptr;
    }
    PyObject* result = PyObject_CallOneArg(leaving, args);
    Py_DECREF(leaving);
    return result;
}

// 1 when fn() returns `expected`, 0 when it returns the other bool, -1 on error.
int returns(PyObject* fn, PyObject* expected) {
    PyObject* got = PyObject_Vectorcall(fn, nullptr, 0, nullptr);
    if (got == nullptr) {
        return -1;
    }
    int same = got == expected;
    Py_DECREF(got);
    return same;
}

// 1 when every condition for a steady replay of `entry` holds, 0 when one does not, -1 on error.
int may_replay(SteadyLeaving* self, Entry& entry, PyObject* args) {
    if (entry.replays >= entry.limit || PyTuple_GET_SIZE(args) < entry.needs) {
        return 0;
    }
    int ok = returns(is_grad_enabled, Py_False);
    if (ok == 1) {
        ok = returns(is_inference_mode_enabled, entry.inference ? Py_True : Py_False);
    }
    if (ok == 1) {
        ok = returns(any_autocast, Py_False);
    }
    if (ok != 1) {
        return ok;
    }
    long long now = 0;
    if (long_attribute(self->registry, name_changes, &now) < 0) {
        return -1;
    }
    if (now != entry.changes) {
        return 0;
    }
    PyObject* dead = PyObject_GetAttr(self->runtime, name_dead);
    if (dead == nullptr) {
        return -1;
    }
    int none_dead = PyObject_Not(dead);
    Py_DECREF(dead);
    if (none_dead != 1) {
        return none_dead;
    }
    PyObject* match = PyObject_CallOneArg(entry.addresses_match, args);
    if (match == nullptr) {
        return -1;
    }
    int matched = PyObject_IsTrue(match);
    Py_DECREF(match);
    return matched;
}

PyObject* picked(PyObject* args, const std::vector<Py_ssize_t>& positions, bool as_list) {
    Py_ssize_t count = static_cast<Py_ssize_t>(positions.size());
    PyObject* out = as_list ? PyList_New(count) : PyTuple_New(count);
    if (out == nullptr) {
        return nullptr;
    }
    for (Py_ssize_t k = 0; k < count; ++k) {
        PyObject* item = PyTuple_GET_ITEM(args, positions[k]);
        Py_INCREF(item);
        if (as_list) {
            PyList_SET_ITEM(out, k, item);
        } else {
            PyTuple_SET_ITEM(out, k, item);
        }
    }
    return out;
}

// The replay itself: inputs copied in, the graph replayed, its one output copied out, the written inputs' versions
// bumped. Returns the frame's output tuple, or nullptr with the error the failing call raised.
PyObject* replay(Entry& entry, PyObject* args) {
    if (entry.buffers != nullptr) {
        PyObject* sources = picked(args, entry.copied, true);
        if (sources == nullptr) {
            return nullptr;
        }
        PyObject* copy_args[2] = {entry.buffers, sources};
        PyObject* done = PyObject_Vectorcall(copy_all, copy_args, 2, nullptr);
        Py_DECREF(sources);
        if (done == nullptr) {
            return nullptr;
        }
        Py_DECREF(done);
    }
    PyObject* outputs = PyObject_CallMethodNoArgs(entry.captured, name_replay);
    if (outputs == nullptr) {
        return nullptr;
    }
    PyObject* first = PySequence_GetItem(outputs, 0);
    Py_DECREF(outputs);
    if (first == nullptr) {
        return nullptr;
    }
    PyObject* copy = PyObject_CallOneArg(clone, first);
    Py_DECREF(first);
    if (copy == nullptr) {
        return nullptr;
    }
    if (!entry.bumped.empty()) {
        PyObject* written = picked(args, entry.bumped, false);
        PyObject* bumped = written == nullptr ? nullptr : PyObject_CallOneArg(increment_versions, written);
        Py_XDECREF(written);
        if (bumped == nullptr) {
            Py_DECREF(copy);
            return nullptr;
        }
        Py_DECREF(bumped);
    }
    PyObject* result = PyTuple_Pack(1, copy);
    Py_DECREF(copy);
    return result;
}

PyObject* call(PyObject* object, PyObject* args, PyObject* kwargs) {
    auto* self = reinterpret_cast<SteadyLeaving*>(object);
    if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "SteadyLeaving takes the frame's arguments by position only");
        return nullptr;
    }
    if (self->entries->empty()) {
        return fall_back(self, args);
    }
    uintptr_t key = 0;
    if (self->index >= 0) {
        if (self->index >= PyTuple_GET_SIZE(args)) {
            return fall_back(self, args);
        }
        key = reinterpret_cast<uintptr_t>(PyTuple_GET_ITEM(args, self->index));  // id(): the set's parameter
    }
    auto found = self->entries->find(key);
    if (found == self->entries->end()) {
        return fall_back(self, args);
    }
    std::shared_ptr<Entry> held = found->second;
    Entry& entry = *held;
    int ok = may_replay(self, entry, args);
    if (ok < 0) {
        return nullptr;
    }
    if (ok == 0) {
        return fall_back(self, args);
    }
    PyObject* result = replay(entry, args);
    if (result != nullptr) {
        entry.replays += 1;
        self->fast_replays += 1;
    }
    return result;
}

Py_ssize_t highest(const std::vector<Py_ssize_t>& positions) {
    Py_ssize_t top = -1;
    for (Py_ssize_t p : positions) {
        top = p > top ? p : top;
    }
    return top;
}

bool positions_of(PyObject* tuple, std::vector<Py_ssize_t>* out) {
    Py_ssize_t count = PyTuple_GET_SIZE(tuple);
    out->reserve(count);
    for (Py_ssize_t k = 0; k < count; ++k) {
        Py_ssize_t position = PyLong_AsSsize_t(PyTuple_GET_ITEM(tuple, k));
        if (position < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "arm: a negative argument position");
            }
            return false;
        }
        out->push_back(position);
    }
    return true;
}

// arm(index, key, inference, changes, limit, addresses_match, buffers, copied, captured, bumped) -> None
PyObject* arm(PyObject* object, PyObject* args) {
    auto* self = reinterpret_cast<SteadyLeaving*>(object);
    Py_ssize_t index = 0, limit = 0;
    unsigned long long key = 0;
    int inference = 0;
    long long changes = 0;
    PyObject *addresses_match = nullptr, *buffers = nullptr, *copied = nullptr, *captured = nullptr,
             *bumped = nullptr;
    if (!PyArg_ParseTuple(args, "nKpLnOOO!OO!", &index, &key, &inference, &changes, &limit, &addresses_match,
                          &buffers, &PyTuple_Type, &copied, &captured, &PyTuple_Type, &bumped)) {
        return nullptr;
    }
    if (buffers != Py_None && !PyList_Check(buffers)) {
        PyErr_SetString(PyExc_TypeError, "arm: buffers must be a list or None");
        return nullptr;
    }
    auto made = std::make_shared<Entry>();
    Entry& entry = *made;
    if (!positions_of(copied, &entry.copied) || !positions_of(bumped, &entry.bumped)) {
        return nullptr;
    }
    if ((buffers == Py_None) != entry.copied.empty()
        || (buffers != Py_None && PyList_GET_SIZE(buffers) != static_cast<Py_ssize_t>(entry.copied.size()))) {
        PyErr_SetString(PyExc_ValueError, "arm: one buffer per copied position");
        return nullptr;
    }
    entry.inference = inference != 0;
    entry.changes = changes;
    entry.limit = limit;
    Py_ssize_t top = highest(entry.copied);
    Py_ssize_t top_bumped = highest(entry.bumped);
    top = top_bumped > top ? top_bumped : top;
    top = index > top ? index : top;
    entry.needs = top + 1;
    Py_INCREF(addresses_match);
    entry.addresses_match = addresses_match;
    if (buffers != Py_None) {
        Py_INCREF(buffers);
        entry.buffers = buffers;
    }
    Py_INCREF(captured);
    entry.captured = captured;
    self->index = index;
    (*self->entries)[static_cast<uintptr_t>(key)] = std::move(made);
    Py_RETURN_NONE;
}

// disarm(key) -> int: the replays the entry made since it was armed (0 when none is armed for key); it is gone.
PyObject* disarm(PyObject* object, PyObject* arg) {
    auto* self = reinterpret_cast<SteadyLeaving*>(object);
    unsigned long long key = PyLong_AsUnsignedLongLong(arg);
    if (key == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        return nullptr;
    }
    auto found = self->entries->find(static_cast<uintptr_t>(key));
    if (found == self->entries->end()) {
        return PyLong_FromLong(0);
    }
    Py_ssize_t replays = found->second->replays;
    self->entries->erase(found);
    return PyLong_FromSsize_t(replays);
}

PyObject* get_armed(PyObject* object, void*) {
    return PyLong_FromSize_t(reinterpret_cast<SteadyLeaving*>(object)->entries->size());
}

PyObject* get_fast_replays(PyObject* object, void*) {
    return PyLong_FromUnsignedLongLong(reinterpret_cast<SteadyLeaving*>(object)->fast_replays);
}

int init(PyObject* object, PyObject* args, PyObject* kwargs) {
    auto* self = reinterpret_cast<SteadyLeaving*>(object);
    static const char* keywords[] = {"runner", "registry", "runtime", nullptr};
    PyObject *runner = nullptr, *registry = nullptr, *runtime = nullptr;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO", const_cast<char**>(keywords), &runner, &registry,
                                     &runtime)) {
        return -1;
    }
    if (is_grad_enabled == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "SteadyLeaving: call setup() first");
        return -1;
    }
    Py_INCREF(runner);
    Py_INCREF(registry);
    Py_INCREF(runtime);
    Py_XSETREF(self->runner, runner);
    Py_XSETREF(self->registry, registry);
    Py_XSETREF(self->runtime, runtime);
    return 0;
}

PyObject* make(PyTypeObject* type, PyObject*, PyObject*) {
    auto* self = reinterpret_cast<SteadyLeaving*>(type->tp_alloc(type, 0));
    if (self == nullptr) {
        return nullptr;
    }
    self->index = -1;
    self->fast_replays = 0;
    self->entries = new (std::nothrow) Entries();
    if (self->entries == nullptr) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return reinterpret_cast<PyObject*>(self);
}

int traverse(PyObject* object, visitproc visit, void* arg) {
    auto* self = reinterpret_cast<SteadyLeaving*>(object);
    Py_VISIT(self->runner);
    Py_VISIT(self->registry);
    Py_VISIT(self->runtime);
    if (self->entries != nullptr) {
        for (auto& item : *self->entries) {
            Py_VISIT(item.second->addresses_match);
            Py_VISIT(item.second->buffers);
            Py_VISIT(item.second->captured);
        }
    }
    return 0;
}

int clear(PyObject* object) {
    auto* self = reinterpret_cast<SteadyLeaving*>(object);
    Py_CLEAR(self->runner);
    Py_CLEAR(self->registry);
    Py_CLEAR(self->runtime);
    if (self->entries != nullptr) {
        Entries dropped;
        dropped.swap(*self->entries);  // emptied first: a decref below may run Python that calls back here
    }
    return 0;
}

void dealloc(PyObject* object) {
    auto* self = reinterpret_cast<SteadyLeaving*>(object);
    PyObject_GC_UnTrack(object);
    clear(object);
    delete self->entries;
    self->entries = nullptr;
    Py_TYPE(object)->tp_free(object);
}

PyMethodDef type_methods[] = {
    {"arm", arm, METH_VARARGS,
     "arm(index, key, inference, changes, limit, addresses_match, buffers, copied, captured, bumped): the entry of "
     "parameter set `key` replays from here while the registry's change count is `changes`, at most `limit` times"},
    {"disarm", disarm, METH_O, "disarm(key) -> int: the replays the entry made since it was armed; it is gone"},
    {nullptr, nullptr, 0, nullptr}};

PyObject* get_runtime(PyObject* object, void*) {
    return new_reference(reinterpret_cast<SteadyLeaving*>(object)->runtime);
}

PyObject* get_runner(PyObject* object, void*) {
    return new_reference(reinterpret_cast<SteadyLeaving*>(object)->runner);
}

PyGetSetDef type_getset[] = {
    {"runtime", get_runtime, nullptr, "the ModelRuntime it replays for (as a frame's function carries it)", nullptr},
    {"runner", get_runner, nullptr, "the PartitionRunner whose steady replays it makes", nullptr},
    {"armed", get_armed, nullptr, "how many parameter sets have an armed entry", nullptr},
    {"fast_replays", get_fast_replays, nullptr, "every replay made here since this object was made", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject steady_leaving_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

// setup(is_grad_enabled, is_inference_mode_enabled, any_autocast, copy_all, increment_versions, clone) -> None
PyObject* setup(PyObject*, PyObject* args) {
    PyObject *grad = nullptr, *inference = nullptr, *autocast = nullptr, *copy = nullptr, *bump = nullptr,
             *copy_out = nullptr;
    if (!PyArg_ParseTuple(args, "OOOOOO", &grad, &inference, &autocast, &copy, &bump, &copy_out)) {
        return nullptr;
    }
    PyObject* given[] = {grad, inference, autocast, copy, bump, copy_out};
    PyObject** slots[] = {&is_grad_enabled, &is_inference_mode_enabled, &any_autocast, &copy_all,
                          &increment_versions, &clone};
    for (int k = 0; k < 6; ++k) {
        if (!PyCallable_Check(given[k])) {
            PyErr_Format(PyExc_TypeError, "setup: argument %d is not callable", k + 1);
            return nullptr;
        }
    }
    for (int k = 0; k < 6; ++k) {
        Py_INCREF(given[k]);
        Py_XSETREF(*slots[k], given[k]);
    }
    Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(is_grad_enabled, is_inference_mode_enabled, any_autocast, copy_all, increment_versions, clone): the "
     "torch callables a steady replay uses"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_steady_replay",
                      "The steady copy-out replay of a frame that is one partition call, in one C call.", -1,
                      module_methods};

}  // namespace

PyMODINIT_FUNC PyInit__steady_replay(void) {
    static const char* names[] = {"replay", "changes", "dead", "leaving"};
    PyObject** slots[] = {&name_replay, &name_changes, &name_dead, &name_leaving};
    for (int k = 0; k < 4; ++k) {
        *slots[k] = PyUnicode_InternFromString(names[k]);
        if (*slots[k] == nullptr) {
            return nullptr;
        }
    }
    CallableSlots type = {"cgcompile._steady_replay.SteadyLeaving",
                          "SteadyLeaving(runner, registry, runtime): call it with a frame's arguments",
                          sizeof(SteadyLeaving), make, init, dealloc, traverse, clear, call, type_methods, type_getset};
    return module_with_callable(&module, &steady_leaving_type, type, "SteadyLeaving");
}

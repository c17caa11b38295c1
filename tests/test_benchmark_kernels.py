"""The benchmarks' kernel and launch counting: bench_gpu's CUDA counts from profiler events, the CPU proxy's host-op
counter, kernel_count.py's per-kernel rule and the kernel-by-kernel diff of two variants (bench_gpu --kernel-diff).
"""

import re

from tests.bench_scripts import load_bench, load_bench_gpu, rows_of, run_script, table_of


def test_cuda_counts_from_profiler_events():
    """The CUDA-only counting, on events shaped like torch.profiler's: runtime/driver launch calls by substring
    (names differ across CUDA versions), graph launches apart, device-side memcpy only as busy time, syncs from
    the aten ops."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    bench = load_bench_gpu()

    def ev(name, device=DeviceType.CPU, us=0, parent=None):
        return SimpleNamespace(name=name, device_type=device, cpu_parent=parent,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    index = ev("aten::index")
    events = [ev(n) for n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                              "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch", "cudaGraphLaunch_v10000",
                              "cudaStreamSynchronize", "cudaEventRecord", "aten::mm", "aten::copy_")]
    events += [ev("void gemm_kernel<...>", DeviceType.CUDA, us=300),
               ev("Memcpy DtoH (Device -> Pageable)", DeviceType.CUDA, us=100),
               index, ev("aten::nonzero", parent=index), ev("aten::nonzero"),
               ev("cudaLaunchKernel", parent=index)]
    busy, launches, graphs, syncs = bench.cuda_counts(events, n=2)
    assert busy == 0.2  # (300 + 100) us over 2 steps
    assert (launches, graphs, syncs) == (7 / 2, 2 / 2, 2 / 2)
    assert bench.cuda_counts([ev("aten::mm")], n=1)[0] is None  # no device activity seen: no busy bound


def test_host_op_counter_sees_nested_syncs():
    """torch.where(mask) reads the count through aten::nonzero_numpy, .item() through aten::item: a top-level op
    that reaches a sync op is one sync, however deep."""
    import torch

    from cgcompile.profiling import HostOpCounter

    x = torch.tensor([0.0, 1.0, 2.0])
    with HostOpCounter() as counter:
        torch.where(x > 0)
        x.sum().item()
        x[x > 0]
        torch.nonzero(x)
        x * 2
    assert counter.syncs == 4
    assert counter.ops == 4 + 4  # the four that read nothing (gt twice, sum, mul) are ops, not syncs
    assert counter.replays == 0


def test_kernel_count_counts_each_kernel_once_and_not_the_emulators_own_work():
    """Table (j)'s rules on events shaped like torch.profiler's: the innermost kernel-running op (the emulator's
    dispatch mode shows a graph's op twice), an Inductor kernel, a _foreach_ op once, no-kernel ops never, and
    inside a replay only the graph's ops (the emulator's own copies and poison launch nothing on a GPU)."""
    from types import SimpleNamespace

    kernels = load_bench("kernel_count")

    def ev(name, parent=None):
        return SimpleNamespace(name=name, cpu_parent=parent)

    replay = ev(kernels.REPLAY_RANGE)
    outer_mm = ev("aten::mm", replay)
    mode = ev("PythonDispatchMode", outer_mm)
    foreach = ev("aten::_foreach_copy_")
    linear = ev("aten::linear")
    bmm = ev("aten::bmm")
    events = [replay, outer_mm, mode, ev("aten::mm", mode), ev("graph_3_cpp_fused_add_0", replay),
              ev("aten::copy_", replay), ev("aten::fill_", replay),  # the emulator's own work
              foreach, ev("aten::copy_", foreach), ev("aten::copy_", foreach), linear, ev("aten::addmm", linear),
              bmm, ev("aten::resolve_conj", bmm), ev("aten::to"), ev("aten::detach"), ev("aten::clone")]
    found = kernels.count_kernels(events)
    assert found == {("graph", "aten::mm"): 1, ("graph", "inductor cpp_fused_add_0"): 1,
                     ("host", "aten::_foreach_copy_"): 1, ("host", "aten::addmm"): 1, ("host", "aten::bmm"): 1,
                     ("host", "aten::clone"): 1}
    base = {("host", "inductor cpp_fused_add_0"): 1, ("host", "aten::mm"): 1}
    rows = kernels.diff_rows({"inductor": base, "cg-inductor": found}, "inductor", "cg-inductor")
    assert [op for op, _ in rows] == ["aten::_foreach_copy_", "aten::addmm", "aten::bmm", "aten::clone"]


def test_kernel_count_names_a_linear_with_bias_by_its_gemm_on_real_profiler_events():
    """On the CPU an `aten::addmm` copies its bias into its output (an `aten::copy_` child) and calls BLAS, no aten
    op: the copy is part of the GEMM, which is counted as itself; a clone's copy is a kernel of its own."""
    import torch

    kernels = load_bench("kernel_count")
    linear, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        linear(x)
        x.clone()
    assert kernels.count_kernels(prof.events()) == {("host", "aten::addmm"): 1, ("host", "aten::copy_"): 1}


def test_kernel_count_counts_a_foreach_copy_as_cuda_launches_it():
    """CUDA copies a `_foreach_copy_` list in one kernel only when every destination has one dtype, every source
    one dtype and each pair the same size and stride; otherwise tensor by tensor (one kernel each)."""
    import torch

    kernels = load_bench("kernel_count")
    f32, bf16 = [torch.zeros(3), torch.zeros(2)], [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2)]
    sources, dense, strided = [torch.ones(3), torch.ones(2)], [torch.zeros(2, 3), torch.zeros(2)], torch.ones(2, 6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        torch._foreach_copy_(f32, sources)  # one dtype: one kernel
        torch._foreach_copy_(bf16, sources)  # two destination dtypes: one per tensor
        torch._foreach_copy_(dense, [strided[:, ::2], sources[1]])  # a pair's strides differ: one per tensor
    # torch 2.11's profiler records neither dtypes nor strides: there only sizes tell
    dtypes, strides = (all(hasattr(e, name) for e in prof.events()) for name in ("input_dtypes",
                                                                                "structured_input_strides"))
    assert kernels.count_kernels(prof.events()) == {("host", "aten::_foreach_copy_"): 1 + (2 if dtypes else 1)
                                                    + (2 if strides else 1)}

def test_kernel_diff_table_sorts_by_difference_and_sums_every_kernel():
    """gpu_kernels.diff_table on hand-made tables: the largest launch difference first (time breaks ties), long
    CUDA names cut for display but kept apart, kernels past `top` summed in one row, totals = sum of the rows,
    the B / A ratios; a device table from profiler-shaped events; a missing variant named in one line."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    kernels = load_bench("gpu_kernels")
    long = "void at::native::elementwise_kernel<128, 2, " + "x" * 100
    a = {"gemm": (10.0, 500.0), "copy": (2.0, 4.0), "norm": (3.0, 30.0), long + "A": (1.0, 1.0), "gone": (1.0, 8.0)}
    b = {"gemm": (10.0, 400.0), "copy": (8.0, 16.0), "norm": (3.0, 33.0), long + "A": (1.0, 1.0),
         long + "B": (2.0, 2.0), "extra": (1.0, 2.0)}
    lines = kernels.diff_table("reduce-overhead", a, "cg-local-inductor", b, top=5)
    assert lines[0] == ("| kernel | reduce-overhead launches/step | cg-local-inductor launches/step | "
                        "reduce-overhead µs/step | cg-local-inductor µs/step |")
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:-2]]
    # |launch diff|: copy 6, long+B 2, then 1 each (gone 8 µs, extra 2 µs), then 0 each (gemm 100 µs, norm 3 µs)
    assert [r[0] for r in rows] == ["copy", long[:79] + "…", "gone", "extra", "gemm", "(2 more kernels)"]
    assert rows[1][1:] == ["0.0", "2.0", "0.0", "2.0"] and rows[-1][1:] == ["4.0", "4.0", "31.0", "34.0"]
    total = [c.strip() for c in lines[-2].strip("|").split(" | ")]
    assert total == ["total (7 kernels)", "17.0", "25.0", "543.0", "454.0"]
    for i in range(1, 5):
        assert float(total[i]) == sum(float(r[i]) for r in rows)
    assert lines[-1] == "cg-local-inductor / reduce-overhead: launches 1.47x, time 0.84x"
    assert kernels.shown("a|b") == "a\\|b"

    def ev(name, device, us):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [ev("gemm_kernel", DeviceType.CUDA, 30), ev("gemm_kernel", DeviceType.CUDA, 50),
              ev("Memcpy HtoD (Pageable -> Device)", DeviceType.CUDA, 4), ev("cudaGraphLaunch", DeviceType.CPU, 9),
              ev("aten::mm", DeviceType.CPU, 60)]
    assert kernels.cuda_kernel_table(events, n=2) == {"gemm_kernel": (1.0, 40.0),
                                                       "Memcpy HtoD (Pageable -> Device)": (0.5, 2.0)}
    bench = load_bench_gpu()
    results = {"reduce-overhead": bench.Result("reduce-overhead", skipped="needs CUDA (cudagraph trees)"),
               "cg-local-inductor": bench.Result("cg-local-inductor", kernels=b)}
    assert kernels.kernel_diff_lines("decode", results, "reduce-overhead", "cg-local-inductor", False) == [
        ("kernel diff reduce-overhead vs cg-local-inductor (decode): no table: reduce-overhead (skipped: needs CUDA "
         "(cudagraph trees))")]


def test_bench_gpu_cpu_smoke_kernel_diff(tmp_path):
    """--kernel-diff A,B on the CPU: the table comes from each variant's profiled pass (a replayed graph's kernels
    counted as kernels, as on a GPU), is printed and appended to the markdown report, its totals the rows' sums."""
    report = tmp_path / "r.md"
    out = run_script("bench_gpu.py", "--cpu-smoke", "--quick", "--models", "decode", "--variants",
                     "eager,cg-local-eager", "--kernel-diff", "eager,cg-local-eager", "--no-host-time",
                     "--markdown", str(report), timeout=120)
    head = "| kernel | eager launches/step | cg-local-eager launches/step | eager µs/step | cg-local-eager µs/step |"
    for text in (out, report.read_text()):
        assert "kernel diff eager (A) vs cg-local-eager (B), decode; CPU proxy" in text, text
        lines = text.split(head + "\n")[1].splitlines()
        rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[1:]
                if line.startswith("| ") and not line.startswith("| total")]
        total = next(line for line in lines if line.startswith("| total"))
        total = [float(c) for c in total.strip("|").split(" | ")[1:]]
        table = {r[0]: [float(c) for c in r[1:]] for r in rows}
        assert "aten::mm" in table and table["aten::mm"][0] > 0 and table["aten::mm"][1] > 0, text
        for i in range(4):
            assert abs(total[i] - sum(r[i] for r in table.values())) <= 0.05 * len(table), (i, text)
        # the kernels inside cg-local-eager's replayed graph count: far more than its launches outside replays
        assert total[1] > 2 * float(rows_of(table_of(out, "decode"))["cg-local-eager"]["launches"]), text
        assert re.search(r"^cg-local-eager / eager: launches \d+\.\d\dx, time \d+\.\d\dx$", text, re.MULTILINE), text

"""Kernel-by-kernel tables for the GPU benchmark (issue 36): where two variants' step times differ, which kernels.

A table is {kernel name: (launches per step, µs per step)}, taken from the profiled pass that run_variant
(gpu_harness.py) already makes:
- on CUDA, the device-side events (kernels, memcpy, memset) with their device time: the kernels of a replayed
  CUDA graph are device events too, so a graph replay counts as the kernels it runs, as a reduce-overhead or
  cgcompile step should be compared;
- on the CPU (bench_gpu.py --cpu-smoke), the kernels that kernel_count.py counts (innermost kernel-running aten
  ops and Inductor kernels, the emulate driver's own copies left out), with their self CPU time.
diff_table puts two tables side by side as markdown, the largest differences first.
"""

from __future__ import annotations

from collections.abc import Iterable

from kernel_count import kernel_events

Table = dict[str, tuple[float, float]]  # kernel name -> (launches per step, µs per step)
SHOWN_CHARS = 80  # CUDA template kernel names run to hundreds of characters: rows show this much
DEFINITIONS = {
    True: "per step: device-side kernel / memcpy / memset events under torch.profiler (kernels of replayed CUDA "
          "graphs included), µs = their device time",
    False: "CPU proxy: kernels as benchmarks/kernel_count.py counts them (innermost kernel-running aten ops, "
           "Inductor kernels only with cpp.enable_kernel_profile), "
           "µs = their self CPU time",
}


def per_step(found: Iterable[tuple[str, float]], n: int) -> Table:
    """(kernel, µs) for each kernel run in n steps -> the table: launches and µs summed per kernel, over n."""
    sums: dict[str, list[float]] = {}
    for name, us in found:
        entry = sums.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    return {name: (count / n, us / n) for name, (count, us) in sums.items()}


def cuda_kernel_table(events: Iterable, n: int) -> Table:
    """The per-kernel table of n profiled steps on CUDA: every device-side event, keyed by its full name."""
    from torch.autograd import DeviceType

    return per_step(((e.name, e.time_range.elapsed_us()) for e in events if e.device_type == DeviceType.CUDA), n)


def cpu_kernel_table(events: Iterable, n: int) -> Table:
    """The per-kernel table of n profiled steps on the CPU, by kernel_count.py's rules, inside graph replays or
    not (a device table cannot tell them apart either)."""
    return per_step(((op, getattr(event, "self_cpu_time_total", 0.0)) for _, op, event in kernel_events(events)), n)


def shown(name: str) -> str:
    """A kernel name as a table cell: cut to SHOWN_CHARS, pipes escaped (the row is still keyed on the whole)."""
    text = name if len(name) <= SHOWN_CHARS else name[:SHOWN_CHARS - 1] + "…"
    return text.replace("|", "\\|")


def ratio_text(b: float, a: float) -> str:
    return f"{b / a:.2f}x" if a else "n/a"


def diff_table(a_name: str, a: Table, b_name: str, b: Table, top: int = 25) -> list[str]:
    """Markdown lines: one row per kernel, the largest |difference| in launches per step first, then in time; the
    kernels past `top` summed in one row, so the totals row is always the sum of the rows above it; then the ratio
    of B's totals to A's (A: the baseline)."""
    zero = (0.0, 0.0)
    names = sorted(set(a) | set(b), key=lambda k: (-abs(b.get(k, zero)[0] - a.get(k, zero)[0]),
                                                   -abs(b.get(k, zero)[1] - a.get(k, zero)[1]), k))
    rows = [(shown(k), *a.get(k, zero), *b.get(k, zero)) for k in names[:top]]
    rest = names[top:]
    if rest:
        rows.append((f"({len(rest)} more kernels)", *(sum(t.get(k, zero)[i] for k in rest)
                                                      for t, i in ((a, 0), (a, 1), (b, 0), (b, 1)))))
    totals = [sum(r[i] for r in rows) for i in range(1, 5)]
    lines = [f"| kernel | {a_name} launches/step | {b_name} launches/step | {a_name} µs/step | {b_name} µs/step |",
             "|---|---:|---:|---:|---:|"]
    for kernel, a_n, a_us, b_n, b_us in rows:
        lines.append(f"| {kernel} | {a_n:.1f} | {b_n:.1f} | {a_us:.1f} | {b_us:.1f} |")
    a_n, a_us, b_n, b_us = totals
    lines.append(f"| total ({len(names)} kernels) | {a_n:.1f} | {b_n:.1f} | {a_us:.1f} | {b_us:.1f} |")
    lines.append(f"{b_name} / {a_name}: launches {ratio_text(b_n, a_n)}, time {ratio_text(b_us, a_us)}")
    return lines


def kernel_diff_lines(title: str, results: dict, a_name: str, b_name: str, cuda: bool) -> list[str]:
    """bench_gpu.py --kernel-diff A,B for one workload's rows ({variant: Result}): the diff table with a heading
    and what its numbers are, or one line saying which variant has no table and why."""
    missing = []
    for name in (a_name, b_name):
        r = results.get(name)
        why = ("not run on this workload" if r is None else f"skipped: {r.skipped}" if r.skipped else
               f"n/a: {r.error}" if r.error else f"profiled pass failed: {r.profile_error}" if r.profile_error
               else None if r.kernels else "no kernels seen in the profiled pass")
        if why:
            missing.append(f"{name} ({why})")
    if missing:
        return [f"kernel diff {a_name} vs {b_name} ({title}): no table: " + "; ".join(missing)]
    return [f"kernel diff {a_name} (A) vs {b_name} (B), {title}; {DEFINITIONS[cuda]}", "",
            *diff_table(a_name, results[a_name].kernels, b_name, results[b_name].kernels)]

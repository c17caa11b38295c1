"""The GPU benchmark's goals (issues 36 and 37), judged from bench_gpu.py's rows: one place that names them."""

from __future__ import annotations

from gpu_harness import PADDED_VARIANTS, Result, ratio

NEW_TOKEN_MOE = ("moe", "mixtral")  # the small workloads the captured-experts goal is about
# Issue 37's goals, by workload name (workloads_hf.py): padded MoE >= 3x eager and >= 2x reduce-overhead; peak
# memory <= 1.3x eager on the training workloads; decode within 1.1x of its GPU-busy time.
PADDED_MOE = ("qwen3moe-sync",)
TRAINING = ("llama-train", "qwen3moe-train", "qwen3moe-sync")
DECODE_PREFIX = "llama8b-decode"


def goal_rows(all_results: dict[str, dict[str, Result]], judged: bool = True) -> list[tuple]:
    """(goal, measured, PASS/MISS/n/a) for the issues' goals, for each cgcompile variant that ran. judged=False
    (CPU smoke: no GPU timings) still shows the ratios, with verdict n/a."""
    rows = []

    def get(workload, variant, attr):
        r = all_results.get(workload, {}).get(variant)
        return None if r is None or r.error else getattr(r, attr)

    def row(text, value, ok):
        rows.append((text, "-" if value is None else f"{value:.2f}x",
                     "n/a" if value is None or not judged else ("PASS" if ok(value) else "MISS")))

    for inner in ("eager", "inductor"):
        v = f"cg-local-{inner}"
        if v not in all_results.get("moe", {}) and v not in all_results.get("decode", {}):
            continue
        row(f"moe step >= 1.5x eager ({v})", ratio(get("moe", "eager", "step_ms"), get("moe", v, "step_ms")),
            lambda x: x >= 1.5)
        row(f"moe step no slower than reduce-overhead ({v}; speedup)",
            ratio(get("moe", "reduce-overhead", "step_ms"), get("moe", v, "step_ms")), lambda x: x >= 1.0)
        if inner == "eager":
            for w in ("moe", "decode"):
                row(f"{w} compile+capture <= 1/3 of reduce-overhead's ({v})",
                    ratio(get(w, v, "compile_s"), get(w, "reduce-overhead", "compile_s")), lambda x: x <= 1 / 3)
        row(f"decode step within 1.1x of its GPU-busy bound ({v})",
            ratio(get("decode", v, "step_ms"), get("decode", v, "busy_ms")), lambda x: x <= 1.1)
        if inner == "inductor":
            row(f"decode step no slower than reduce-overhead ({v}; speedup)",
                ratio(get("decode", "reduce-overhead", "step_ms"), get("decode", v, "step_ms")), lambda x: x >= 1.0)
    if "cg-full-iteration" in all_results.get("decode", {}):
        row("decode step within 1.1x of its GPU-busy bound (cg-full-iteration)",
            ratio(get("decode", "cg-full-iteration", "step_ms"), get("decode", "cg-full-iteration", "busy_ms")),
            lambda x: x <= 1.1)
    for v in ("cg-local-eager+sizes", "cg-local-inductor+sizes"):
        if v in all_results.get("decode-varying", {}):
            row(f"decode-varying step faster than reduce-overhead ({v}; speedup)",
                ratio(get("decode-varying", "reduce-overhead", "step_ms"), get("decode-varying", v, "step_ms")),
                lambda x: x > 1.0)
    for w in NEW_TOKEN_MOE:  # experts captured with dynamic_padding, new tokens every step
        for v in PADDED_VARIANTS:
            if v not in all_results.get(w, {}):
                continue
            row(f"{w} step >= 3x eager ({v})", ratio(get(w, "eager", "step_ms"), get(w, v, "step_ms")),
                lambda x: x >= 3.0)
            row(f"{w} step >= 2x reduce-overhead ({v}; speedup)",
                ratio(get(w, "reduce-overhead", "step_ms"), get(w, v, "step_ms")), lambda x: x >= 2.0)
            row(f"{w} step within 1.5x of its GPU-busy bound ({v})",
                ratio(get(w, v, "step_ms"), get(w, v, "busy_ms")), lambda x: x <= 1.5)
            row(f"{w} peak memory <= 1.5x eager's ({v})",
                ratio(get(w, v, "peak_mib"), get(w, "eager", "peak_mib")), lambda x: x <= 1.5)
    ran = lambda w: [v for v, r in all_results.get(w, {}).items() if not r.skipped]  # noqa: E731
    for w in PADDED_MOE:
        for v in ran(w):
            if v.startswith("cg-") and ("+max" in v or "+buckets" in v):
                row(f"{w} step >= 3x eager ({v})", ratio(get(w, "eager", "step_ms"), get(w, v, "step_ms")),
                    lambda x: x >= 3.0)
                row(f"{w} step >= 2x reduce-overhead ({v}; speedup)",
                    ratio(get(w, "reduce-overhead", "step_ms"), get(w, v, "step_ms")), lambda x: x >= 2.0)
    for w in TRAINING:
        for v in ran(w):
            if v.startswith("cg-"):
                row(f"{w} peak memory <= 1.3x eager's ({v})",
                    ratio(get(w, v, "peak_mib"), get(w, "eager", "peak_mib")), lambda x: x <= 1.3)
    for w in all_results:
        if w.startswith(DECODE_PREFIX):
            for v in ran(w):
                if v.startswith("cg-"):
                    row(f"{w} step within 1.1x of its GPU-busy time ({v})",
                        ratio(get(w, v, "step_ms"), get(w, v, "busy_ms")), lambda x: x <= 1.1)
    return rows

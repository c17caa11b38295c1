"""Where cgcompile deliberately differs from Megatron-Core 0.19.2 on the parity cases (tests/megatron_cases.py).

The one list of documented differences: tests/test_megatron_parity.py asserts that every case either agrees
with Megatron-Core or is listed here (and that every listed case does differ), and that the "Megatron
compatibility" table of docs/guides/megatron.md is `differences_table()` verbatim. Print it with ``python tests/megatron_differences.py``.
"""

from __future__ import annotations

DIFFERENCES: list[dict[str, object]] = [
    {
        "what": "`cuda_graph_impl` not given",
        "megatron": "`none` (nothing captured)",
        "cgcompile": "`local`",
        "why": "choosing backend=\"cudagraph_modules\" means you want capture; pass `cuda_graph_impl=\"none\"` "
               "for Megatron's default",
        "cases": ["impl=unset/modules=empty", "impl=unset/modules=attn", "impl=unset/modules=moe_router",
                  "all_unset", "impl=unset/scope=empty", "impl=unset/scope=attn",
                  "impl=unset/scope=attn+moe_router", "impl=unset/scope=moe_preprocess",
                  "impl=unset/scope=full_str", "impl=unset/scope=full_iteration_inference",
                  "impl=unset/scope=attn+full_iteration_inference"],
    },
    {
        "what": "an option given as `None`",
        "megatron": "`cuda_graph_impl=None`: AssertionError (invalid implementation)",
        "cgcompile": "None = not given, the default applies",
        "why": "config files and argument dumps write None for unset options",
        "cases": ["impl=None"],
    },
    {
        "what": "names in another case (`\"Local\"`, `[\"ATTN\"]`)",
        "megatron": "AssertionError / KeyError",
        "cgcompile": "accepted, case-insensitive",
        "why": "the names are unambiguous; a typo still gets a ConfigError with a suggestion",
        "cases": ["impl=upper_case", "modules=upper_case"],
    },
    {
        "what": "custom tags (`[\"attn\", \"my_block\"]`)",
        "megatron": "KeyError (only its six module names)",
        "cgcompile": "accepted: regions tagged `my_block` (`cgcompile.tag`) are captured",
        "why": "plain PyTorch models name their own regions; near-misses of Megatron names stay errors",
        "cases": ["modules=custom_tag"],
    },
    {
        "what": "comma strings with spaces or empty pieces (`\"attn, mlp\"`, `\"attn,,mlp\"`)",
        "megatron": "KeyError (`' mlp'`, `''`)",
        "cgcompile": "`[attn, mlp]`",
        "why": "the command-line form people type; nothing else could be meant",
        "cases": ["modules=comma_str_spaces", "modules=comma_str_empty_piece"],
    },
    {
        "what": "`\"full\"` repeated (`[\"full\", \"full\"]`)",
        "megatron": "AssertionError (full with other scopes)",
        "cgcompile": "deduplicated: `[]` (whole layer), with the deprecation warning",
        "why": "duplicates are dropped for every module name",
        "cases": ["modules=full+full"],
    },
    {
        "what": "`cuda_graph_warmup_steps=0`",
        "megatron": "accepted silently",
        "cgcompile": "accepted with a UserWarning",
        "why": "capturing on the first call can capture lazily built state half-built",
        "cases": ["warmup=0"],
    },
    {
        "what": "`cuda_graph_warmup_steps` negative or fractional (`-1`, `1.5`)",
        "megatron": "accepted",
        "cgcompile": "ConfigError",
        "why": "a step count; any other value is a mistake better reported before tracing",
        "cases": ["warmup=-1", "warmup=1.5"],
    },
    {
        "what": "a non-bool flag value (`enable_cuda_graph=\"yes\"`)",
        "megatron": "accepted as truthy: impl `local`",
        "cgcompile": "ConfigError (True/False, or 1/0)",
        "why": "`\"no\"` would be truthy too; a flag's value must be unambiguous",
        "cases": ["enable=str"],
    },
]


def documented_cases() -> dict[str, dict[str, object]]:
    """Case id -> the difference that documents it."""
    return {case: difference for difference in DIFFERENCES for case in difference["cases"]}  # type: ignore[union-attr]


def differences_table() -> str:
    """The docs table (docs/guides/megatron.md): one row per difference, with how many parity cases it covers."""
    rows = ["| case | Megatron-Core 0.19.2 | cgcompile | why | parity cases |", "|---|---|---|---|---|"]
    for difference in DIFFERENCES:
        rows.append(f"| {difference['what']} | {difference['megatron']} | {difference['cgcompile']} | "
                    f"{difference['why']} | {len(difference['cases'])} |")  # type: ignore[arg-type]
    return "\n".join(rows)


if __name__ == "__main__":
    print(differences_table())

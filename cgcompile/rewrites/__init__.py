"""FX rewrites made before planning, each on a copy the backend owns (the passes in passes/ only read): scalar
reads hoisted to the top, data-dependent index ops made static (dynamic_padding), checkpoints inlined around
eager islands. One rewrites aot's aten graphs instead, for the eager inner compiler at run time: a graph input's
functional write done in place again (input_writes.py)."""

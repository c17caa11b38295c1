"""Who owns which bytes: a graph's memory claim (held or free), output arenas shared by one partition's graphs
of different sizes, and their sizing."""

"""Drivers: the capture/replay contract (base.py) and its implementations, real CUDA graphs (cuda.py), the CPU
emulation that enforces the same contract (emulate.py) and eager (select.py picks one), with what every capture
shares: the capture guard and its host-sync rules, the undo of writes made by a run that stands for no real
execution, the thread state a capture preserves, and the user's frames named in errors. Nothing here knows of
partitions, families or the graph bank."""

"""The graph bank: which call a graph serves (the bank key and the parameter set) and which graphs a partition
keeps (the policy, decided from counters alone)."""

"""The local runtime (`cuda_graph_impl="local"`): one PartitionRunner per captured partition, one GraphFamily per
input signature (aot_autograd's forward and backward), one GraphInstance per captured graph, and the ModelRuntime
all partitions of a compiled frame share."""

"""Engine: the background engine of a process (negotiation table, executor and its groups, devices, handles, the
speculative and fresh rounds, autotune, timeline). Imports backends, algorithms, transport and the ground floor
only; the process API at ``spark_hvd.core``'s root sits above it."""

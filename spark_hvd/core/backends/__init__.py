"""Backends: the implementations of the core's ``Backend`` interface (the built-in ring, MPI, torch.distributed,
the single-process one) and the torch.distributed store over the job's rendezvous. Imports algorithms, transport and
the ground floor only."""
